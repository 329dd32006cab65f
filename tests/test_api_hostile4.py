"""A hostile client, round four, against a real `fadrm serve` on loopback: a forged X-Forwarded-For
changes no address (rate limits and the access log keep the socket's); bodies nested past any
parser's depth, of any content type, are a 4xx; a body announced too large is a JSON 413 that
arrives before the connection closes; no redirect is built from Host; downloads answer
conditional and range requests as RFC 9110 says; a run under repair is a 503 or a 409, never a 500
nor a reason for a new job, and once repaired serves again with the job's error cleared; stored
soft labels are packed in bounded memory; the schema says "exactly one of teacher or teachers"."""
from __future__ import annotations

import email.utils
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.api_probes.store import grow_soft_labels, peak_growth_kib
from fadrm_ray.layout import RunLayout
from tests.api_helpers import TOKEN, flip_a_byte, running_service, request, wait_state

pytestmark = [pytest.mark.ray]
FORGED = "9.9.9."


@pytest.fixture(scope="module")
def api4(digits_teacher, tmp_path_factory):
    """A service of this module's own: its tests damage and repair runs and grow soft labels."""
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-hostile4"), max_ipc=5, max_images=20,
                         max_running=1, rate_limit=1000, rate_burst=2000) as server:
        yield server


def _done(http: httpx.Client, body: dict) -> dict:
    made = http.post("/v1/distillations", json=body)
    assert made.status_code in (200, 202), made.text
    job = wait_state(http, made.json()["id"])
    assert job["state"] == "succeeded", job
    return job


def _one_line(response: httpx.Response, root: Path) -> str:
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and "Traceback" not in response.text, response.text
    assert str(root) not in response.text, response.text
    return detail


# --------------------------------------------------------------------------- addresses
def test_a_rotating_x_forwarded_for_is_still_the_socket_address(api4):
    """80 requests without a token, each naming another address in X-Forwarded-For: one address
    to the per-address limit (5 a second, 20 at once), and the access log writes only the socket's."""
    started = time.monotonic()
    limited = 0
    with api4.client(token=None) as anonymous:
        for i in range(80):
            r = anonymous.get("/v1/teachers", headers={"X-Forwarded-For": f"{FORGED}{i}"})
            assert r.status_code == 401
            limited += "retry-after" in r.headers
        forged_line = f'{FORGED}9 - "DELETE /v1/distillations/job-1 HTTP/1.1" 200'
        anonymous.get("/v1/teachers", headers={"X-Forwarded-For": forged_line, "X-Real-IP": f"{FORGED}7"})
    allowed = 20 + 5 * (time.monotonic() - started) + 1  # the burst, and what the rate refilled meanwhile
    assert limited >= 80 - allowed and limited > 0, (limited, allowed)
    log = api4.log()
    assert FORGED not in log
    lines = [line for line in log.splitlines() if '"GET /v1/teachers HTTP/1.1" 401' in line]
    assert lines and all(line.split()[1].startswith("127.0.0.1:") for line in lines), lines[:3]
    assert len(lines) <= 81 - limited  # the limited ones are counted, not logged one by one


@pytest.fixture(scope="module")
def behind_proxy(digits_teacher, tmp_path_factory):
    """A service told that 127.0.0.1 is its proxy (FADRM_TRUSTED_PROXIES)."""
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-proxy"), trusted_proxies="127.0.0.1",
                         anon_rate_limit=1, anon_rate_burst=2) as server:
        yield server


def test_behind_a_named_proxy_the_client_it_names_is_the_address_and_only_if_valid(behind_proxy):
    with behind_proxy.client(token=None) as anonymous:
        named = [anonymous.get("/v1/teachers", headers={"X-Forwarded-For": f"{FORGED}{i}"}) for i in range(6)]
        garbage = anonymous.get("/v1/teachers", headers={"X-Forwarded-For": 'not-an-ip - "DELETE /x" 200'})
    assert all(r.status_code == 401 and "retry-after" not in r.headers for r in named)  # six clients, one each
    assert garbage.status_code == 401
    log = behind_proxy.log()
    assert all(f"{FORGED}{i}:0 - " in log for i in range(6))
    assert "not-an-ip" not in log and "<not an address>" in log


