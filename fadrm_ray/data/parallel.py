"""Decoding on several threads: one shared pool per process, and prefetch for loops over batches.

Reading a file, Pillow's decoders and torch's resize release the GIL, so threads of one process
decode images side by side. `parallel_map` is what the file-backed splits (ImageFolder,
Parquet) load through: the items of one request are handed out one at a time to up to
`decode_workers()` threads (the calling thread among them), and the results come back in
request order, equal to those of a plain loop. `prefetch` serves a consumer that loops over
batches: batch i + 1 loads on a background thread while the consumer works on batch i.

The pool is created on first use, grows when a request asks for more threads than it has, and
is forgotten in a forked child (its threads do not exist there).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from .base import DatasetError

WORKERS_ENV = "FADRM_DECODE_WORKERS"
# Requests this small are decoded in the calling thread: handing them to the pool costs more
# than it saves.
SERIAL_BELOW = 3

T = TypeVar("T")
R = TypeVar("R")
C = TypeVar("C")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def decode_workers() -> int:
    """Threads one request decodes on: FADRM_DECODE_WORKERS when set, else the CPUs this process
    may use (affinity mask, cgroup quota), at most torch's thread count (a Ray actor sets that to
    its CPU share, `--threads` to what was asked)."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise DatasetError(f"{WORKERS_ENV} must be a positive integer, got {raw!r}")
        return count
    import torch

    from ..runtime import available_cpus

    return max(1, min(available_cpus(), torch.get_num_threads()))


def _shared_pool(threads: int) -> ThreadPoolExecutor:
    """The process's decode pool, with room for at least `threads` threads (started on demand)."""
    global _pool, _pool_threads
    with _lock:
        if _pool is None or _pool_threads < threads:
            old = _pool
            _pool, _pool_threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fadrm-decode"), threads
            if old is not None:
                old.shutdown(wait=False)  # its running tasks finish; new ones go to the larger pool
        return _pool


def _forget_pool() -> None:
    global _lock, _pool, _pool_threads
    _lock, _pool, _pool_threads = threading.Lock(), None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def parallel_map(fn: Callable[[T], R], items: Sequence[T], workers: int | None = None) -> list[R]:
    """`[fn(x) for x in items]` on up to `workers` threads (default `decode_workers()`), in order.

    Items are handed out in order, one at a time, so a slow item holds up one thread only. When
    `fn` fails, no further item is started and the error of the first failing item in order is
    raised: the one the plain loop would raise.
    """
    n = len(items)
    workers = min(n, workers or decode_workers()) if n >= SERIAL_BELOW else 1
    if workers <= 1:
        return [fn(x) for x in items]
    results: list = [None] * n
    errors: dict[int, Exception] = {}
    take = threading.Lock()
    state = {"next": 0, "stop": False}

    def drain() -> None:
        while True:
            with take:
                j = state["next"]
                if state["stop"] or j >= n:
                    return
                state["next"] = j + 1
            try:
                results[j] = fn(items[j])
            except Exception as exc:  # every item before j was handed out, so the first error is kept
                with take:
                    errors[j] = exc
                    state["stop"] = True
                return

    futures = [_shared_pool(workers - 1).submit(drain) for _ in range(workers - 1)]
    try:
        drain()
    except BaseException:  # KeyboardInterrupt and the like, in the calling thread: stop the others
        with take:
            state["stop"] = True
        raise
    finally:
        for future in futures:
            if not future.cancel():  # one not yet started has nothing left to do
                future.result()
    if errors:
        raise errors[min(errors)]
    return results


def prefetch(load: Callable[[C], R], chunks: Iterable[C]) -> Iterator[tuple[C, R]]:
    """`(chunk, load(chunk))` for each chunk, in order, while the next chunk loads on a
    background thread: decoding batch i + 1 overlaps the caller's work on batch i.

    The batches are those of `[load(c) for c in chunks]`; an error of a load is raised where its
    batch would have been yielded. At most two batches are held at a time.
    """
    chunks = list(chunks)
    if len(chunks) < 2:
        for chunk in chunks:
            yield chunk, load(chunk)
        return
    runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fadrm-prefetch")
    pending = runner.submit(load, chunks[0])
    try:
        for i, chunk in enumerate(chunks):
            batch = pending.result()
            pending = runner.submit(load, chunks[i + 1]) if i + 1 < len(chunks) else None
            yield chunk, batch
    finally:
        if pending is not None:
            pending.cancel()
        runner.shutdown(wait=False)

