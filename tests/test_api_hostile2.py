"""A hostile client, round two, against a real `fadrm serve` on loopback: refusals that cost
little (a bounded 422, never a 500 for a non-finite number), a request with two lengths refused
and its connection closed, UTF-16 bodies refused, connections that never finish a request
closed in time, a cap on open connections, a per-address limit and bounded log lines for
requests without a token, job records removed past their retention and held under a cap, a
stopped driver failed by its heartbeat, and a Ray head that comes back by itself."""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import time

import pytest

from api.local_ray import RayHead
from bench.api_probes.server import raw_exchange
from tests.api_helpers import REPO, TOKEN, request, running_service, wait_state
from tests.ray_helpers import wait_for

pytestmark = [pytest.mark.ray]
READ_TIMEOUT = 2  # FADRM_REQUEST_TIMEOUT of the service below
MAX_CONNECTIONS = 24
RETENTION = 4
MAX_RECORDS = 3
HEARTBEAT_TIMEOUT = 4


LOG_MAX_BYTES, LOG_BACKUPS = 4096, 2


@pytest.fixture(scope="module")
def hostile(digits_teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("api-hostile2")
    with running_service(digits_teacher[0], root, max_running=1,
                         max_queued=4, rate_limit=1000, rate_burst=2000, request_timeout=READ_TIMEOUT,
                         max_connections=MAX_CONNECTIONS, anon_rate_limit=2, anon_rate_burst=5,
                         job_retention=f"{RETENTION}s", max_job_records=MAX_RECORDS,
                         driver_heartbeat_timeout=HEARTBEAT_TIMEOUT, log_file=root / "service.log",
                         log_max_bytes=LOG_MAX_BYTES, log_backups=LOG_BACKUPS) as server:
        yield server


def _access_log(server) -> list[str]:
    """The lines of the access log, its rotated files included (oldest first)."""
    files = sorted(server.root.glob("service.log.access*"), key=lambda p: p.name, reverse=True)
    return [line for f in files for line in f.read_text(errors="replace").splitlines()]


def _raw(server, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send `data` on a new connection: what came back, and whether the server closed the
    connection within `timeout`."""
    return raw_exchange(server.port, data, timeout)


def _compact(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"))


def _post_raw(http, text: str | bytes):
    return http.post("/v1/distillations", content=text, headers={"Content-Type": "application/json"})


def test_the_422_of_the_largest_body_quotes_little_and_counts_the_rest(hostile):
    base = request()
    with hostile.client() as http:
        # As many unknown keys as fit under the 64 KiB limit, and 999 empty objects as classes.
        unknown = {**base, **{f"k{i}": 0 for i in range(6500)}}
        assert 60_000 < len(_compact(unknown)) < 65_536
        empties = {**base, "classes": [{}] * 999}
        long_key = {**base, "overrides": {"x" * 60_000: 1}}
        for body, count in ((unknown, 6500), (empties, 999), (long_key, 1)):
            response = _post_raw(http, _compact(body))
            assert response.status_code == 422, response.text[:300]
            problem = response.json()
            assert problem["error_count"] >= count and len(problem["detail"]) <= 10
            assert len(response.content) < 6_000, len(response.content)
        assert http.get("/v1/distillations").json()["jobs"] == []


@pytest.mark.parametrize("field", ["ipc", "seed", "evaluate", "classes", "teacher", "preset", "dataset"])
@pytest.mark.parametrize("word", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1" + "0" * 4000])
def test_a_non_finite_or_huge_number_in_any_field_is_a_422_never_a_500(hostile, field, word):
    body = {**request(), field: ["@@"] if field == "classes" else "@@"}
    text = json.dumps(body).replace('"@@"', word)
    with hostile.client() as http:
        response = _post_raw(http, text)
    assert response.status_code == 422, response.text[:300]
    json.loads(response.text, parse_constant=lambda c: pytest.fail(f"the answer holds a bare {c}"))
    assert len(response.content) < 2_000


def test_a_request_naming_both_lengths_is_refused_and_its_connection_closed(hostile):
    body = json.dumps(request()).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = (f"POST /v1/distillations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nContent-Length: {len(body)}\r\n\r\n")
    got, closed = _raw(hostile, head.encode() + chunked)
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert b"not both" in got and closed
    assert got.count(b"HTTP/1.1") == 1


def test_a_body_in_utf16_is_refused_with_one_line(hostile):
    with hostile.client() as http:
        for encoding in ("utf-16", "utf-16-le", "utf-32"):
            response = _post_raw(http, json.dumps(request()).encode(encoding))
            assert response.status_code == 400, (encoding, response.text)
            assert response.json()["detail"] == "the request body must be JSON text in UTF-8"
        assert http.get("/v1/distillations").json()["jobs"] == []


def test_connections_that_never_finish_a_request_are_closed_in_time(hostile):
    import threading

    results = {}

    def slow(name: str, parts: list[bytes], pause: float):
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", hostile.port), timeout=READ_TIMEOUT + 8) as s:
            got = b""
            try:
                for part in parts:
                    s.sendall(part)
                    time.sleep(pause)
                while chunk := s.recv(4096):
                    got += chunk
                results[name] = (got, time.monotonic() - started)
            except (BrokenPipeError, ConnectionResetError):
                results[name] = (got, time.monotonic() - started)
            except TimeoutError:
                results[name] = (got, None)

    request_line = b"GET /v1/teachers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
    cases = {
        "nothing": ([], 0),
        "one byte at a time": ([bytes([b]) for b in request_line], 0.2),
        "head never ended": ([request_line + b"\r\n"], 0),
        # With the token: a request without one is answered 401 before its body is read.
        "body cut short": ([b"POST /v1/distillations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                            b"Content-Length: 500\r\n\r\n{\"dataset\": "], 0),
    }
    threads = [threading.Thread(target=slow, args=(name, *case)) for name, case in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in cases:
        got, took = results[name]
        assert took is not None, f"{name}: still open {READ_TIMEOUT + 8} s later"
        assert took < READ_TIMEOUT + 3, (name, took)
        assert got == b"" or got.startswith(b"HTTP/1.1 408 "), (name, got[:200])
    with hostile.client() as http:  # a whole request on a connection of its own is answered
        assert http.get("/v1/teachers").status_code == 200


def test_connections_over_the_cap_are_refused_at_once(hostile):
    held = []
    try:
        for _ in range(MAX_CONNECTIONS + 6):
            held.append(socket.create_connection(("127.0.0.1", hostile.port), timeout=5))
        refused = 0
        for s in held:
            s.settimeout(0.5)
            try:
                refused += s.recv(4096).startswith(b"HTTP/1.1 503 ")
            except TimeoutError:
                pass
        assert refused >= 6, refused
    finally:
        for s in held:
            s.close()
    with hostile.client() as http:
        wait_for(lambda: http.get("/healthz").status_code == 200, timeout=10, interval=0.2)


def test_requests_without_a_valid_token_are_limited_per_address_and_log_little(hostile):
    time.sleep(3)  # the address's bucket full again
    path = "/v1/distillations/" + "a" * 15_000
    answers = []
    started = time.monotonic()
    with hostile.client(token=None) as anonymous, hostile.client(token="x" * 43) as wrong:
        for i in range(40):
            answers.append((i % 2, (anonymous if i % 2 else wrong).get(path)))
        assert anonymous.get("/healthz").status_code == 200  # probes are never limited
    took = time.monotonic() - started
    # Refused as ever (401 without a token, 403 with a wrong one), past the burst from an answer
    # made before routing, with Retry-After, and left out of the access log.
    assert all(r.status_code == (401 if anon else 403) for anon, r in answers), [r.status_code for _, r in answers]
    limited = [r for _, r in answers if "retry-after" in r.headers]
    assert len(limited) >= 40 - 5 - 2 * took - 1, (len(limited), took)
    assert all(int(r.headers["retry-after"]) >= 1 and "retry in" in r.json()["detail"] for r in limited)
    with hostile.client() as http:  # the token's requests are not held back by the address's
        assert http.get("/v1/teachers").status_code == 200
    wait_for(lambda: any("GET /v1/teachers HTTP/1.1" in line for line in _access_log(hostile)[-5:]), timeout=10)
    lines = _access_log(hostile)
    long_ones = [line for line in lines if "aaaa" in line]
    assert 0 < len(long_ones) <= 40 - len(limited), len(long_ones)
    assert all(len(line.encode()) < 400 for line in lines), max(map(len, lines))
    assert "more characters>" in long_ones[-1] and "a" * 300 not in "".join(lines)
    # The access log is rotated at its size, LOG_BACKUPS old files kept: 60 lines of about 300
    # bytes are more than the three files hold.
    with hostile.client() as http:
        for _ in range(60):
            assert http.get("/v1/teachers/" + "b" * 190).status_code == 404
    wait_for(lambda: sum("bbbb" in line for line in _access_log(hostile)) >= 20, timeout=10)
    files = {p.name: p.stat().st_size for p in hostile.root.glob("service.log.access*")}
    assert set(files) == {"service.log.access", *(f"service.log.access.{i}" for i in range(1, LOG_BACKUPS + 1))}, files
    assert all(size <= LOG_MAX_BYTES for size in files.values()), files


def _files(server, job_id: str):
    return server.store / ".fadrm-api" / "jobs" / job_id


def test_finished_records_go_past_retention_and_never_more_than_the_cap_stay(hostile):
    with hostile.client() as http:
        done = wait_state(http, http.post("/v1/distillations", json=request(classes=[3, 7], ipc=1)).json()["id"],
                          timeout=240)
        assert done["state"] == "succeeded", done
        run_dir = hostile.store / done["run_id"]
        ids = []
        for seed in range(1, 7):  # POST then DELETE, over and over
            job = http.post("/v1/distillations", json=request(classes=[1, 2], seed=seed)).json()
            http.delete(f"/v1/distillations/{job['id']}")
            ids.append(job["id"])
            assert len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]) <= MAX_RECORDS
        assert http.get(f"/v1/distillations/{ids[0]}").status_code == 404
        # Past the retention, every finished record goes, with its folder; the store's run stays.
        wait_for(lambda: http.get("/v1/distillations", params={"limit": 100}).json()["jobs"] == [],
                 timeout=RETENTION + 30, interval=0.5)
        assert http.get(f"/v1/distillations/{done['id']}").status_code == 404
        assert not _files(hostile, done["id"]).exists()
        assert run_dir.is_dir() and (run_dir / "manifest.json").is_file()
        again = http.post("/v1/distillations", json=request(classes=[3, 7], ipc=1)).json()
        assert again["state"] == "succeeded" and again["reused"]  # served from the store, as before


def _running_driver(server, http, body) -> tuple[str, int]:
    job_id = http.post("/v1/distillations", json=body).json()["id"]
    db = server.store / ".fadrm-api" / "jobs.sqlite"

    def pid():
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT pid FROM jobs WHERE id = ? AND state = 'running'", (job_id,)).fetchone()
        return row[0] if row and row[0] else None

    wait_for(lambda: pid() is not None and _files(server, job_id).joinpath("heartbeat").exists(),
             timeout=120, interval=0.3)
    return job_id, pid()


def test_a_stopped_driver_is_failed_by_its_heartbeat(hostile):
    with hostile.client() as http:
        job_id, pid = _running_driver(hostile, http, request(classes=[0, 8], seed=11, iterations=4000))
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            job = wait_state(http, job_id, timeout=HEARTBEAT_TIMEOUT + 30)
        finally:
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        assert job["state"] == "failed" and "no heartbeat" in job["error"], job
        assert time.monotonic() - stopped < HEARTBEAT_TIMEOUT + 10
        wait_for(lambda: not _alive(pid), timeout=30)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_killed_ray_head_comes_back_by_itself_and_its_job_says_why_it_failed(hostile):
    head_file = hostile.store / ".fadrm-api" / "ray-head.json"
    with hostile.client() as http:
        wait_for(lambda: http.get("/readyz").status_code == 200, timeout=120, interval=0.5)
        job_id, _ = _running_driver(hostile, http, request(classes=[2, 6], seed=12, iterations=4000))
        head = RayHead.model_validate_json(head_file.read_text())
        os.killpg(head.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: http.get("/readyz").status_code == 503, timeout=10, interval=0.2)
        # The job on the dead head fails at once, saying why (read before its retention ends).
        job = wait_state(http, job_id, timeout=RETENTION)
        assert job["state"] == "failed", job
        assert "Ray head stopped while the job ran" in job["error"] and "/" not in job["error"], job["error"]
        wait_for(lambda: http.get("/readyz").status_code == 200, timeout=90, interval=0.5)
        back_in = time.monotonic() - killed
        assert RayHead.model_validate_json(head_file.read_text()).pid != head.pid
        print(f"/readyz 200 again {back_in:.1f} s after the head was killed")


def test_a_drivers_output_is_rotated_at_its_cap(tmp_path):
    import subprocess
    import sys

    log = tmp_path / "driver.log"
    script = ("import os, sys\n"
              "from pathlib import Path\n"
              "from api.runner import bounded_output\n"
              f"pump = bounded_output(Path({str(log)!r}), 10_000)\n"
              "for i in range(3000):\n"
              "    print(f'line {i:05d} ' + 'x' * 40, flush=True)\n"
              "os.write(2, b'the last line\\n')\n"
              "null = os.open(os.devnull, os.O_WRONLY)\n"
              "os.dup2(null, 1); os.dup2(null, 2)\n"
              "pump.join(5)\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, cwd=REPO)
    older = log.with_name("driver.log.1")
    assert log.stat().st_size <= 10_000 and older.stat().st_size <= 10_000
    assert log.read_text().endswith("the last line\n")
    assert not list(tmp_path.glob("driver.log.2"))
    assert oct(log.stat().st_mode & 0o777) == oct(0o600)
