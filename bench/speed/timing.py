"""The clock, the memory gauges and the profiler every speed benchmark of bench/speed/ reads.

- `timed(run, device)`: the seconds of one call, the device synchronized before and after, and
  the peak memory of that call alone (CUDA: `max_memory_allocated`; a CPU: this process's peak
  RSS, VmHWM, restarted first).
- `profile(run, device, steps)`: a torch.profiler summary of a call that takes `steps` steps:
  operator calls per step (every recorded call, nested ones included, and those called from
  Python), the busiest ops, and on CUDA the kernel time against the wall time, host syncs and
  kernel launches per step; with `folder`, written there as summary.json with the trace beside it.

It imports nothing of the project, so a benchmark that compares checkouts (bench.speed.versions,
bench.student_memory) loads this file by path into a process that runs another checkout's code.
"""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Callable

import torch

TRACE_LIMIT = 4 << 20  # bytes of a gzipped trace kept beside its summary


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def status_mb(key: str) -> float | None:
    """VmRSS (now) or VmHWM (peak) of this process from /proc, in MB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Restart the VmHWM high-water mark (Linux >= 4.0), so a run's peak is its own. getrusage's
    ru_maxrss cannot be used: it carries the parent's peak across fork + exec."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    peak = status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def timed(run: Callable[[], object], device: str) -> tuple[float, object, dict]:
    """(seconds, what `run` returned, peak memory) of one call of `run`: {"peak_gb": ...} on CUDA,
    {"peak_rss_mb": ...} on a CPU, each the peak of this call alone."""
    cuda = str(device).startswith("cuda")
    reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    started = time.perf_counter()
    out = run()
    sync(device)
    seconds = time.perf_counter() - started
    peak = {"peak_gb": torch.cuda.max_memory_allocated() / 2**30} if cuda else {"peak_rss_mb": peak_rss_mb()}
    return seconds, out, peak


def profile(run: Callable[[], object], device: str, steps: int, folder: Path | None = None) -> dict:
    """A torch.profiler summary of one call of `run`, which takes `steps` steps (module docstring);
    with `folder`, written to folder/summary.json and the trace beside it (trace.json.gz) where it
    is at most TRACE_LIMIT bytes gzipped."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = str(device).startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with torch_profile(activities=activities) as prof:
        started = time.perf_counter()
        run()
        sync(device)
        wall = time.perf_counter() - started
    events = prof.key_averages()

    def self_us(e):
        return getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total

    top = sorted(events, key=self_us, reverse=True)[:12]
    out = {"steps": steps, "wall_ms_per_step": 1000 * wall / steps,
           "top": [{"op": e.key, "calls_per_step": e.count / steps, "ms_per_step": self_us(e) / 1000 / steps}
                   for e in top]}
    if cuda:
        kernels = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000
        syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                           "cudaEventSynchronize"))
        copies = sum(e.count for e in events if e.key.startswith("cudaMemcpy"))
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                             "cuLaunchKernel", "cuLaunchKernelEx"))
        out.update(kernel_ms_per_step=kernels / steps, busy_share=kernels / (1000 * wall),
                   host_syncs_per_step=syncs / steps, memcpy_calls_per_step=copies / steps,
                   kernel_launches_per_step=launches / steps)
    else:
        out["ops_ms_per_step"] = sum(e.self_cpu_time_total for e in events) / 1000 / steps
    # Every operator call the profiler recorded (nested calls counted), and those called from
    # Python directly (no recorded parent): what each step asks of the dispatcher.
    recorded = prof.events()
    out["op_calls_per_step"] = len(recorded) / steps
    out["top_level_op_calls_per_step"] = sum(1 for e in recorded if e.cpu_parent is None) / steps
    if folder is not None:
        out.update(_write_trace(prof, folder))
        (folder / "summary.json").write_text(json.dumps(out, indent=2))
    return out


def _write_trace(prof, folder: Path) -> dict:
    import gzip
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / "trace.json"
    prof.export_chrome_trace(str(raw))
    trace = folder / "trace.json.gz"
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    trace_bytes = trace.stat().st_size
    if trace_bytes > TRACE_LIMIT:
        trace.unlink()
    return {"trace": str(trace) if trace_bytes <= TRACE_LIMIT else None, "trace_gzip_bytes": trace_bytes}
