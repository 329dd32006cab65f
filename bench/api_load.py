"""The REST service under polling load, with a job running.

    python -m bench.api_load [--clients 50] [--seconds 30] [--interval 0] [--iterations 2000] [--out DIR] [--json]

Starts `fadrm serve` (uvicorn on 127.0.0.1, its own local Ray head) on a fresh store under DIR,
with a small digits teacher (trained once into DIR/teacher). Then:

1. baseline: one job (digits, 2 classes, IPC 2, `--iterations`, one worker) runs with no load;
   its running time is read from the job's own timings;
2. load: the same job with another seed (so it is computed again, the same amount of work), and
   while it runs, `--clients` concurrent clients (asyncio + httpx, one connection each) poll it
   (GET /v1/distillations/{id}) and list jobs (GET /v1/distillations?limit=20), alternating,
   for `--seconds`, each waiting `--interval` seconds between its requests (0: back to back,
   the worst case; a polling client would wait).

Prints the latency percentiles (p50/p95/p99, in ms) of the status polls and of the list calls
apart (a list reads a page of job records, a poll one), the request count and rate, the errors
(anything but 200, or no answer), and the job's slowdown under load: its running time under
load over its baseline running time (the load covers `overlap` of it). The service's per-token
rate limit is off for the run (all clients share one token). Writes DIR/api_load.json. Every
process of this run shares the machine, the clients included.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import secrets
import tempfile
import time
from pathlib import Path

import httpx

TOKEN = secrets.token_urlsafe(32)
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_teacher(folder: Path) -> Path:
    from fadrm_ray.data import get_dataset
    from fadrm_ray.config import SqueezeConfig
    from fadrm_ray.squeeze import ensure_teacher

    cfg = SqueezeConfig(model="convnet-bn", epochs=4, model_kwargs={"width": 32}, seed=0)
    return Path(ensure_teacher(get_dataset("digits"), cfg, folder, num_threads=1, progress=False).path)


def _start(root: Path, port: int) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "FADRM_API_TOKEN": TOKEN, "FADRM_STORE": str(root / "store"),
           "FADRM_TEACHERS": str(root / "teachers"), "FADRM_WORKERS": "1", "FADRM_THREADS": "1",
           "FADRM_MAX_RUNNING": "1", "FADRM_RATE_LIMIT": "0", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log = open(root / "serve.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "serve", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, env


def wait_ready(http: httpx.Client, timeout: float = 240, path: str = "/readyz", interval: float = 0.5) -> None:
    """Poll `path` (the readiness probe, or /healthz for a process that merely answers) until 200."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if http.get(path).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"the service did not answer {path} with 200 in {timeout:g} s")


def _run_job(http: httpx.Client, seed: int, iterations: int) -> str:
    body = {"dataset": "digits", "teacher": "bench", "classes": [3, 7], "ipc": 2, "seed": seed,
            "overrides": {"iterations": iterations, "precision": "fp32"}}
    response = http.post("/v1/distillations", json=body)
    response.raise_for_status()
    return response.json()["id"]


def _wait_job(http: httpx.Client, job_id: str, states=("succeeded", "failed", "cancelled")) -> dict:
    while True:
        job = http.get(f"/v1/distillations/{job_id}").json()
        if job["state"] in states:
            return job
        time.sleep(0.2)


