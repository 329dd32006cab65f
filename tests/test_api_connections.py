"""Connections and client addresses, against a real `fadrm serve` on loopback: a request naming
both lengths is refused and its connection closed; connections that never finish a request are
closed in time; connections over the cap are refused at once; open descriptors stay flat over
bursts of parallel reads; requests without a valid token are limited per address, and log little
in an access log rotated at its size; a forged X-Forwarded-For changes no address (the limits and
the access log keep the socket's), only a proxy the operator names is believed, and the trusted
proxies are said at start and a stray forwarding peer once."""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

import httpx
import pytest

from bench.api_probes.server import raw_exchange
from tests.api_helpers import NO_RAY, TOKEN, request, running_service, wait_state
from tests.ray_helpers import wait_for

pytestmark = [pytest.mark.ray]
READ_TIMEOUT = 2  # FADRM_REQUEST_TIMEOUT of the guarded service below
MAX_CONNECTIONS = 24
ANON_RATE, ANON_BURST = 2, 5  # requests a second / at once of one address without a valid token
LOG_MAX_BYTES, LOG_BACKUPS = 4096, 2
FORGED = "9.9.9."


@pytest.fixture(scope="module")
def guarded(digits_teacher, tmp_path_factory):
    """A service with tight connection guards, a tight limit per address and small log files; no
    job runs on it (a Ray address no one answers)."""
    root = tmp_path_factory.mktemp("api-connections")
    with running_service(digits_teacher[0], root, ray_address=NO_RAY, rate_limit=1000, rate_burst=2000,
                         request_timeout=READ_TIMEOUT, max_connections=MAX_CONNECTIONS, anon_rate_limit=ANON_RATE,
                         anon_rate_burst=ANON_BURST, log_file=root / "service.log", log_max_bytes=LOG_MAX_BYTES,
                         log_backups=LOG_BACKUPS) as server:
        yield server


def _log_lines(server, name: str) -> list[str]:
    """The lines of log file `name` of the server's folder, its rotated files included (oldest first)."""
    files = [p for p in server.root.iterdir() if re.fullmatch(re.escape(name) + r"(\.\d+)?", p.name)]
    files.sort(key=lambda p: int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0, reverse=True)
    return [line for f in files for line in f.read_text(errors="replace").splitlines()]


def _access_log(server) -> list[str]:
    return _log_lines(server, "service.log.access")


def _service_log(server) -> list[str]:
    return _log_lines(server, "service.log")


# --------------------------------------------------------------------------- connections
def test_a_request_naming_both_lengths_is_refused_and_its_connection_closed(guarded):
    body = json.dumps(request()).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = (f"POST /v1/distillations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nContent-Length: {len(body)}\r\n\r\n")
    got, closed = raw_exchange(guarded.port, head.encode() + chunked, 10.0)
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert b"not both" in got and closed
    assert got.count(b"HTTP/1.1") == 1


def test_connections_that_never_finish_a_request_are_closed_in_time(guarded):
    results = {}

    def slow(name: str, parts: list[bytes], pause: float):
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", guarded.port), timeout=READ_TIMEOUT + 8) as s:
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
    with guarded.client() as http:  # a whole request on a connection of its own is answered
        assert http.get("/v1/teachers").status_code == 200


