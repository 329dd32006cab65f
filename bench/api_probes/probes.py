"""The probes, the catalog and the soft-label download under load, each on a `fadrm serve` of its
own (default limits: 20 requests a second per token):

- `health`: `--pollers` clients (one keep-alive connection each, raw HTTP/1.1 on asyncio streams:
  a client that costs little beside the server, on the same cores) ask `/healthz` and `/readyz` in
  turn, back to back (`--interval` 0) or with a pause, for `--seconds`, while a distill job runs and
  another thread sends requests back to back with the same token to `/v1/teachers`, so the token is
  rate limited throughout. Prints each probe's latency percentiles, the probes that were not 200,
  how many of the token's other requests were 429, the server's CPU time per request (the
  probes' and the token's others), and the machine's load average (the pollers share it).
  `--code DIR` runs the service of another checkout (the code before a change) the same way;
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

from bench.api_load import TOKEN, wait_ready
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


async def probe_load(port: int, paths: list[str], pollers: int, seconds: float, interval: float) -> dict:
    """`pollers` keep-alive connections asking `paths` in turn for `seconds` (module docstring):
    each path's latency percentiles (ms), and the answers other than 200."""
    latencies: dict[str, list[float]] = {path: [] for path in paths}
    errors: dict[str, int] = {}
    requests = {path: (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").encode()
                for path in paths}

    async def poller(k: int, start: float, stop_at: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        i = k
        try:
            while time.perf_counter() < stop_at:
                path = paths[i % len(paths)]
                began = time.perf_counter()
                writer.write(requests[path])
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                latencies[path].append(time.perf_counter() - began)
                if (status := head[9:12].decode()) != "200":
                    errors[status] = errors.get(status, 0) + 1
                i += 1
                if interval:
                    await asyncio.sleep(interval)
        finally:
            writer.close()

    start = time.perf_counter() + 2.0  # every connection open first
    await asyncio.gather(*(poller(k, start, start + seconds) for k in range(pollers)))

    def summary(values: list[float]) -> dict:
        values = sorted(values)
        pct = [round(1000 * values[min(len(values) - 1, int(p * len(values)))], 1) if values else None
               for p in (0.5, 0.95, 0.99, 1.0)]
        return {"requests": len(values), "p50_ms": pct[0], "p95_ms": pct[1], "p99_ms": pct[2], "max_ms": pct[3]}

    return {**{path: summary(values) for path, values in latencies.items()},
            "requests": sum(map(len, latencies.values())), "rate_per_s": round(
                sum(map(len, latencies.values())) / seconds, 1), "not_200": errors}


def health(root: Path, pollers: int, seconds: float, interval: float, iterations: int,
           code: Path | None = None) -> dict:
    server = Server(root, code=code, max_running=1)
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
            load = asyncio.run(probe_load(server.port, ["/healthz", "/readyz"], pollers, seconds, interval))
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
            wait_ready(http, path="/healthz", interval=0.05)
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
