"""Requests with a valid token that ask for work without bound (`limits`), and floods of what a
client can make the service spend or keep (`floods`).

- `limits`: each probe of the table is one request a client could send to make the server build
  or run something without bound (a count of 10**7, a non-finite number, a path for the model
  factory); the service must refuse it with a 422 naming the field, before any job exists, and
  stay responsive (`tests/test_api_limits.py` asserts exactly that for every probe here). Per
  probe: the status, the time the refusal took, and the time of a `/healthz` right after it.
- `floods` (a service of its own with the default rate limit, request timeout and connection
  cap, a 20 s retention and a cap of 100 records), each against the figures that stalled or
  filled it before: `errors_flood` (one token at its allowed rate, 20 a second, of 64 KB bodies
  of 6,500 unknown keys for `--seconds`; the size and time of one 422, and `/healthz` latency
  meanwhile); `non_finite` (1e400, -1e400, NaN, Infinity and a 4,000-digit integer in each typed
  field: how many answers were 5xx); `two_lengths`, `utf16`; `slow_sockets` (50 connections
  sending a request one byte a second, 50 sending nothing, 50 stopping mid-body: how long until
  the service closed each); `connection_cap` (300 idle connections at once); `anonymous_flood`
  (4 threads for `--seconds` sending 15 KB paths without a token: statuses, how many were past the
  per-address limit, the bytes of log each request left); `records` (POST then DELETE, over and
  over, for `--seconds`: the records kept then, and after the retention); `ray_head` (the
  service's Ray head killed: seconds until `/readyz` is 200 again, with no job sent).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx

from api.jobs.local_ray import RayHead
from bench.api_load import TOKEN, wait_ready
from bench.api_probes.server import BASE, Server, healthz_while, median, raw_exchange

# (name, where the change goes: "overrides", "evaluation" or "body", the change, the field the 422 names)
PROBES = [
    # The two that stalled the server and ran for ever.
    ("k 10^7", "overrides", {"k": 10_000_000}, "k"),
    ("iterations 10^9", "overrides", {"iterations": 1_000_000_000}, "iterations"),
    # Every other count of the recover loop.
    ("patch_crops 10^6", "overrides", {"patch_crops": 10**6}, "patch_crops"),
    ("patch_group 10^6", "overrides", {"patch_group": 10**6}, "patch_group"),
    ("patch_candidates 10^9", "overrides", {"patch_candidates": 10**9}, "patch_candidates"),
    ("pack 10^6", "overrides", {"pack": 10**6}, "pack"),
    ("ipc_per_unit 10^6", "overrides", {"ipc_per_unit": 10**6}, "ipc_per_unit"),
    ("jitter 10^6", "overrides", {"jitter": 10**6}, "jitter"),
    ("classes_per_batch 10^6", "overrides", {"classes_per_batch": 10**6}, "classes_per_batch"),
    ("downsample_size 10^6", "overrides", {"downsample_size": 10**6}, "downsample_size"),
    ("stage_iterations of 1000", "overrides", {"stage_iterations": [1] * 1000}, "stage_iterations"),
    ("stage_iterations entry 10^9", "overrides", {"k": 1, "iterations": None, "stage_iterations": [8, 10**9]},
     "stage_iterations"),
    # Evaluation.
    ("epochs 10^6", "evaluation", {"epochs": 1_000_000}, "epochs"),
    ("seeds 10^6", "evaluation", {"seeds": 1_000_000}, "seeds"),
    ("a list of 1000 seeds", "evaluation", {"seeds": list(range(1000))}, "seeds"),
    ("batch_size 10^7", "evaluation", {"batch_size": 10**7}, "batch_size"),
    ("eval_every 10^7", "evaluation", {"eval_every": 10**7}, "eval_every"),
    ("student width 10^6", "evaluation", {"student_kwargs": {"width": 10**6}}, "student_kwargs"),
    ("student checkpoint_path", "evaluation", {"student_kwargs": {"checkpoint_path": "/etc/passwd"}},
     "student_kwargs"),
    ("student from timm", "evaluation", {"student": "vit_giant_patch14_224"}, "student"),
    # Values that are not finite, or not what they claim to be.
    ("lr Infinity", "overrides", {"lr": float("inf")}, "lr"),
    ("r_bn Infinity", "overrides", {"r_bn": float("inf")}, "r_bn"),
    ("alpha NaN", "overrides", {"alpha": float("nan")}, "alpha"),
    ("first_bn_weight 1e308", "overrides", {"first_bn_weight": 1e308}, "first_bn_weight"),
    ("crop_scale_min 1e-300", "overrides", {"crop_scale_min": 1e-300}, "crop_scale_min"),
    ("evaluation lr Infinity", "evaluation", {"lr": float("inf")}, "lr"),
    ("class true", "body", {"classes": [True]}, "classes"),
    ("class 3.0", "body", {"classes": [3.0]}, "classes"),
]


def probe_body(base: dict, where: str, change: dict) -> dict:
    """`base` (a valid request) with one probe's change put where it goes."""
    body = json.loads(json.dumps(base))
    if where == "overrides":
        body["overrides"] = {**body.get("overrides", {}), **change}
    elif where == "evaluation":
        body.update(evaluate=True, evaluation={**body.get("evaluation", {}), **change})
    else:
        body.update(change)
    return body


