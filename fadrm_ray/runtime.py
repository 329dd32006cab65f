"""How and where work runs, as opposed to what it computes (settings.py): the execution spec of
a run, the torch thread count of a phase, and the process-wide glibc allocator settings that
make CPU work fast.

`ExecutionSpec` gathers the runtime choices of `fadrm distill` and `fadrm demo` (in this process
or on Ray, workers and their resources, device, threads, data location, progress bars). It is
built once from the command line and handed to whichever function runs the distillation, so
the Ray layer never sees the argument parser.

glibc's default malloc hands the many mid-sized tensors of a conv net back to the kernel and
asks for them again every step, which can nearly double the time of a CPU run (README.md,
Execution; bench/recover_speed.py --ladder measures it). glibc reads
them from `ALLOCATOR_ENV` when a process starts, which is how Ray workers get them
(`runtime_env.env_vars`); a process that is already running gets the same values through
`mallopt`, which `tune_allocator` calls. Every heavy entry point (squeeze, distill, evaluate,
the Ray worker) calls it, so a user importing the library gets the fast path too.
"""
from __future__ import annotations

import ctypes
import os
import platform
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutionSpec:
    local: bool = False                  # in this process, without Ray
    address: str | None = None           # Ray cluster to join; None = an embedded local Ray
    workers: int | None = None           # distill actors; None = one per GPU, else per cpus_per_worker CPUs
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None  # GPU share per actor (fractions allowed); None = 1 when GPUs exist
    device: str | None = None            # cpu or cuda for --local; None = cuda when available
    threads: int | None = None           # torch threads of this process (--local)
    data_root: str | None = None         # where downloadable datasets live
    progress: bool = True


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
