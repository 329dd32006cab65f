"""What the service refuses or answers before any job, against its app under a real uvicorn on
loopback in this process, with a Ray address no one answers (no job runs): a query string is as
strict as a body, a body without a JSON content type is a 422 saying which to send, and the
probes are answered outside the token's rate limit. The query strings again against the shared
real `fadrm serve` (`api_service`, a Ray test): none makes a job."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.api_helpers import in_process_service, request


@pytest.fixture
def strict(digits_teacher, tmp_path):
    """The app, limited to 1 request a second per token (2 at once), and a client with its token."""
    with in_process_service(tmp_path, digits_teacher[0], rate_limit=1, rate_burst=2) as (_, http):
        yield http


def _refused(r: httpx.Response, name: str) -> str:
    assert r.status_code == 422, (name, r.status_code, r.text)
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["query", name], r.text
    return detail["msg"]


def test_query_strings_bodies_and_probes(strict):
    job = "/v1/distillations/job-000000000000000000000000"
    unknown, plain = "unknown query parameter", "plain digits"
    cases = [("/healthz?x=1", "x", unknown), ("/readyz?x", "x", unknown), ("/v1/teachers?limit=1", "limit", unknown),
             (f"{job}/dataset?Format=imagefolder", "Format", unknown),
             (f"{job}/dataset?format%5B%5D=imagefolder", "format[]", unknown)]
    cases += [(f"/v1/distillations?limit={raw}", "limit", plain) for raw in ("1_0", "%201", "%2B1", "1.0", "1e1")]
    for path, name, said in cases:
        while (r := strict.get(path)).status_code == 429:  # the token's rate: 1 a second
            time.sleep(float(r.headers["retry-after"]))
        assert said in _refused(r, name), (path, r.text)
    time.sleep(2.5)
    assert "given 2 times" in _refused(strict.get("/v1/distillations?limit=5&limit=6"), "limit")
    time.sleep(1.5)
    assert _refused(strict.post("/v1/distillations?dry_run=1", json=request()), "dry_run")
    time.sleep(2.5)
    untyped = strict.post("/v1/distillations", content=b'{"dataset": "digits"}', headers={"Content-Type": ""})
    assert untyped.status_code == 422 and "Content-Type: application/json" in untyped.json()["detail"][0]["msg"]
    # The token over its rate: its other requests 429, the probes answered all the same.
    while strict.get("/v1/teachers").status_code != 429:
        pass
    ready = [strict.get("/readyz") for _ in range(10)]
    assert {r.status_code for r in ready} == {503}  # Ray is not reachable here: an answer, never a 429
    assert ready[-1].json()["ray"] is False and "Ray is not reachable" in ready[-1].json()["detail"]
    assert [strict.get(p).status_code for p in ("/healthz", "/healthz?", "/healthz?&&")] == [200] * 3
    assert strict.get("/v1/teachers").status_code == 429


def test_query_strings_are_as_strict_as_bodies(api_service):
    job = "/v1/distillations/job-000000000000000000000000"

    def newest(http) -> str | None:  # the shared server has others' jobs: a refused request makes none
        jobs = http.get("/v1/distillations", params={"limit": 1}).json()["jobs"]
        return jobs[0]["id"] if jobs else None

    with api_service.client() as http:
        before = newest(http)
        refused = {
            "POST /v1/distillations?dry_run=1": http.post("/v1/distillations?dry_run=1", json=request(seed=901)),
            "?format[]=": http.get(f"{job}/dataset?format%5B%5D=imagefolder"),
            "?Format=": http.get(f"{job}/dataset?Format=imagefolder"),
            "a repeated limit": http.get("/v1/distillations?limit=5&limit=6"),
            "/healthz?x": http.get("/healthz?x=1"),
            "/readyz?x": http.get("/readyz?x"),
            "/v1/teachers?limit": http.get("/v1/teachers?limit=1"),
            **{f"limit={raw}": http.get(f"/v1/distillations?limit={raw}")
               for raw in ("1_0", "%201", "%2B1", "1.0", "1e1", "0x10")},
            "index=1.0": http.get(f"{job}/teacher?index=1.0"),
        }
        for name, r in refused.items():
            assert r.status_code == 422, (name, r.status_code, r.text)
            assert r.json()["detail"][0]["loc"][0] == "query", (name, r.text)
        assert refused["POST /v1/distillations?dry_run=1"].json()["detail"][0]["loc"] == ["query", "dry_run"]
        assert refused["?format[]="].json()["detail"][0]["loc"] == ["query", "format[]"]
        assert refused["?Format="].json()["detail"][0]["loc"] == ["query", "Format"]
        assert "given 2 times" in refused["a repeated limit"].json()["detail"][0]["msg"]
        assert newest(http) == before  # no job made
        assert http.get("/v1/distillations?limit=10&state=queued").status_code == 200


def test_a_refused_query_string_counts_against_the_tokens_rate(strict):
    """The query string is checked after the token's rate: refused ones are not free of it, and
    a long one is counted whole but only its first errors are built."""
    many = strict.get("/v1/presets?" + "&".join(f"u{i}=1" for i in range(1000)))
    assert many.status_code == 422, many.text
    assert many.json()["error_count"] == 1000 and len(many.json()["detail"]) == 10
    statuses = [strict.get("/v1/presets?x=1").status_code for _ in range(8)]
    assert 429 in statuses and set(statuses) <= {422, 429}, statuses
