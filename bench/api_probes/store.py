"""The store under a hostile client (`store`): each class below against a `fadrm serve` of its
own on loopback, one line each, with the slowest `/healthz` meanwhile (timed every 0.1 s); the
last line is the service's (every `/healthz`, its open files and RSS after a warm-up and at the end).

The store is a 1 GiB tmpfs in a mount namespace of the server's (`unshare -rm`) where the machine
allows one; else a plain folder, and `full_store` is skipped (the machine's own disk is not
filled). FADRM_MAX_JOB_RECORDS=`--records`, FADRM_MAX_EVAL_WORK=1000, the token's rate raised.
The classes: `forwarded` (80 requests without a token, each naming another X-Forwarded-For),
`refusals` (60 000 nested brackets of each content type; a trailing slash with `Host:
evil.example`; a body naming no teacher, against the schema), `too_large` (100 KB announced and
sent whole before reading, or chunked), `eval_budget` (2 classes x IPC 2 x 100 epochs x 2 seeds:
800 image-epochs of soft-label students, 1600 with the hard-label ones, against 1000),
`conditional` (the conditions on a dataset, Range on /teacher), `repair` (from when `fadrm verify
--repair` of a damaged run has removed its manifest until it ends, its download and a submit the
run would serve, in a loop), `soft_labels` (stored labels grown to `--soft-label-mib` MiB of
logits, a job's first download: the server's peak RSS growth, beside `pack_soft_labels` packing
them in memory), `retention` (`--seconds` of new jobs sweeping records past the cap while 4
threads download every job's files; two folders without a record planted first, as a crash
leaves them), `full_store` (the disk filled, then the space back).
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.api_load import TOKEN, wait_ready
from bench.api_probes.server import BASE, Server, done, median, tmpfs_allowed

BASE = {**BASE, "ipc": 4}
ROUTES = ("/dataset", "/dataset?format=imagefolder", "/preview.png", "/report", "/recipe", "/teacher")


def _ids(http: httpx.Client) -> set[str]:
    return {j["id"] for j in http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]}


def _counts(statuses: list[int]) -> dict[str, int]:
    return {str(s): statuses.count(s) for s in sorted(set(statuses))}


RACED = ([3, 7], [1, 2], [4, 6])  # runs of IPC 5 the race asks for again: 15 requests, over the cap


def retention(s: Server, seconds: float) -> dict:
    jobs_dir = s.seen / ".fadrm-api" / "jobs"
    for i in (1, 2):
        (jobs_dir / f"job-{i:024x}").mkdir(parents=True, exist_ok=True)
    statuses, made, stop = [], set(), threading.Event()

    def download():
        with s.client() as c:
            while not stop.is_set():
                for job_id in _ids(c):
                    statuses.extend(c.get(f"/v1/distillations/{job_id}{r}").status_code for r in ROUTES)

    readers = [threading.Thread(target=download) for _ in range(4)]
    for t in readers:
        t.start()
    with s.client() as http:
        deadline, i = time.time() + seconds, 0
        while time.time() < deadline:
            asked = {**BASE, "classes": RACED[i % 3], "ipc": 1 + (i // 3) % 5}
            made.add(http.post("/v1/distillations", json=asked).json()["id"])
            i += 1
        stop.set()
        for t in readers:
            t.join()
        records = _ids(http)
        refused = {j["id"]: j["state"] for j in (http.get(f"/v1/distillations/{k}").json() for k in records)
                   if j["state"] != "succeeded"}
    orphans = sorted(p.name for p in jobs_dir.iterdir() if p.name not in records)
    return {"submits": i, "jobs_made": len(made), "statuses": _counts(statuses), "unfinished": refused,
            "5xx": sum(x >= 500 for x in statuses), "records": len(records), "folders_without_record": len(orphans)}


def repair(s: Server) -> dict:
    """Downloads and a submit the run would serve, looped from when the repair has removed the run's
    manifest until it has finished."""
    from fadrm_ray.layout import RunLayout

    with s.client() as http:
        job = done(http, {**BASE, "classes": [1, 8], "ipc": 2, "seed": 31})
        layout, base = RunLayout(s.seen / job["run_id"]), f"/v1/distillations/{job['id']}"
        part = layout.parts_on_disk()[0]
        part.write_bytes(bytes(b ^ 0xFF if i == 100 else b for i, b in enumerate(part.read_bytes())))
        damaged, before = http.get(base + "/dataset").status_code, _ids(http)
        fixing = subprocess.Popen(s.inside(sys.executable, "-m", "actors.cli", "verify", "--run",
                                           str(s.store / job["run_id"]), "--repair", "--quiet"),
                                  env=s.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        while layout.manifest.exists() and fixing.poll() is None:
            time.sleep(0.005)
        downloads, submits = [], []
        while fixing.poll() is None:
            downloads.append(http.get(base + "/dataset").status_code)
            submits.append(http.post("/v1/distillations", json={**BASE, "classes": [1, 8], "ipc": 1,
                                                                "seed": 31}).status_code)
        queued = [i for i in _ids(http) - before if not http.get(f"/v1/distillations/{i}").json()["reused"]]
        return {"damaged": damaged, "during_repair_downloads": _counts(downloads), "submits": _counts(submits),
                "jobs_queued": len(queued), "after": http.get(base + "/dataset").status_code,
                "error_after": http.get(base).json()["error"], "repair_exit": fixing.returncode}


def forwarded(s: Server) -> dict:
    start = (s.root / "serve.log").stat().st_size
    with s.client(token=False) as anon:
        limited = sum("retry-after" in anon.get("/v1/teachers", headers={"X-Forwarded-For": f"9.9.9.{i}"}).headers
                      for i in range(80))
    time.sleep(0.5)
    text = (s.root / "serve.log").read_bytes()[start:].decode(errors="replace")
    return {"requests": 80, "rate_limited": limited, "access_log_lines": text.count('"GET /v1/teachers HTTP/1.1" 401'),
            "forged_address_logged": "9.9.9." in text}


def _fill(folder: Path) -> Path:
    with open(folder / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(b"\0" * (1 << 20)):
            pass
    return folder / "filler"


def full_store(s: Server) -> dict:
    from fadrm_ray.store.verify import verify_run

    if not s.tmpfs:
        return {"skipped": "no tmpfs of its own on this machine (unshare -rm); the machine's disk is not filled"}
    with s.client() as http:
        job = done(http, {**BASE, "classes": [2, 5], "ipc": 1, "seed": 3})
        base = f"/v1/distillations/{job['id']}"
        filler = _fill(s.seen)
        full = {r: http.get(base + r) for r in ROUTES[:3]}
        full["submit"] = http.post("/v1/distillations", json={**BASE, "classes": [4, 6], "ipc": 1, "seed": 4})
        ready_full = http.get("/readyz").status_code
        filler.unlink()
        after = {r: http.get(base + r).status_code for r in ROUTES}
    check = verify_run(s.seen / job["run_id"])
    return {"while_full": {k: f"{r.status_code} {r.json().get('detail', '')[:60]!r}" for k, r in full.items()},
            "readyz_full": ready_full, "after": after, "run_intact": check.complete and not check.bad_units}


def status_kib(pid: int, key: str) -> int:
    """A line of /proc/PID/status (VmRSS, VmHWM), in KiB."""
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(key + ":"))


def grow_soft_labels(folder: Path, packed_bytes: int) -> int:
    """More epochs in a stored soft-label folder, in its own format (its first epoch's rows
    repeated, 4096 to an epoch, with random logits), until they hold `packed_bytes` of logits: a
    long evaluation's worth. How many rows the folder holds then."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = pq.read_table(folder / "epoch=00000.parquet")
    files = sorted(folder.glob("epoch=*.parquet"))
    total = sum(pq.read_metadata(path).num_rows for path in files)
    logits_type = first.schema.field("logits").type
    classes, rows, epoch = logits_type.list_size, 4096, len(files)
    rng = np.random.default_rng(0)
    while total * classes * 2 < packed_bytes:  # float16 logits, random: they do not compress
        table = first.take(np.arange(rows) % first.num_rows)
        bits = rng.integers(0, 1 << 16, rows * classes, dtype=np.uint16) & 0xBFFF  # finite values
        logits = pa.FixedSizeListArray.from_arrays(pa.array(bits.view(np.float16)), classes).cast(logits_type)
        table = table.set_column(table.schema.get_field_index("logits"), "logits", logits)
        pq.write_table(table, folder / f"epoch={epoch:05d}.parquet", compression="zstd")
        total, epoch = total + rows, epoch + 1
    return total