def test_connections_over_the_cap_are_refused_at_once(guarded):
    held = []
    try:
        for _ in range(MAX_CONNECTIONS + 6):
            held.append(socket.create_connection(("127.0.0.1", guarded.port), timeout=5))
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
    with guarded.client() as http:
        wait_for(lambda: http.get("/healthz").status_code == 200, timeout=10, interval=0.2)


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_open_descriptors_stay_flat_over_bursts_of_parallel_reads(api_service):
    """Bursts of 40 parallel reads of a job's endpoints, with idle periods long enough for the
    server's idle worker threads to exit between them: the job database's connections are a pool
    of fixed size, so the count of open files comes back to where it was."""
    with api_service.client() as http:
        job = http.post("/v1/distillations", json=request(classes=(4, 5), ipc=1)).json()
        wait_state(http, job["id"])
    pid = api_service.process.pid

    def burst():
        def read():
            with api_service.client() as c:
                c.get(f"/v1/distillations/{job['id']}")
                c.get("/v1/distillations")
        threads = [threading.Thread(target=read) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    counts = []
    for i in range(4):
        burst()
        time.sleep(1)  # the burst's sockets close
        counts.append(_open_files(pid))
        time.sleep(10 if i < 3 else 0)  # with the second above, longer than anyio's idle threads live (10 s)
    # Before the pool: 32 more after every burst. Now the count after the first burst holds.
    assert max(counts) - counts[0] <= 6 and counts[-1] <= counts[0] + 2, counts


# --------------------------------------------------------------------------- addresses
def test_a_rotating_x_forwarded_for_is_still_the_socket_address(guarded):
    """80 requests without a token, each naming another address in X-Forwarded-For: one address
    to the per-address limit, and the access log writes only the socket's."""
    started = time.monotonic()
    limited = 0
    with guarded.client(token=None) as anonymous:
        for i in range(80):
            r = anonymous.get("/v1/teachers", headers={"X-Forwarded-For": f"{FORGED}{i}"})
            assert r.status_code == 401
            limited += "retry-after" in r.headers
        forged_line = f'{FORGED}9 - "DELETE /v1/distillations/job-1 HTTP/1.1" 200'
        anonymous.get("/v1/teachers", headers={"X-Forwarded-For": forged_line, "X-Real-IP": f"{FORGED}7"})
    # The burst, and what the rate refilled meanwhile.
    allowed = ANON_BURST + ANON_RATE * (time.monotonic() - started) + 1
    assert limited >= 80 - allowed and limited > 0, (limited, allowed)
    assert FORGED not in "\n".join(_access_log(guarded) + _service_log(guarded))
    lines = [line for line in _access_log(guarded) if '"GET /v1/teachers HTTP/1.1" 401' in line]
    assert lines and all(line.split()[1].startswith("127.0.0.1:") for line in lines), lines[:3]
    assert len(lines) <= 81 - limited  # the limited ones are counted, not logged one by one


def test_requests_without_a_valid_token_are_limited_per_address_and_log_little(guarded):
    time.sleep(3)  # the address's bucket full again
    path = "/v1/distillations/" + "a" * 15_000
    answers = []
    started = time.monotonic()
    with guarded.client(token=None) as anonymous, guarded.client(token="x" * 43) as wrong:
        for i in range(40):
            answers.append((i % 2, (anonymous if i % 2 else wrong).get(path)))
        assert anonymous.get("/healthz").status_code == 200  # probes are never limited
    took = time.monotonic() - started
    # Refused as ever (401 without a token, 403 with a wrong one), past the burst from an answer
    # made before routing, with Retry-After, and left out of the access log.
    assert all(r.status_code == (401 if anon else 403) for anon, r in answers), [r.status_code for _, r in answers]
    limited = [r for _, r in answers if "retry-after" in r.headers]
    assert len(limited) >= 40 - ANON_BURST - ANON_RATE * took - 1, (len(limited), took)
    assert all(int(r.headers["retry-after"]) >= 1 and "retry in" in r.json()["detail"] for r in limited)
    with guarded.client() as http:  # the token's requests are not held back by the address's
        assert http.get("/v1/teachers").status_code == 200
    wait_for(lambda: any("GET /v1/teachers HTTP/1.1" in line for line in _access_log(guarded)[-5:]), timeout=10)
    lines = _access_log(guarded)
    long_ones = [line for line in lines if "aaaa" in line]
    assert 0 < len(long_ones) <= 40 - len(limited), len(long_ones)
    assert all(len(line.encode()) < 400 for line in lines), max(map(len, lines))
    assert "more characters>" in long_ones[-1] and "a" * 300 not in "".join(lines)
    # The access log is rotated at its size, LOG_BACKUPS old files kept: 60 lines of about 300
    # bytes are more than the three files hold.
    with guarded.client() as http:
        for _ in range(60):
            assert http.get("/v1/teachers/" + "b" * 190).status_code == 404
    wait_for(lambda: sum("bbbb" in line for line in _access_log(guarded)) >= 20, timeout=10)
    files = {p.name: p.stat().st_size for p in guarded.root.glob("service.log.access*")}
    assert set(files) == {"service.log.access", *(f"service.log.access.{i}" for i in range(1, LOG_BACKUPS + 1))}, files
    assert all(size <= LOG_MAX_BYTES for size in files.values()), files


def test_the_trusted_proxies_are_said_at_start_and_a_stray_forwarding_peer_once(guarded):
    for i in range(3):
        assert httpx.get(f"{guarded.url}/healthz", headers={"X-Forwarded-For": f"10.9.9.{i}"}).status_code == 200
    log = "\n".join(_service_log(guarded))
    assert "trusted proxies (FADRM_TRUSTED_PROXIES): none" in log
    warned = [line for line in log.splitlines() if "carries forwarding headers" in line]
    assert len(warned) == 1 and "from 127.0.0.1" in warned[0] and "the one it connects from" in warned[0], warned


@pytest.fixture(scope="module")
def behind_proxy(digits_teacher, tmp_path_factory):
    """A service told that 127.0.0.1 is its proxy (FADRM_TRUSTED_PROXIES); no job runs on it."""
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-proxy"), ray_address=NO_RAY,
                         trusted_proxies="127.0.0.1", anon_rate_limit=1, anon_rate_burst=2) as server:
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


def test_each_stray_forwarding_peer_is_said_once(caplog):
    """A client that sends X-Forwarded-For does not use up the warning: the real proxy that
    connects later from another address is said too, each address once."""
    import asyncio

    from api.web.proxies import TrustedProxies

    async def app(scope, receive, send):
        pass

    proxies = TrustedProxies(app, ())

    async def requests():
        for peer in ("10.1.1.1", "10.1.1.1", "10.2.2.2", "10.2.2.2"):
            await proxies({"type": "http", "client": (peer, 1234), "headers": [(b"x-forwarded-for", b"1.2.3.4")]},
                          None, None)

    with caplog.at_level("WARNING", logger="fadrm.api"):
        asyncio.run(requests())
    warned = [r.getMessage() for r in caplog.records if "carries forwarding headers" in r.getMessage()]
    assert [line.split()[3] for line in warned] == ["10.1.1.1", "10.2.2.2"], warned
    assert all("if it is your proxy" in line for line in warned)