# --------------------------------------------------------------------------- bodies and redirects
def test_bodies_nested_past_any_parser_are_a_4xx_whatever_their_content_type(api4):
    nested = [b"[" * 60_000, b'{"a":' * 12_000, b'{"dataset": "digits", "classes": ' + b"[" * 30_000]
    types = [None, "text/plain", "application/x-www-form-urlencoded", "application/json", "application/merge+json",
             "multipart/form-data; boundary=x"]
    with api4.client() as http:
        for body in nested:
            for kind in types:
                r = http.post("/v1/distillations", content=body, headers={"Content-Type": kind} if kind else {})
                assert 400 <= r.status_code < 500, (kind, body[:20], r.status_code, r.text[:300])
                assert len(r.content) < 4096 and "Traceback" not in r.text
                r.json()
        assert http.get("/healthz").status_code == 200


def test_a_body_announced_too_large_is_a_json_413_that_arrives_whole(api4):
    """Sent whole before the answer is read (as most clients do): the 413 in the JSON problem
    shape reaches the client, and the connection closes after it, not with a reset."""
    body = b" " * 200_000
    head = (f"POST /v1/distillations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", api4.port), timeout=30) as s:
        s.sendall(head + body)
        got = b""
        while chunk := s.recv(65536):  # a reset would raise here
            got += chunk
    status, _, rest = got.partition(b"\r\n")
    headers, _, answer = rest.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), got[:200]
    assert b"content-type: application/json" in headers.lower()
    assert "65536 bytes" in json.loads(answer)["detail"]
    with api4.client(token=None) as anonymous:  # without the token, the token is what is refused
        assert anonymous.post("/v1/distillations", content=body).status_code == 401


def test_no_redirect_is_built_from_the_host_header(api4):
    with api4.client() as http:
        for method, path in (("GET", "/v1/teachers/"), ("POST", "/v1/distillations/"), ("GET", "/v1/presets/")):
            r = http.request(method, path, headers={"Host": "evil.example"}, json={} if method == "POST" else None)
            assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code, r.headers)
            assert r.headers["content-type"] == "application/json"


# --------------------------------------------------------------------------- downloads as HTTP says
def test_downloads_answer_conditional_and_range_requests(api4):
    with api4.client() as http:
        job = _done(http, request(classes=(2, 6), ipc=1, seed=41))
        base = f"/v1/distillations/{job['id']}"
        for route in ("/dataset", "/preview.png", "/teacher"):
            whole = http.get(base + route)
            assert whole.status_code == 200, (route, whole.text[:200])
            tag, modified = whole.headers["etag"], whole.headers["last-modified"]
            same = http.get(base + route, headers={"If-None-Match": tag})
            assert same.status_code == 304 and same.content == b"" and same.headers["etag"] == tag, route
            assert http.get(base + route, headers={"If-None-Match": f'W/{tag}, "other"'}).status_code == 304
            assert http.get(base + route, headers={"If-None-Match": '"other"'}).status_code == 200
            assert http.get(base + route, headers={"If-Modified-Since": modified}).status_code == 304
            assert http.head(base + route, headers={"If-None-Match": tag}).status_code == 304
            assert http.get(base + route, headers={"If-Match": tag}).status_code == 200
            for failing in ({"If-Match": '"other"'}, {"If-Unmodified-Since": "Mon, 01 Jan 1990 00:00:00 GMT"}):
                refused = http.get(base + route, headers=failing)
                assert refused.status_code == 412 and refused.json()["detail"], (route, failing)
            part = http.get(base + route, headers={"Range": "bytes=3-12"})
            assert part.status_code == 206 and part.content == whole.content[3:13], route
            assert part.headers["content-range"] == f"bytes 3-12/{len(whole.content)}"
            tail = http.get(base + route, headers={"Range": "bytes=-5", "If-Range": tag})
            assert tail.status_code == 206 and tail.content == whole.content[-5:]
            stale = http.get(base + route, headers={"Range": "bytes=0-9", "If-Range": '"another-version"'})
            assert stale.status_code == 200 and stale.content == whole.content
            past = http.get(base + route, headers={"Range": f"bytes={len(whole.content)}-"})
            assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(whole.content)}"
        teacher = http.get(base + "/teacher")
        assert teacher.headers["etag"].strip('"') == json.loads(teacher.headers["etag"])  # the sha256, quoted
        assert email.utils.parsedate_to_datetime(teacher.headers["last-modified"]).tzinfo is not None