def peak_growth_kib(pid: int, work) -> int:
    """How far the resident memory of process `pid` rises above where it was while `work()` runs:
    its peak RSS reset first where the kernel allows (/proc/PID/clear_refs), and sampled too."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    before, peak, stop = status_kib(pid, "VmRSS"), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(status_kib(pid, "VmRSS"))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        stop.set()
        sampler.join()
    return max(max(peak), status_kib(pid, "VmHWM") if reset else 0) - before


def soft_labels(s: Server, mib: int) -> dict:
    from fadrm_ray.layout import RunLayout

    evaluation = {"epochs": 2, "seeds": 1, "soft_labels": "stored"}
    body = {**BASE, "classes": [0, 9], "ipc": 1, "seed": 51, "evaluate": True, "evaluation": evaluation}
    with s.client() as http:
        small = done(http, body)
        larger = done(http, {**body, "evaluation": {**evaluation, "lr": 0.002}})
        http.get(f"/v1/distillations/{small['id']}/soft-labels").raise_for_status()
    folder = next(RunLayout(s.seen / small["run_id"]).soft_labels.glob("*/meta.json")).parent
    rows = grow_soft_labels(folder, mib * 2**20)
    size = 0

    def download():
        nonlocal size
        with s.client() as http, http.stream("GET", f"/v1/distillations/{larger['id']}/soft-labels") as r:
            for chunk in r.iter_bytes():
                size += len(chunk)

    grown = peak_growth_kib(s.proc.pid, download)
    in_memory = subprocess.run([sys.executable, "-c", (
        "import resource, sys; from pathlib import Path; "
        "from fadrm_ray.evaluation.soft_labels import pack_soft_labels; "
        "import pyarrow; base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        f"data = pack_soft_labels([Path({str(folder)!r})]); "
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)")],
        capture_output=True, text=True, env=s.env, timeout=600)
    return {"file_mib": round(size / 2**20, 1), "rows": rows, "server_peak_rss_growth_mib": round(grown / 1024, 1),
            "in_memory_pack_peak_growth_mib": int(in_memory.stdout.strip() or -1)}


def conditional(s: Server) -> dict:
    with s.client() as http:
        job = done(http, {**BASE, "classes": [2, 6], "ipc": 1, "seed": 41})
        base = f"/v1/distillations/{job['id']}"
        tag = http.get(base + "/dataset").headers["etag"]
        asked = {"If-None-Match": tag, "If-Match": '"other"', "If-Unmodified-Since": "Mon, 01 Jan 1990 00:00:00 GMT"}
        out = {name: http.get(base + "/dataset", headers={name: value}).status_code for name, value in asked.items()}
        return {**out, "teacher Range: bytes=0-9": http.get(base + "/teacher", headers={"Range": "bytes=0-9"}).status_code}


def too_large(s: Server) -> dict:
    body = b" " * 100_000
    head = (f"POST /v1/distillations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    got, reset = b"", False
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        sock.sendall(head + body)
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            reset = True
    with s.client() as http:
        chunked = http.post("/v1/distillations", content=iter([b" " * 8192] * 10),
                            headers={"Content-Type": "application/json"})
    json_type = b"content-type: application/json" in got.lower()
    return {"announced": f"{got[9:12].decode()} {'application/json' if json_type else 'not JSON'} reset={reset}",
            "chunked": f"{chunked.status_code} {chunked.headers.get('content-type')}"}


def refusals(s: Server) -> dict:
    """Nested bodies of each content type, trailing slashes, the schema's "one of the teachers"."""
    import jsonschema

    asked, out = {"dataset": "digits", "classes": [0]}, {}
    with s.client() as http:
        for kind in ("text/plain", "application/x-www-form-urlencoded", None, "application/json"):
            r = http.post("/v1/distillations", content=b"[" * 60_000, headers={"Content-Type": kind} if kind else {})
            out[f"nested {kind or 'untyped'}"] = f"{r.status_code} ({len(r.content)} B)"
        for method, path in (("GET", "/v1/teachers/"), ("POST", "/v1/distillations/")):
            r = http.request(method, path, headers={"Host": "evil.example"}, json={} if method == "POST" else None)
            out[f"{method} {path}"] = f"{r.status_code} Location={r.headers.get('location')}"
        spec = http.get("/openapi.json").json()["components"]["schemas"]["DistillationRequest"]
        out["no teacher: schema-valid"] = jsonschema.Draft202012Validator(spec).is_valid(asked)
        out["no teacher: answer"] = http.post("/v1/distillations", json=asked).status_code
    return out


