"""What the service refuses or answers before any job, against its app under a real uvicorn on
loopback in this process, with a Ray address no one answers (no job runs): a query string is as
strict as a body, a body without a JSON content type is a 422 saying which to send, and the
probes are answered outside the token's rate limit."""
from __future__ import annotations

import secrets
import shutil
import threading
import time

import httpx
import pytest

from tests.api_helpers import TEACHER, free_port, request


@pytest.fixture
def strict(digits_teacher, tmp_path):
    """The app, limited to 1 request a second per token (2 at once), and a client with its token."""
    import uvicorn

    from api.app import create_app
    from api.config import ServiceSettings

    (tmp_path / "teachers").mkdir()
    shutil.copy(digits_teacher[0], tmp_path / "teachers" / f"{TEACHER}.pt")
    settings = ServiceSettings(api_token=secrets.token_urlsafe(32), store=tmp_path / "store",
                               teachers=tmp_path / "teachers", ray_address="127.0.0.1:1", rate_limit=1, rate_burst=2)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=60,
                          headers={"Authorization": f"Bearer {settings.api_token}"}) as http:
            yield http
    finally:
        server.should_exit = True
        thread.join(60)


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