# --------------------------------------------------------------------------- a repair
def test_a_download_during_a_repair_is_a_409_or_503_and_serves_again_after(api4):
    from fadrm_ray.store.lock import RunLock

    with api4.client() as http:
        job = _done(http, request(classes=(1, 8), ipc=2, seed=31))
        base = f"/v1/distillations/{job['id']}"
        run = api4.store / job["run_id"]
        flip_a_byte(run)
        damaged = http.get(base + "/dataset")
        assert damaged.status_code == 409 and "failed verification" in _one_line(damaged, api4.root)
        assert "failed verification" in http.get(base).json()["error"]

        # What a repair does first (fadrm_ray.repair): its manifest gone, under the run's writer lock.
        layout = RunLayout(run)
        aside = layout.manifest.with_name("manifest.json.aside")
        jobs_before = len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"])
        with RunLock(layout).held():
            layout.manifest.rename(aside)
            for route in ("/dataset", "/dataset?format=imagefolder", "/preview.png"):
                busy = http.get(base + route)
                assert busy.status_code == 503 and busy.headers["retry-after"], (route, busy.text)
                assert "being written" in _one_line(busy, api4.root)
            # The same run asked for at a smaller IPC: not taken for absent, so no job is queued.
            smaller = http.post("/v1/distillations", json=request(classes=(1, 8), ipc=1, seed=31))
            assert smaller.status_code == 503 and "being written" in _one_line(smaller, api4.root)
        assert len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]) == jobs_before
        stopped = http.get(base + "/dataset")  # no writer and no manifest: a repair that stopped half-way
        assert stopped.status_code == 409 and "incomplete" in _one_line(stopped, api4.root)
        aside.rename(layout.manifest)

        statuses: list[int] = []
        repair = subprocess.Popen([sys.executable, "-m", "actors.cli", "verify", "--run", str(run), "--repair",
                                   "--quiet"], env={**api4.env}, cwd=api4.root, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)
        while repair.poll() is None:
            statuses.append(http.get(base + "/dataset").status_code)
            time.sleep(0.02)
        assert repair.returncode == 0, repair.stdout.read().decode()[-2000:]
        # Refused while the run fails its check or is being rewritten, never a 500; served once
        # repaired (the repair's last moments, before its process exits, may already see that).
        served_from = statuses.index(200) if 200 in statuses else len(statuses)
        assert set(statuses[:served_from]) <= {409, 503} and set(statuses[served_from:]) <= {200}, statuses
        served = http.get(base + "/dataset")
        assert served.status_code == 200 and served.content[:4] == b"PAR1"
        assert http.get(base).json()["error"] is None