def eval_budget(s: Server) -> dict:
    body = {**BASE, "ipc": 2, "evaluate": True, "evaluation": {"epochs": 100, "seeds": 2}}
    with s.client() as http:
        r = http.post("/v1/distillations", json=body)
    return {"status": r.status_code, "detail": r.json()["detail"][0]["msg"][:150] if r.status_code == 422 else None}


def run_all(root: Path, seconds: float, records: int, soft_label_mib: int) -> dict:
    tmpfs = tmpfs_allowed(root)
    s = Server(root, tmpfs, max_job_records=records, rate_limit=1000, rate_burst=2000, max_ipc=5,
               max_images=20, max_eval_work=1000)
    out: dict = {}
    # /healthz every 0.1 s from a process of its own (the probes' threads would slow a watcher in
    # this one): a line "when seconds" per answer, `when` on the machine's monotonic clock.
    timings = root / "healthz.txt"
    watch = ("import sys, time, httpx\nwith httpx.Client(timeout=30) as c, open(sys.argv[2], 'w', buffering=1) as f:\n"
             "    while True:\n        t = time.perf_counter(); c.get(sys.argv[1])\n"
             "        f.write(f'{time.monotonic()} {time.perf_counter() - t}\\n'); time.sleep(0.1)\n")

    def health() -> list[tuple[float, float]]:
        return [tuple(map(float, line.split())) for line in timings.read_text().splitlines() if line.count(" ") == 1]

    def files() -> str:  # the server's open files, by kind
        kinds = [os.readlink(f"/proc/{s.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{s.proc.pid}/fd")]
        return (f"{len(kinds)} ({sum(k.startswith('socket:') for k in kinds)} sockets, "
                f"{sum('jobs.sqlite' in k for k in kinds)} of the job records)")

    watcher = None
    try:
        with s.client() as http:
            wait_ready(http)
            for classes in RACED:  # the runs the retention race asks for again
                job = done(http, {**BASE, "classes": classes, "ipc": 5})
            for route in ROUTES:  # every route once: what it loads, loaded
                http.get(f"/v1/distillations/{job['id']}{route}")
        watcher = subprocess.Popen([sys.executable, "-c", watch, f"{s.url}/healthz", str(timings)])
        time.sleep(6)  # idle connections closed
        start = (files(), status_kib(s.proc.pid, "VmRSS") // 1024)
        probes = {"forwarded": forwarded, "refusals": refusals, "too_large": too_large, "eval_budget": eval_budget,
                  "conditional": conditional, "repair": repair,
                  "soft_labels": lambda s: soft_labels(s, soft_label_mib),
                  "retention": lambda s: retention(s, seconds), "full_store": full_store}
        for name, probe in probes.items():
            began = time.monotonic()
            out[name] = probe(s)
            out[name]["healthz_max_ms"] = round(1000 * max((t for when, t in health() if when >= began), default=0), 1)
        time.sleep(6)
        watcher.terminate()
        watcher.wait()
        times = [t for _, t in health()]
        out["service"] = {"tmpfs_store": tmpfs, "healthz": f"{len(times)} answers, median "
                          f"{1000 * median(times):.1f} ms, max {1000 * max(times):.1f} ms",
                          "open_files": f"{start[0]} -> {files()}",
                          "rss_mib": f"{start[1]} -> {status_kib(s.proc.pid, 'VmRSS') // 1024}"}
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
        s.stop()
    return out
