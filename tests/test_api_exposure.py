"""What the service lets a client see, send and leave behind, against the real server: tokens
(strength, never logged), the schema behind the token, plain HTTP only on loopback, the rate
limit, idempotency conflicts, HEAD, no redirect built from the Host header, oversized and
undecodable bodies, the 409 of a finished job, and the modes of the files the service writes."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import urllib.parse

import httpx
import pytest

from api.client import FadrmClient
from tests.api_helpers import TOKEN, free_port, request, running_service, wait_state
from tests.ray_helpers import wait_for

pytestmark = [pytest.mark.ray]
MAKE_TOKEN = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


def _serve(env: dict, *args: str) -> subprocess.CompletedProcess:
    """`fadrm serve` with `args`, for a start that must stop before it serves."""
    return subprocess.run([sys.executable, "-m", "actors.cli", "serve", *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def finished(api_service):
    """A succeeded job of the shared service, and the body that made it (sent without a key)."""
    body = request(classes=[4, 5], ipc=1, seed=26)
    with api_service.client() as http:
        first = http.post("/v1/distillations", json=body)
        assert first.status_code in (200, 202), first.text
        job = wait_state(http, first.json()["id"])
    assert job["state"] == "succeeded", job
    return job, body


@pytest.fixture(scope="module")
def limited(digits_teacher, tmp_path_factory):
    """A service of its own on every interface over TLS, at 5 requests a second in bursts of 5."""
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-limited"), tls=True,
                         rate_limit=5, rate_burst=5) as server:
        yield server


def test_a_weak_token_refuses_to_start_with_one_line_saying_how_to_make_one(api_service, tmp_path):
    from api.planning.service_settings import token_weakness

    weak = "a" * 20
    result = _serve({**api_service.env, "FADRM_STORE": str(tmp_path / "store"), "FADRM_API_TOKEN": weak})
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "FADRM_API_TOKEN" in lines[0] and MAKE_TOKEN in lines[0] and weak not in lines[0], lines
    assert not (tmp_path / "store").exists()  # refused before anything was written
    # The rule itself (the same check, without a process each): short, patterned or repeated is
    # weak; what secrets makes is not.
    for token in ("0123456789abcdef" * 2, "short-but-mixed-42", "ab" * 20, "abcdefgh" * 4, "tok en" * 8):
        assert token_weakness(token), token
    assert not token_weakness(TOKEN) and not token_weakness("9f86d081884c7d659a2feaa0c55ad015")


def test_a_non_loopback_host_needs_tls_or_insecure(api_service, limited):
    env, port = api_service.env, str(free_port())
    for host in ("0.0.0.0", "example.org"):
        result = _serve(env, "--host", host, "--port", port)
        assert result.returncode != 0, result.stderr
        assert f"--host {host} is not a loopback address" in result.stderr and "--insecure" in result.stderr
    from api.serve_command import _loopback

    assert [_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost")] == [True] * 5
    assert not any(_loopback(h) for h in ("::", "10.1.2.3", "192.168.0.1", "fadrm.internal"))
    # With --insecure the start gets past the check, up to the store the shared service holds.
    passed = _serve(env, "--host", "0.0.0.0", "--port", port, "--insecure")
    assert passed.returncode != 0 and "another fadrm serve is using the store" in passed.stderr, passed.stderr
    # With TLS it serves, on every interface: HTTPS answers, plain HTTP on the same port does not.
    assert limited.url.startswith("https://")
    with limited.client() as https:
        assert https.get("/healthz").json() == {"ok": True}
    with pytest.raises(httpx.HTTPError):
        httpx.get(limited.url.replace("https://", "http://") + "/healthz", timeout=2)


def test_the_schema_needs_the_token_and_the_cdn_docs_are_off(api_service):
    with api_service.client(token=None) as anonymous:
        assert anonymous.get("/openapi.json").status_code == 401
        for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert anonymous.get(page).status_code in (401, 404), page
    with api_service.client() as http:
        schema = http.get("/openapi.json")
        assert schema.status_code == 200 and "/v1/distillations" in schema.json()["paths"]
        assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404


def test_a_token_in_the_query_string_is_refused_and_never_logged(api_service):
    with api_service.client(token=None) as anonymous:
        for name in ("token", "access_token", "api_key"):
            response = anonymous.get("/v1/teachers", params={name: TOKEN})
            assert response.status_code == 401 and TOKEN not in response.text
    with api_service.client() as http:  # with the header too: the query is never read as a token,
        refused = http.get("/v1/teachers", params={"token": TOKEN})  # and names a parameter no endpoint takes
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["query", "token"]
        assert TOKEN not in refused.text  # its value is not quoted back
    # The access log has the requests (so the check below looks at the right lines), not the query.
    wait_for(lambda: api_service.log().count("GET /v1/teachers?<query left out>") >= 4, timeout=10)
    log = api_service.log()
    for form in (TOKEN, urllib.parse.quote(TOKEN, safe=""), urllib.parse.quote_plus(TOKEN)):
        assert form not in log


def test_a_request_rate_over_the_limit_is_a_429_with_retry_after(limited):
    with limited.client() as http:
        answers = [http.get("/v1/presets") for _ in range(12)]
        refused = [r for r in answers if r.status_code == 429]
        assert refused and {r.status_code for r in answers} == {200, 429}, [r.status_code for r in answers]
        wait = refused[0].headers["retry-after"]
        assert wait.isdigit() and int(wait) >= 1 and "requests a second" in refused[0].json()["detail"]
        assert http.get("/healthz").status_code == 200  # probes are never limited
        time.sleep(int(wait))
        assert http.get("/v1/presets").status_code == 200
        time.sleep(1)  # the bucket full again (5 a second, 5 at most)
        # The same count spread under the rate: one request is sent only after the one before
        # was answered and 0.25 s passed, so the server never sees more than 4 a second.
        spread = []
        for _ in range(12):
            spread.append(http.get("/v1/presets").status_code)
            time.sleep(0.25)
        assert spread == [200] * 12
    # The client waits out a 429 of the rate (its Retry-After) and sends the call again.
    with FadrmClient(limited.url, TOKEN, verify=limited.verify) as client:
        assert all(client.jobs() == [] for _ in range(12))
    assert limited.log().count('"GET /v1/distillations?<query left out> HTTP/1.1" 429') >= 1


def test_an_idempotency_key_used_with_another_body_is_a_409_and_no_job(api_service, finished):
    job, body = finished
    other, key = {**body, "ipc": 2}, "exposure-26"
    with api_service.client() as http:
        def jobs() -> list[str]:
            return [j["id"] for j in http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]]

        before = jobs()
        # The key, first sent with the body of a job made without one, names that job from then on.
        same = http.post("/v1/distillations", json=body, headers={"Idempotency-Key": key})
        assert same.status_code == 200 and same.json()["id"] == job["id"]
        conflict = http.post("/v1/distillations", json=other, headers={"Idempotency-Key": key})
        assert conflict.status_code == 409, conflict.text
        assert key in conflict.json()["detail"] and job["id"] in conflict.json()["detail"]
        assert http.post("/v1/distillations", json=body, headers={"Idempotency-Key": key}).json()["id"] == job["id"]
        assert jobs() == before


def test_head_answers_where_get_does(api_service, finished):
    job, _ = finished
    base = f"/v1/distillations/{job['id']}"
    with api_service.client(token=None) as anonymous:
        assert anonymous.head("/healthz").status_code == 200
        assert anonymous.head(base).status_code == 401
    with api_service.client() as http:
        for path in ("/readyz", base, f"{base}/dataset", f"{base}/preview.png", f"{base}/report", "/v1/teachers"):
            got, head = http.get(path), http.head(path)
            assert head.status_code == got.status_code == 200, (path, head.status_code, got.status_code)
            assert head.content == b"" and int(head.headers["content-length"]) == len(got.content), path
            assert head.headers["content-type"] == got.headers["content-type"], path
        ranged = http.head(f"{base}/dataset", headers={"Range": "bytes=0-9"})
        assert ranged.status_code == 206 and ranged.headers["content-length"] == "10"
        refused = http.head("/v1/nothing-here")
        assert refused.status_code == 404 and refused.content == b""


def test_no_redirect_is_built_from_the_host_header(api_service):
    with api_service.client() as http:
        for method, path in (("GET", "/v1/teachers/"), ("POST", "/v1/distillations/"), ("GET", "/v1/presets/")):
            r = http.request(method, path, headers={"Host": "evil.example"}, json={} if method == "POST" else None)
            assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code, r.headers)
            assert r.headers["content-type"] == "application/json"


def test_an_oversized_body_is_a_413_however_it_is_sent(api_service):
    def chunks():  # an iterator: httpx sends it chunked, with no Content-Length
        for _ in range(10):
            yield b" " * 8192

    with api_service.client() as http:
        chunked = http.post("/v1/distillations", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and "65536 bytes" in chunked.json()["detail"], chunked.text
        declared = http.post("/v1/distillations", content=b" " * 80 * 1024, headers={"content-type": "application/json"})
        assert declared.status_code == 413
        assert http.get("/healthz").status_code == 200


def test_a_body_that_is_not_utf8_is_a_documented_400(api_service):
    with api_service.client() as http:
        bad = http.post("/v1/distillations", content=b'{"dataset": "digits\xff\xfe"}',
                        headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["detail"]
        responses = http.get("/openapi.json").json()["paths"]["/v1/distillations"]["post"]["responses"]
        assert {"400", "409", "413", "429"} <= set(responses)


def test_cancelling_a_finished_job_says_what_is_wrong(api_service, finished):
    job, _ = finished
    with api_service.client() as http:
        refused = http.delete(f"/v1/distillations/{job['id']}")
        assert refused.status_code == 409 and refused.json()["state"] == "succeeded"
        assert refused.json()["detail"] == (f"job {job['id']} has already finished (succeeded); only queued or "
                                            "running jobs can be cancelled")
        assert http.get(f"/v1/distillations/{job['id']}").json()["state"] == "succeeded"


def test_files_the_service_writes_are_not_readable_by_others(api_service, finished):
    written = [os.path.join(folder, name) for folder, dirs, files in os.walk(api_service.store)
               for name in dirs + files]
    assert any(path.endswith("jobs.sqlite") for path in written) and any(path.endswith(".parquet") for path in written)
    readable = [path for path in written if os.stat(path).st_mode & (stat.S_IROTH | stat.S_IWOTH)]
    assert not readable, readable[:10]
