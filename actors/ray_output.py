"""Ray's and Tune's own lines kept off fadrm's terminal: in a log file under the run or the sweep
(`ray_output`), or left where Ray writes them with `--verbose`. The one mechanism of every door
that starts or joins Ray in this process: `fadrm distill` and `fadrm demo` (actors.coordinator:
the run's `ray.log`), `fadrm tune` (tune.sweep: the sweep's `ray.log`).

What Ray and Tune write to a driver's terminal, and where it goes inside the block:

- the records of the `ray` loggers: `ray.init`'s "Started a local Ray instance." and "Connecting
  to existing Ray cluster at address", Tune's "Wrote the latest version of all result files",
  its resume advice (`Tuner.restore(...)`) and its warnings (a trial without results read as a
  FileNotFoundError, say). Ray gives the `ray` logger a handler of its own, which writes to
  stderr; inside the block the logger writes to the log file instead, without colour codes.
- what Tune prints on stdout (the boxed configuration table, "View detailed results here", the
  `tensorboard --logdir` hint): with `stdout=True`, the block's stdout is the log file too.
  (fadrm's own lines inside the block go to stderr; stdout is for the command's result.)
- the output of the cluster's processes, which Ray forwards to a driver that asks for it: every
  door starts or joins Ray with `log_to_driver=False`, so it stays in the session's own logs.

With `verbose`, nothing is moved: Ray's lines are on the terminal as Ray writes them (Tune's
stdout on stderr, with `stdout=True`).

A block without a file (`log=None`: `fadrm distill` asking a cluster for its GPUs before it knows
its run) keeps Ray's records in memory for its `owner` (the run's ExecutionSpec, by identity:
an equal spec is another run's), and the next block with a file for the same owner writes them
first. Records no block took are dropped with their owner: they never reach another run's log.
A block without `stdout` makes its file only once there is a record to write.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import weakref
from collections import deque
from pathlib import Path
from typing import Iterator

RAY_LOGGER = "ray"
# Ray's own format (ray._private.log), which `ray.init` puts on every handler of the logger.
FORMAT = "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
KEPT_MAX = 1000  # records kept for one owner; the oldest are dropped
# id(owner) -> the records blocks without a file kept for it; an entry leaves with its owner.
_kept: dict[int, deque[logging.LogRecord]] = {}


class _LogFile(logging.FileHandler):
    """Ray's records in the log file (appended; with `delay`, made at the first record), without
    the colour codes Ray puts into some of them."""

    def __init__(self, log: Path, delay: bool):
        super().__init__(log, mode="a", encoding="utf-8", delay=delay)
        self.setFormatter(logging.Formatter(FORMAT))

    def format(self, record: logging.LogRecord) -> str:
        return _ANSI.sub("", super().format(record))


class _Kept(logging.Handler):
    def __init__(self, owner: object):
        super().__init__()
        key = id(owner)
        if key not in _kept:
            _kept[key] = deque(maxlen=KEPT_MAX)
            weakref.finalize(owner, _kept.pop, key, None)
        self.records = _kept[key]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def ray_output(log: Path | None, verbose: bool = False, stdout: bool = False,
               owner: object = None) -> Iterator[None]:
    """Inside the block, Ray's and Tune's lines go to `log` (appended; module docstring), or stay
    on the terminal with `verbose`; with `log` None, they are kept for `owner` (an object that
    can be weakly referenced), whose next block with a file writes them first. The `ray`
    logger's handlers are put back at the end."""
    if log is None and owner is None:
        raise ValueError("ray_output without a log file keeps Ray's records for an owner: give owner")
    if verbose:
        with contextlib.redirect_stdout(sys.stderr) if stdout else contextlib.nullcontext():
            yield
        return
    import ray  # noqa: F401 - Ray puts its handler on the logger as it is first imported

    logger = logging.getLogger(RAY_LOGGER)
    saved = (list(logger.handlers), logger.propagate)
    with contextlib.ExitStack() as stack:
        if log is None:
            handler: logging.Handler = _Kept(owner)
        else:
            log.parent.mkdir(parents=True, exist_ok=True)
            handler = _LogFile(log, delay=not stdout)
            stack.callback(handler.close)
            if stdout:  # one stream for both, line by line: the file keeps their order
                handler.stream.reconfigure(line_buffering=True)
                stack.enter_context(contextlib.redirect_stdout(handler.stream))
            for record in _kept.pop(id(owner), ()) if owner is not None else ():
                handler.handle(record)
        logger.handlers[:] = [handler]
        logger.propagate = False
        try:
            yield
        finally:
            logger.handlers[:] = saved[0]
            logger.propagate = saved[1]
