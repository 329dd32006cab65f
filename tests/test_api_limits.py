"""Hostile requests with a valid token, against the real server: every count a request can make
the server build or run is refused as it was sent (422 naming the field, before any job exists),
and the server stays responsive right after; the evaluation work queued or running at once is
bounded (429)."""
from __future__ import annotations

import time

import httpx
import pytest

from api.planning.limits import OverLimit, RequestLimits, check_totals
from bench.api_probes.limits import PROBES, post_raw, probe_body
from tests.api_helpers import NO_RAY, request, running_service

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
    """docs/service.md's table of limits names every limit with its default (api.planning.limits owns them)."""
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
    from api.planning.requests import _class_indices

    names = [str(i) for i in range(10)]
    assert _class_indices([7, "3"], names) == _class_indices([3, 7], names) == [3, 7]


EVAL_BACKLOG = 300  # image-epochs of evaluation queued or running at once (FADRM_MAX_EVAL_BACKLOG)


@pytest.fixture(scope="module")
def backlogged(digits_teacher, tmp_path_factory):
    """A service with a small evaluation backlog; the job it accepts is cancelled at once (a Ray
    address no one answers: no job runs)."""
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-backlog"), ray_address=NO_RAY, max_ipc=5,
                         max_images=20, max_running=1, max_queued=4, rate_limit=1000, rate_burst=2000,
                         max_eval_backlog=EVAL_BACKLOG) as server:
        yield server


def test_the_evaluation_work_queued_at_once_is_bounded(backlogged):
    """2 classes x ipc 2 x 30 epochs x 2 seeds x 2 students a seed (the set's with soft labels, the
    ranking's with hard labels) = 480 image-epochs, over the service's 300: refused with 429 and
    Retry-After before any job exists; within it (one seed: 240), accepted."""
    with backlogged.client() as http:
        before = len(http.get("/v1/distillations").json()["jobs"])
        big = {**request(classes=(2, 9), seed=21), "evaluate": True, "evaluation": {"epochs": 30, "seeds": 2}}
        r = http.post("/v1/distillations", json=big)
        assert r.status_code == 429 and "FADRM_MAX_EVAL_BACKLOG" in r.json()["detail"] and r.headers["retry-after"]
        assert len(http.get("/v1/distillations").json()["jobs"]) == before
        small = {**big, "evaluation": {"epochs": 30, "seeds": 1}}  # 240 image-epochs
        r = http.post("/v1/distillations", json=small)
        assert r.status_code == 202, r.text
        http.delete(f"/v1/distillations/{r.json()['id']}")
