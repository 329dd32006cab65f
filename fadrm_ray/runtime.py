"""How work runs in a process, as opposed to what it computes (settings.py): the torch thread
count of a phase, and the process-wide OpenMP and glibc allocator settings that make CPU work
fast. Where a run's work runs (in this process or on Ray, workers, device) is the
`ExecutionSpec` beside the job (`fadrm_ray.runs.job`). This module imports nothing heavy at the
top (no torch, no pydantic), so a process that imports it first keeps glibc's malloc untouched
until `tune_allocator` runs.

glibc's default malloc hands the many mid-sized tensors of a conv net back to the kernel and
asks for them again every step, which can nearly double the time of a CPU run (docs/architecture.md,
"Execution"; bench/speed/engine_vs_reference.py --ladder measures it). glibc reads
them from `ALLOCATOR_ENV` when a process starts, which is how Ray workers get them
(`runtime_env.env_vars`); a process that is already running gets the same values through
`mallopt`, which `tune_allocator` calls. Every heavy entry point (squeeze, distill, evaluate,
the Ray worker) calls it, so a user importing the library gets the fast path too.

OpenMP's threads (torch's intra-op pool, libgomp) spin after every parallel region, waiting for
the next one. On a machine whose cores are shared, by another job or by the other Ray workers, a
spinning thread holds the core that the working thread needs, and a step can take a hundred
times longer (`bench.speed.scaling` shows it). `OPENMP_ENV` makes them sleep at once instead. libgomp
reads it once, when torch loads it, so it must be in the environment before that: every heavy
process gets it where it is created (`heavy_process_env`: Ray workers through their
`runtime_env`, benchmark subprocesses through their env; Tune trials and the REST service's jobs
must do the same), and the `fadrm` command re-executes itself with it before importing torch
(`ensure_process_env`). The same environment sets the OpenMP thread count to the CPUs the
process was given (`available_cpus`). FADRM_DEFAULT_OMP=1 keeps OpenMP's defaults.
"""
from __future__ import annotations

import ctypes
import math
import os
import platform
import sys
from contextlib import contextmanager
from pathlib import Path


# --------------------------------------------------------------------------- threads
@contextmanager
def torch_threads(num_threads: int | None):
    """Use `num_threads` torch threads inside the block (None: leave the count alone)."""
    if not num_threads:
        yield
        return
    import torch  # here, not at the top: the CLI imports this module before it needs torch

    old = torch.get_num_threads()
    torch.set_num_threads(int(num_threads))
    try:
        yield
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------------------- the allocator
ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",   # 32 MiB: the largest glibc allows, disables the sliding threshold
    "MALLOC_TRIM_THRESHOLD_": "8589934592",  # keep freed memory at the top of the heap
    "MALLOC_TOP_PAD_": "1073741824",        # grow the heap in large steps
}

# mallopt parameter numbers from glibc's malloc.h. mallopt takes a C int, so the trim threshold is
# capped at 2 GiB - 1, which has the same effect here (the heap is never trimmed in practice).
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3}
_INT_MAX = 2**31 - 1
_tuned = False


def tune_allocator() -> bool:
    """Apply `ALLOCATOR_ENV` to this process (glibc only; idempotent).

    Returns True when the settings are in effect: set here, or already set through the
    environment at start-up (then they are left as the user chose). Set FADRM_DEFAULT_MALLOC=1
    to keep glibc's defaults.
    """
    global _tuned
    if _tuned:
        return True
    if os.environ.get("FADRM_DEFAULT_MALLOC", "").strip() not in ("", "0"):
        return False
    if any(name in os.environ for name in ALLOCATOR_ENV):
        _tuned = True
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = all(mallopt(_MALLOPT[name], min(int(value), _INT_MAX)) == 1 for name, value in ALLOCATOR_ENV.items())
    return _tuned