async def poll_load(url: str, paths: dict[str, str], clients: int, seconds: float, interval: float,
                    token: str | None = TOKEN) -> dict:
    """`clients` clients (one connection each) asking `paths` (kind -> path) in turn for
    `seconds`, each waiting `interval` between its requests: the latency percentiles of each kind
    and of all, the rate, and the answers other than 200."""
    latencies: dict[str, list[float]] = {kind: [] for kind in paths}
    slow: list[tuple[float, float]] = []  # (seconds into the load, latency) of requests over 1 s
    errors: dict[str, int] = {}
    stop_at = begin = float("inf")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    kinds, paths = list(paths), list(paths.values())

    async def client(http: httpx.AsyncClient, k: int) -> None:
        await http.get(paths[k % len(paths)])  # opens this client's connection; not measured
        await ready.wait()
        i = k
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                response = await http.get(paths[i % len(paths)])
                if response.status_code != 200:
                    errors[str(response.status_code)] = errors.get(str(response.status_code), 0) + 1
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            took = time.perf_counter() - started
            latencies[kinds[i % len(kinds)]].append(took)
            if took > 1.0:
                slow.append((round(started - begin, 2), round(took, 2)))
            i += 1
            if interval:
                await asyncio.sleep(interval)

    # One httpx client (one connection) per simulated client, all built and connected before
    # the measured window opens: building them costs the load generator seconds of CPU.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    ready = asyncio.Event()
    https = [httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) for _ in range(clients)]
    try:
        tasks = [asyncio.create_task(client(http, k)) for k, http in enumerate(https)]
        await asyncio.sleep(3.0)  # every connection open
        begin = started = time.perf_counter()
        stop_at = begin + seconds
        ready.set()
        await asyncio.gather(*tasks)
    finally:
        for http in https:
            await http.aclose()
    wall = time.perf_counter() - started

    def summary(values: list[float]) -> dict:
        values = sorted(values)

        def pct(p: float) -> float:
            return round(1000 * values[min(len(values) - 1, int(p * len(values)))], 1) if values else float("nan")

        return {"requests": len(values), "p50_ms": pct(0.50), "p95_ms": pct(0.95), "p99_ms": pct(0.99),
                "max_ms": pct(1.0)}

    every = [t for kind in kinds for t in latencies[kind]]
    return {"requests": len(every), "seconds": round(wall, 1), "rate_per_s": round(len(every) / wall, 1),
            **summary(every), **{kind: summary(latencies[kind]) for kind in kinds},
            "errors": sum(errors.values()), "error_kinds": errors, "over_1s": sorted(slow)[:100]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.api_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=0.0, help="seconds each client waits between requests")
    parser.add_argument("--iterations", type=int, default=2000, help="recover iterations of the job")
    parser.add_argument("--out", default=None, help="folder for the store, teacher and results (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="fadrm-api-load-"))
    (root / "teachers").mkdir(parents=True, exist_ok=True)
    shutil.copy(small_teacher(root / "teacher"), root / "teachers" / "bench.pt")
    shutil.rmtree(root / "store", ignore_errors=True)
    port = free_port()
    proc, env = _start(root, port)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
            wait_ready(http)
            baseline = _wait_job(http, _run_job(http, seed=1, iterations=args.iterations))
            loaded_id = _run_job(http, seed=2, iterations=args.iterations)
            running = _wait_job(http, loaded_id, states=("running", "succeeded", "failed"))
            polled = {"poll": f"/v1/distillations/{loaded_id}", "list": "/v1/distillations?limit=20"}
            load = asyncio.run(poll_load(url, polled, args.clients, args.seconds, args.interval))
            loaded = _wait_job(http, loaded_id)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        subprocess.run([sys.executable, "-m", "actors.cli", "serve", "--stop-ray"], env=env, capture_output=True,
                       timeout=120)
    base_s, load_s = baseline["timings"]["running_seconds"], loaded["timings"]["running_seconds"]
    result = {
        "clients": args.clients, "interval_s": args.interval, "load": load, "iterations": args.iterations,
        "job_baseline_s": base_s, "job_under_load_s": load_s,
        "job_slowdown": round(load_s / base_s, 2) if base_s else None,
        "overlap": round(min(1.0, args.seconds / load_s), 2) if load_s else None,
        "states": [baseline["state"], running["state"], loaded["state"]], "cpus": os.cpu_count(),
    }
    (root / "api_load.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.clients} clients (pause {args.interval} s) for {load['seconds']} s: {load['requests']} requests "
              f"({load['rate_per_s']}/s), errors {load['errors']} {load['error_kinds'] or ''}")
        for kind, label in (("poll", "status polls"), ("list", "list calls")):
            part = load[kind]
            print(f"  {label:<12}: {part['requests']} requests, p50 {part['p50_ms']} ms, p95 {part['p95_ms']} ms, "
                  f"p99 {part['p99_ms']} ms, max {part['max_ms']} ms")
        print(f"job ({args.iterations} iterations): {base_s:.1f} s alone, {load_s:.1f} s under load: "
              f"slowdown x{result['job_slowdown']} (load over {result['overlap']:.0%} of it)")
        print(f"written to {root / 'api_load.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
