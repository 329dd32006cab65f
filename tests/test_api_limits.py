"""Hostile requests with a valid token, against the real server: every count a request can make
the server build or run is refused as it was sent (422 naming the field, before any job exists),
and the server stays responsive right after."""
from __future__ import annotations

import time

import httpx
import pytest

from api.limits import OverLimit, RequestLimits, check_totals
from bench.api_probes.limits import PROBES, post_raw, probe_body
from tests.api_helpers import request

pytestmark = [pytest.mark.ray]
LIMITS = RequestLimits()


def _over(**overrides) -> dict:
    return request(**overrides)


@pytest.mark.parametrize("where,change,field", [p[1:] for p in PROBES], ids=[p[0] for p in PROBES])
def test_a_hostile_request_is_refused_at_once_and_the_server_stays_responsive(api_service, where, change, field):
    body = probe_body(request(), where, change)
    with api_service.client() as http:
        # The first request of a server loads the dataset it names: a cost of the service, not of the probe.
        assert post_raw(http, _over(alpha=2.0)).status_code == 422
        before = http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]
        started = time.perf_counter()
        response = post_raw(http, body)
        took = time.perf_counter() - started
        assert response.status_code == 422, response.text
        errors = response.json()["detail"]
        assert any(field in [str(p) for p in e["loc"]] for e in errors), errors
        assert took < 2.0, f"refusing took {took:.2f} s"
        started = time.perf_counter()
        assert httpx.get(f"{api_service.url}/healthz", timeout=5).status_code == 200
        assert time.perf_counter() - started < 0.2
        assert http.get("/v1/distillations", params={"limit": 100}).json()["jobs"] == before  # no job made


def test_a_limit_names_the_setting_that_raises_it(api_service):
    with api_service.client() as http:
        response = post_raw(http, _over(k=LIMITS.k + 1))
    message = response.json()["detail"][0]["msg"]
    assert f"at most {LIMITS.k}" in message and "FADRM_MAX_K" in message, message


def test_the_largest_allowed_counts_are_accepted(api_service):
    """The limits refuse what is over them, not what is at them: k at its limit plans a job (its
    images never computed here: the request is checked and then cancelled)."""
    with api_service.client() as http:
        body = _over(k=LIMITS.k, iterations=(LIMITS.k + 1) * 2, seed=91)
        response = post_raw(http, body)
        assert response.status_code in (200, 202), response.text
        job = response.json()
        if job["state"] not in ("succeeded", "failed", "cancelled"):
            http.delete(f"/v1/distillations/{job['id']}")


def test_the_totals_bound_what_the_counts_do_together():
    """Each count under its limit, their product over the total: recover work, evaluation work,
    stored soft labels (the API test server allows too few images to reach them)."""
    small = RequestLimits(work=1000, eval_work=1000, soft_label_bytes=1000)
    check_totals(10, 100, 10, 10, 10, 1000, small)  # exactly at every total
    with pytest.raises(OverLimit, match="image-iterations") as exc:
        check_totals(10, 101, None, None, 1, 0, small)
    assert exc.value.loc == ("overrides", "iterations")
    with pytest.raises(OverLimit, match="image-epochs") as exc:
        check_totals(10, 100, 10, 10, 11, 0, small)
    assert exc.value.loc == ("evaluation", "epochs")
    with pytest.raises(OverLimit, match="soft_labels: online"):
        check_totals(10, 100, 10, 10, 10, 1001, small)


def test_the_documented_limits_are_the_defaults():
    """docs/service.md's table of limits names every limit with its default (api.limits owns them)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "service.md").read_text()
    rows = dict(re.findall(r"^\| `FADRM_MAX_(\w+)` \| ([\d ]+) \|", text, flags=re.M))
    documented = {name.lower(): float(value.replace(" ", "")) for name, value in rows.items()}
    # (FADRM_MAX_RUNNING, _QUEUED and _BODY_BYTES are the service's own settings, in another table.)
    assert {name: documented.get(name) for name in RequestLimits.model_fields} == \
        {name: float(getattr(LIMITS, name)) for name in RequestLimits.model_fields}


def test_a_class_set_is_one_job_whichever_order_it_is_listed_in():
    """[7, "3"] and [3, 7] name the same classes: the same config, so the same run id and job."""
    from api.requests import _class_indices

    names = [str(i) for i in range(10)]
    assert _class_indices([7, "3"], names) == _class_indices([3, 7], names) == [3, 7]
