"""The probes, the catalog and the soft-label download under load, each on a `fadrm serve` of its
own (default limits: 20 requests a second per token):

- `health`: `--pollers` clients (one keep-alive connection each) ask `/healthz` and `/readyz` in
  turn, back to back (`--interval` 0) or with a pause, for `--seconds`, while a distill job runs and
  another thread sends 40 requests a second with the same token to `/v1/teachers`, so the token is
  rate limited throughout. Prints each probe's latency percentiles, the probes that were not 200,
  how many of the token's other requests were 429, the server's CPU time per request (the
  probes' and the token's others), and the machine's load average (the pollers share it);
- `catalog`: the first `GET /v1/datasets` after a start, as soon as `/healthz` answers (a 503 with
  Retry-After while the service still reads its datasets), and the first 200;
- `soft-labels`: jobs whose evaluations store the soft labels of `--epochs` epochs each (2 images,
  one seed: one small epoch file per epoch), and each one's first `GET .../soft-labels` (the pack
  built then) and second (served as built).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import httpx

from bench.api_load import poll_load
from bench.api_probes.server import BASE, Server, done


def machine() -> dict:
    """The CPU and its load, for the figures beside it."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    return {"cpu": model, "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def health(root: Path, pollers: int, seconds: float, interval: float, iterations: int) -> dict:
    server = Server(root, max_running=1)
    out: dict = {"before": machine()}
    try:
        server.ready()
        with server.client() as http:
            job = http.post("/v1/distillations", json={**BASE, "seed": 5, "overrides": {
                **BASE["overrides"], "iterations": iterations}}).json()
            while http.get(f"/v1/distillations/{job['id']}").json()["state"] == "queued":
                time.sleep(0.2)
        stop, others = threading.Event(), []

        def limited() -> None:  # the same token, back to back: over its rate, 429s once its burst is spent
            with server.client() as http:
                while not stop.is_set():
                    others.append(http.get("/v1/teachers").status_code)

        flood = threading.Thread(target=limited)
        flood.start()
        cpu = process_cpu_s(server.proc.pid)
        try:
            load = asyncio.run(poll_load(server.url, {"healthz": "/healthz", "readyz": "/readyz"}, pollers, seconds,
                                         interval))
        finally:
            stop.set()
            flood.join()
        served = load["requests"] + len(others)
        out["server_cpu_ms_per_request"] = round(1000 * (process_cpu_s(server.proc.pid) - cpu) / max(1, served), 2)
        with server.client() as http:
            state = http.get(f"/v1/distillations/{job['id']}").json()["state"]
            http.delete(f"/v1/distillations/{job['id']}")
        out.update(pollers=pollers, interval_s=interval, load=load, job_state_meanwhile=state,
                   token_requests={str(code): others.count(code) for code in sorted(set(others))}, after=machine())
    finally:
        server.stop()
    return out


def catalog(root: Path) -> dict:
    server = Server(root)
    out: dict = {}
    started = time.monotonic()
    try:
        with server.client() as http:
            while True:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            out["healthz_after_s"] = round(time.monotonic() - started, 1)
            first = True
            while True:
                t = time.perf_counter()
                r = http.get("/v1/datasets")
                took = round(1000 * (time.perf_counter() - t), 1)
                if first:
                    out["first"] = {"status": r.status_code, "ms": took, "retry_after": r.headers.get("retry-after")}
                    first = False
                if r.status_code == 200:
                    out["first_200"] = {"ms": took, "after_start_s": round(time.monotonic() - started, 1),
                                        "datasets": [d["name"] for d in r.json()]}
                    break
                time.sleep(0.2)
            t = time.perf_counter()
            http.get("/v1/datasets")
            out["next_ms"] = round(1000 * (time.perf_counter() - t), 1)
    finally:
        server.stop()
    return {**out, **machine()}


def soft_labels(root: Path, epochs: list[int]) -> dict:
    server = Server(root, rate_limit=0)
    rows = []
    try:
        server.ready()
        with server.client() as http:
            for n in epochs:
                body = {**BASE, "classes": [3, 7], "ipc": 1, "seed": n, "evaluate": True,
                        "evaluation": {"epochs": n, "seeds": 1, "soft_labels": "stored", "soft_label_topk": 2}}
                job = done(http, body)
                url = f"/v1/distillations/{job['id']}/soft-labels"
                timed = []
                for _ in range(2):
                    t = time.perf_counter()
                    r = http.get(url)
                    r.raise_for_status()
                    timed.append(round(time.perf_counter() - t, 3))
                rows.append({"epochs": n, "bytes": len(r.content), "first_download_s": timed[0],
                             "second_download_s": timed[1], "first_per_epoch_ms": round(1000 * timed[0] / n, 2)})
    finally:
        server.stop()
    return {"downloads": rows, **machine()}