# --------------------------------------------------------------------------- soft labels in bounded memory
def test_stored_soft_labels_are_packed_and_served_in_bounded_memory(api4, tmp_path):
    """Two evaluations of the same images share one stored soft-label folder. The first job's file,
    downloaded, is what the library packs; the folder then grows to over 100 MiB of labels, and
    the second job's first download packs and serves them while the server's memory rises by
    less than 64 MiB."""
    import pyarrow.parquet as pq

    from fadrm_ray.evaluation.soft_labels import PACK_KEY, pack_soft_labels

    evaluation = {"epochs": 2, "seeds": 1, "soft_labels": "stored"}
    body = {**request(classes=(0, 9), ipc=1, seed=51), "evaluate": True, "evaluation": evaluation}
    with api4.client() as http:
        small = _done(http, body)
        larger = _done(http, {**body, "evaluation": {**evaluation, "lr": 0.002}})  # the same labels
        served = http.get(f"/v1/distillations/{small['id']}/soft-labels")
        assert served.status_code == 200
    folders = [meta.parent for meta in RunLayout(api4.store / small["run_id"]).soft_labels.glob("*/meta.json")]
    assert len(folders) == 1
    (tmp_path / "small.parquet").write_bytes(served.content)
    (tmp_path / "whole.parquet").write_bytes(pack_soft_labels(folders))
    got, whole = pq.read_table(tmp_path / "small.parquet"), pq.read_table(tmp_path / "whole.parquet")
    assert got.equals(whole) and got.schema.metadata[PACK_KEY] == whole.schema.metadata[PACK_KEY]

    rows = grow_soft_labels(folders[0], 104 * 2**20)
    out = tmp_path / "larger.parquet"

    def download():
        with api4.client() as http, http.stream("GET", f"/v1/distillations/{larger['id']}/soft-labels") as r:
            assert r.status_code == 200
            with open(out, "wb") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)

    grown = peak_growth_kib(api4.process.pid, download)
    print(f"soft labels of {out.stat().st_size / 2**20:.0f} MiB served; the server's RSS rose {grown / 1024:.1f} MiB")
    assert out.stat().st_size >= 100 * 2**20 and pq.read_metadata(out).num_rows == rows, out.stat().st_size
    assert grown < 64 * 1024, f"the server's RSS grew by {grown / 1024:.0f} MiB"


# --------------------------------------------------------------------------- the schema
def test_the_schema_says_exactly_one_of_teacher_or_teachers(api4):
    jsonschema = pytest.importorskip("jsonschema")
    with api4.client() as http:
        schema = http.get("/openapi.json").json()["components"]["schemas"]["DistillationRequest"]
    check = jsonschema.Draft202012Validator(schema)
    base = {"dataset": "digits", "classes": [0]}
    assert not check.is_valid(base)  # neither: what the service refuses with a 422
    assert not check.is_valid({**base, "teacher": "a", "teachers": ["b"]})
    assert not check.is_valid({**base, "teacher": None})
    assert check.is_valid({**base, "teacher": "a"}) and check.is_valid({**base, "teachers": ["a", "b"]})
    assert check.is_valid({**base, "teacher": None, "teachers": ["a"]})  # a null one is absent


def test_schemathesis_stateful_phase_passes_with_a_seed_left_to_chance(api4):
    """Sequences of calls linked through the schema (a job's id from one answer into the next
    request), with a seed Hypothesis draws anew each run: no 5xx, every answer as the schema says."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, settings

    auth = {"Authorization": f"Bearer {TOKEN}"}
    schema = schemathesis.openapi.from_url(f"{api4.url}/openapi.json", headers=auth)
    # Requests that fit the schema, as tests/test_api_schema.py sends: the token is added to each
    # call, so a negative case without it would be sent with it all the same.
    schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE])
    calls: list[str] = []

    class Stateful(schema.as_state_machine()):
        def get_call_kwargs(self, case):
            return {"headers": auth}

        def after_call(self, response, case):
            calls.append(f"{case.method} {case.path} {response.status_code}")

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            # A request can fit the schema and name a dataset or teacher this server does not offer.
            case.validate_response(response, excluded_checks=[schemathesis.checks.positive_data_acceptance],
                                   transport_kwargs=kwargs)

    Stateful.run(settings=settings(max_examples=25, stateful_step_count=6, deadline=None, database=None,
                                   suppress_health_check=list(HealthCheck)))
    print(f"{len(calls)} calls in sequences, {len({c.rsplit(' ', 1)[0] for c in calls})} operations")
    assert len(calls) >= 25