# --------------------------------------------------------------------------- the device
def autotune_convolutions(device) -> None:
    """On CUDA, let cuDNN time its convolution algorithms for each new input shape and keep the
    fastest. A recover stage and a student epoch repeat one shape for hundreds of steps, so the
    first step's timing pays many times over. Process-wide; nothing to do elsewhere."""
    import torch

    if torch.device(device).type == "cuda":
        torch.backends.cudnn.benchmark = True


def to_device(tensor, device):
    """`tensor` (on the host) on `device` without waiting for it: through pinned memory on CUDA,
    so that the copy is queued behind the device's work instead of synchronizing with it."""
    import torch

    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def resolve_device(device: str | None = None) -> str:
    """The device a phase runs on: `device` as given ("cpu", "cuda", "cuda:1"), or None for cuda
    where torch sees a CUDA device, else cpu. A device torch cannot use is refused here, in one
    line, before any work starts (InputError)."""
    import torch

    from fadrm_ray.errors import InputError

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise InputError(f"device {device!r} is not a device: use cpu or cuda (cuda:N for one GPU)") from None
    if kind not in ("cpu", "cuda"):
        raise InputError(f"device {device!r}: fadrm runs on cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r}: torch sees no CUDA device here (torch {torch.__version__}); use cpu")
    return str(device)


# --------------------------------------------------------------------------- OpenMP and heavy processes
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _opted_out(name: str, environ) -> bool:
    return environ.get(name, "").strip() not in ("", "0")


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def heavy_process_env(threads: int | None = None, environ=None) -> dict[str, str]:
    """The variables a heavy process (squeeze, distill, evaluate, a Ray worker, a Tune trial, a
    service job) must start with, less those `environ` (default: none) already sets: the passive
    OpenMP wait policy, `threads` OpenMP threads (default: the CPUs available here) and
    `ALLOCATOR_ENV`. FADRM_DEFAULT_OMP=1 and FADRM_DEFAULT_MALLOC=1 in this process's
    environment leave OpenMP's and glibc's defaults."""
    environ = {} if environ is None else environ
    wanted: dict[str, str] = {}
    if not _opted_out("FADRM_DEFAULT_OMP", os.environ):
        wanted.update(OPENMP_ENV)
        wanted["OMP_NUM_THREADS"] = str(max(1, int(threads or available_cpus())))
    if not _opted_out("FADRM_DEFAULT_MALLOC", os.environ) and not any(k in environ for k in ALLOCATOR_ENV):
        wanted.update(ALLOCATOR_ENV)
    return {k: v for k, v in wanted.items() if k not in environ}


def ensure_process_env() -> None:
    """Re-execute this program with `heavy_process_env` added to its environment, if anything is
    missing and torch (with libgomp) is not loaded yet; the `fadrm` command calls it first.
    Variables the user set are kept, so after the re-execution nothing is missing."""
    missing = heavy_process_env(environ=os.environ)
    if not missing or "torch" in sys.modules or not getattr(sys, "orig_argv", None):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, **missing})


def proc_stat(pid: int | str) -> tuple[str, int, str] | None:
    """(state, parent pid, start time in clock ticks since boot) of process `pid`, from /proc
    (Linux); None when it is gone. The start time tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # fields after the command name, which is in parentheses and may hold spaces
            fields = f.read().decode(errors="replace").rpartition(")")[2].split()
    except OSError:
        return None
    return (fields[0], int(fields[1]), fields[19]) if len(fields) > 19 else None


def process_info() -> dict:
    """What this process runs with: pid, torch threads, CPUs available, and the OpenMP settings
    it started with (read from /proc/self/environ: what libgomp saw, not later changes)."""
    import torch

    started = {}
    try:
        for item in Path("/proc/self/environ").read_bytes().split(b"\0"):
            key, _, value = item.decode(errors="replace").partition("=")
            if key in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
                started[key] = value
    except OSError:
        started = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(), "cpus": available_cpus(),
            "omp_wait_policy": started.get("OMP_WAIT_POLICY"), "omp_num_threads": started.get("OMP_NUM_THREADS")}
