"""What a client could make the service answer with a 5xx, leak or show (`strings`), on a
`fadrm serve` of its own (the request rate limit raised: the probes, not the limit).

- `strings`: JSON strings no UTF-8 encoder takes or no name should hold (escaped lone surrogates,
  non-characters, control bytes, a NUL, a right-to-left override) in every typed field, an
  unknown key, a class name and a `student_kwargs` key; the statuses (no 5xx should be among them);
- `no_token`: POSTs without a token whose bodies are not JSON, not UTF-8, or hold a surrogate;
  the statuses (401 before the body is read);
- `descriptors`: `--bursts` bursts of 40 parallel reads of a job's endpoints, each after `--idle`
  seconds of quiet (long enough for the server's idle threads to exit); the server's open files
  after each;
- `broken_teacher`: a `--teacher-mb` MiB file that is no checkpoint in the teacher folder while
  40 parallel listings of `/v1/teachers` run, twice over; the listings' times, `/healthz`'s
  meanwhile, how often the file was read (its log lines), whether it was listed, and whether the
  422 naming it shows a server path;
- `damaged_run`: a finished job whose run has one byte flipped afterwards (size and mtime kept);
  the status and line of each download route, and the job's error.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx

from bench.api_load import wait_ready
from bench.api_probes.server import BASE, Server, healthz_while, median
from fadrm_ray.layout import RunLayout

NASTY = ["\\ud800", "\\udfff", "a\\ud83d", "\\ufffe", "\\uffff", "\\u0000", "\\u001b[31m", "x\\u202e"]


def string_bodies() -> list[tuple[str, bytes]]:
    """(field, raw JSON) with each nasty escape in each place, put into the JSON text as it is."""
    mark = "@@nasty@@"
    out = []
    for text in NASTY:
        cases = {field: {**BASE, field: mark} for field in ("dataset", "teacher", "preset", "ipc")}
        cases["unknown key"] = {**BASE, mark: 1}
        cases["class name"] = {**BASE, "classes": [mark]}
        cases["student_kwargs key"] = {**BASE, "evaluate": True, "evaluation": {"student_kwargs": {mark: 1}}}
        out += [(where, json.dumps(body).replace(mark, text).encode()) for where, body in cases.items()]
    return out


def _post(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post("/v1/distillations", content=body, headers={"Content-Type": "application/json"})


def strings(http: httpx.Client) -> dict:
    statuses: dict[str, list[int]] = {}
    for where, body in string_bodies():
        statuses.setdefault(where, []).append(_post(http, body).status_code)
    every = [s for v in statuses.values() for s in v]
    return {"requests": len(every), "statuses": sorted(set(every)), "5xx": sum(s >= 500 for s in every),
            "by_field": {k: sorted(set(v)) for k, v in statuses.items()}}


def no_token(url: str) -> dict:
    with httpx.Client(base_url=url, timeout=30) as anonymous:
        answers = [_post(anonymous, body).status_code for body in (b"not json", b"\xff\xfe{", b'{"dataset": "\\ud800"}')]
    return {"statuses": answers}


def descriptors(url: str, headers: dict, pid: int, job_id: str, bursts: int, idle: float) -> dict:
    def read():
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            c.get(f"/v1/distillations/{job_id}")
            c.get("/v1/distillations")

    counts = [len(os.listdir(f"/proc/{pid}/fd"))]
    for i in range(bursts):
        threads = [threading.Thread(target=read) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counts.append(len(os.listdir(f"/proc/{pid}/fd")))
        if i + 1 < bursts:
            time.sleep(idle)
    return {"open_files": counts, "rise": max(counts) - counts[0]}


def broken_teacher(root: Path, url: str, headers: dict, port: int, megabytes: int) -> dict:
    path = root / "teachers" / "broken.pt"
    with open(path, "wb") as f:
        for _ in range(megabytes):
            f.write(os.urandom(1 << 20))
    stop = threading.Event()
    health: list[float] = []
    watcher = threading.Thread(target=lambda: health.extend(healthz_while(port, stop)))
    watcher.start()
    times, listed = [], set()
    try:
        for _ in range(2):
            def listing():
                with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
                    started = time.perf_counter()
                    names = [t["name"] for t in c.get("/v1/teachers").json()]
                    times.append(time.perf_counter() - started)
                    listed.update(names)
            threads = [threading.Thread(target=listing) for _ in range(40)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        stop.set()
        watcher.join()
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        refused = http.post("/v1/distillations", json={**BASE, "teacher": "broken"})
    log = (root / "serve.log").read_text(errors="replace")
    path.unlink()
    return {"file_mb": megabytes, "listings": len(times), "listing_median_s": round(median(times), 3),
            "listing_max_s": round(max(times), 3), "healthz_median_ms": round(1000 * median(health), 1),
            "healthz_max_ms": round(1000 * max(health), 1), "reads_logged": log.count("teacher broken is not offered"),
            "listed": "broken" in listed, "status": refused.status_code,
            "path_shown": str(root) in refused.text, "detail": refused.json()["detail"][0]["msg"]}


def damaged_run(root: Path, http: httpx.Client) -> dict:
    made = http.post("/v1/distillations", json={**BASE, "classes": [1, 8], "seed": 11})
    if made.status_code not in (200, 202):
        raise SystemExit(f"the job to damage was refused: {made.status_code} {made.text[:300]}")
    job = made.json()
    while (state := http.get(f"/v1/distillations/{job['id']}").json())["state"] not in ("succeeded", "failed"):
        time.sleep(0.5)
    part = RunLayout(root / "store" / state["run_id"]).parts_on_disk()[0]
    stat = part.stat()
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    base = f"/v1/distillations/{job['id']}"
    routes = {}
    for route in ("/dataset", "/dataset?format=imagefolder", "/preview.png"):
        r = http.get(base + route)
        routes[route] = {"status": r.status_code, "detail": r.json().get("detail") if r.status_code != 200 else None}
    return {"routes": routes, "job_error": http.get(base).json()["error"]}


def run_all(root: Path, bursts: int, idle: float, teacher_mb: int) -> dict:
    server = Server(root, rate_limit=1000, rate_burst=2000)
    out: dict = {}
    try:
        with server.client() as http:
            wait_ready(http)
            out["strings"] = strings(http)
            out["no_token"] = no_token(server.url)
            out["damaged_run"] = damaged_run(root, http)
            job_id = http.get("/v1/distillations").json()["jobs"][0]["id"]
        out["descriptors"] = descriptors(server.url, server.headers, server.proc.pid, job_id, bursts, idle)
        out["broken_teacher"] = broken_teacher(root, server.url, server.headers, server.port, teacher_mb)
    finally:
        server.stop()
    return out