def post_raw(http: httpx.Client, body: dict) -> httpx.Response:
    """POST the body as Python's json writes it: Infinity and NaN as the bare words other
    languages' JSON parsers refuse, but which a Python server reads."""
    return http.post("/v1/distillations", content=json.dumps(body), headers={"Content-Type": "application/json"})


def build_422(text: str, repeat: int = 20) -> dict:
    """In this process: the time to validate `text` as a request and build the service's 422 for
    it (api.web.refusals), against FastAPI's own 422 of the same errors (every error's input echoed)."""
    from fastapi.encoders import jsonable_encoder
    from pydantic import ValidationError

    from api.contract.schemas import DistillationRequest
    from api.web.refusals import MAX_ERRORS, problems, shape_errors
    from api.web.routes.distillations import REQUEST_FIELDS, REQUEST_LISTS

    def errors() -> list[dict]:
        try:
            DistillationRequest.model_validate_json(text)
        except ValidationError as exc:
            return exc.errors()
        return []

    started = time.perf_counter()
    for _ in range(repeat):  # as the service does: parse, the shape check, then pydantic
        found, total = shape_errors(json.loads(text), REQUEST_FIELDS, REQUEST_LISTS)
        if not total:
            found = errors()
            total = len(found)
        ours = json.dumps(problems(found[:MAX_ERRORS], total), allow_nan=False).encode()
    ours_ms = 1000 * (time.perf_counter() - started) / repeat
    started = time.perf_counter()
    theirs = json.dumps({"detail": jsonable_encoder(errors())}, allow_nan=True).encode()
    theirs_ms = 1000 * (time.perf_counter() - started)
    return {"errors": total, "build_ms": round(ours_ms, 2), "answer_bytes": len(ours),
            "fastapi_default_ms": round(theirs_ms, 1), "fastapi_default_bytes": len(theirs)}


def floods(root: Path, seconds: float) -> dict:
    """The floods (module docstring), on a service of their own under `root`."""
    server = Server(root, job_retention="20s", max_job_records=100)
    port, url = server.port, server.url
    out: dict = {}
    base = BASE
    try:
        with server.client() as http:
            wait_ready(http)
            post_raw(http, probe_body(base, "overrides", {"alpha": 2.0}))  # the first request loads the dataset

            # One token at its allowed rate of the largest bodies with errors.
            unknown = json.dumps({**base, **{f"k{i}": 0 for i in range(6500)}}, separators=(",", ":"))
            started = time.perf_counter()
            one = http.post("/v1/distillations", content=unknown, headers={"Content-Type": "application/json"})
            single_ms = 1000 * (time.perf_counter() - started)
            stop = threading.Event()
            health: list[float] = []
            watcher = threading.Thread(target=lambda: health.extend(healthz_while(port, stop)))
            watcher.start()
            statuses, sent_bytes, t0 = [], 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                tick = time.perf_counter()
                r = http.post("/v1/distillations", content=unknown, headers={"Content-Type": "application/json"})
                statuses.append(r.status_code)
                sent_bytes += len(r.content)
                time.sleep(max(0.0, 0.05 - (time.perf_counter() - tick)))
            stop.set()
            watcher.join()
            out["errors_flood"] = {"body_bytes": len(unknown), "status": one.status_code,
                                   "answer_bytes": len(one.content), "one_422_ms": round(single_ms, 1),
                                   "requests": len(statuses), "statuses": sorted(set(statuses)),
                                   "answer_bytes_total": sent_bytes,
                                   "healthz_median_ms": round(1000 * median(health), 1),
                                   "healthz_max_ms": round(1000 * max(health), 1),
                                   "in_process": build_422(unknown)}

            # Non-finite and huge numbers in every typed field.
            codes = []
            for field in ("ipc", "seed", "evaluate", "classes", "teacher", "preset"):
                for word in ("1e400", "-1e400", "NaN", "Infinity", "1" + "0" * 4000):
                    body = {**base, field: ["@@"] if field == "classes" else "@@"}
                    codes.append(post_raw_text(http, json.dumps(body).replace('"@@"', word)).status_code)
            out["non_finite"] = {"probes": len(codes), "statuses": sorted(set(codes)),
                                 "5xx": sum(c >= 500 for c in codes)}

            # Two lengths; UTF-16.
            body = json.dumps(base).encode()
            head = (f"POST /v1/distillations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            got, closed = raw_exchange(port, head + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
            out["two_lengths"] = {"status": got[9:12].decode(), "closed": closed}
            utf16 = post_raw_text(http, json.dumps(base).encode("utf-16"))
            out["utf16"] = {"status": utf16.status_code, "detail": utf16.json().get("detail")}

        # Connections that never finish a request.
        closed_after: list[float] = []

        def slow(kind: str) -> None:
            started = time.monotonic()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
                    if kind == "byte":
                        for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\n":
                            s.sendall(bytes([b]))
                            time.sleep(1)
                    elif kind == "body":
                        s.sendall(b"POST /v1/distillations HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n{")
                    while s.recv(4096):
                        pass
            except OSError:
                pass
            closed_after.append(time.monotonic() - started)

        threads = [threading.Thread(target=slow, args=(kind,)) for kind in ("byte", "none", "body") for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["slow_sockets"] = {"sockets": len(threads), "closed": len(closed_after),
                               "closed_after_s_max": round(max(closed_after), 1),
                               "closed_after_s_median": round(median(closed_after), 1)}

        # Many idle connections at once.
        held, refused = [], 0
        try:
            for _ in range(300):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            started = time.perf_counter()
            health_code = httpx.get(f"{url}/healthz", timeout=30).status_code
            health_ms = 1000 * (time.perf_counter() - started)
            for s in held:
                s.settimeout(0.2)
                try:
                    refused += s.recv(64).startswith(b"HTTP/1.1 503")
                except OSError:
                    pass
        finally:
            for s in held:
                s.close()
        out["connection_cap"] = {"opened": len(held), "refused_503": refused, "healthz_status": health_code,
                                 "healthz_ms": round(health_ms, 1)}

        # Requests without a token, with long paths.
        log = root / "serve.log"
        before = log.stat().st_size
        anon_codes: list[int] = []
        limited: list[bool] = []

        def anonymous() -> None:
            with httpx.Client(base_url=url, timeout=30) as client:
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    r = client.get("/v1/distillations/" + "a" * 15_000)
                    anon_codes.append(r.status_code)
                    limited.append("retry-after" in r.headers)

        threads = [threading.Thread(target=anonymous) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1)
        grown = log.stat().st_size - before
        out["anonymous_flood"] = {"requests": len(anon_codes),
                                  "statuses": {str(c): anon_codes.count(c) for c in sorted(set(anon_codes))},
                                  "past_the_limit": sum(limited),
                                  "log_bytes": grown, "log_bytes_per_request": round(grown / max(1, len(anon_codes)), 1)}

        with server.client() as http:
            # POST then DELETE, over and over, at 8 pairs a second (16 requests, under the
            # token's 20 a second), waiting out any 429.
            def sent(call) -> httpx.Response:
                while (r := call()).status_code == 429:
                    time.sleep(float(r.headers.get("retry-after", 1)))
                return r

            time.sleep(3)  # the token's bucket full again after the floods above
            made, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                tick = time.perf_counter()
                job = sent(lambda: http.post("/v1/distillations", json={**base, "seed": 1000 + made})).json()
                made += sent(lambda: http.delete(f"/v1/distillations/{job['id']}")).status_code == 200
                time.sleep(max(0.0, 0.125 - (time.perf_counter() - tick)))
            db = root / "store" / ".fadrm-api" / "jobs.sqlite"

            def records() -> dict:
                import sqlite3

                with sqlite3.connect(db) as conn:
                    return dict(conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())

            kept = records()
            started = time.perf_counter()
            http.get("/v1/distillations", params={"limit": 100})
            list_ms = 1000 * (time.perf_counter() - started)
            time.sleep(25)
            out["records"] = {"posted_and_deleted": made, "records_kept": kept, "list_100_ms": round(list_ms, 1),
                              "records_after_retention": records(),
                              "job_folders_after_retention": len(list((root / "store" / ".fadrm-api" / "jobs")
                                                                      .glob("job-*")))}

            # The Ray head killed.
            head = RayHead.model_validate_json((root / "store" / ".fadrm-api" / "ray-head.json").read_text())
            os.killpg(head.pid, signal.SIGKILL)
            killed = time.monotonic()
            while http.get("/readyz").status_code == 200 and time.monotonic() - killed < 10:
                time.sleep(0.1)
            while http.get("/readyz").status_code != 200 and time.monotonic() - killed < 300:
                time.sleep(0.2)
            out["ray_head"] = {"readyz_200_again_after_s": round(time.monotonic() - killed, 1),
                               "jobs_sent": 0}
    finally:
        server.stop()
    return out


def post_raw_text(http: httpx.Client, text: str | bytes) -> httpx.Response:
    return http.post("/v1/distillations", content=text, headers={"Content-Type": "application/json"})




def limits(root: Path) -> dict:
    """Each probe of the table against a service of its own: status, time, /healthz after."""
    server = Server(root, rate_limit=0)
    rows = []
    try:
        with server.client() as http:
            wait_ready(http)
            post_raw(http, probe_body(BASE, "overrides", {"alpha": 2.0}))  # the first request loads the dataset
            for name, where, change, _ in PROBES:
                started = time.perf_counter()
                response = post_raw(http, probe_body(BASE, where, change))
                took = time.perf_counter() - started
                started = time.perf_counter()
                health = httpx.get(f"{server.url}/healthz", timeout=10).status_code
                rows.append({"probe": name, "status": response.status_code, "ms": round(1000 * took, 1),
                             "healthz": health, "healthz_ms": round(1000 * (time.perf_counter() - started), 1)})
            jobs = len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"])
    finally:
        server.stop()
    return {"probes": rows, "jobs_made": jobs}


def print_limits(result: dict) -> None:
    print("| probe | status | refused in (ms) | /healthz right after (ms) |\n|---|---|---|---|")
    for r in result["probes"]:
        print(f"| {r['probe']} | {r['status']} | {r['ms']} | {r['healthz_ms']} |")
    print(f"jobs made: {result['jobs_made']}")
