"""What the service answers when its store fails it: one line, no path, never a 500.

A download reads a job's run and writes the file it serves beside the job record; a submit writes
a record. Each of those can meet a store that is not what it should be, and each case has its
answer (`refusal`):

- a run whose files fail their manifest's check (changed or damaged since its job succeeded):
  409, and the operator's `fadrm verify --repair` mends it;
- a run being written by another process (`fadrm verify --repair` under way, or a distill of the
  same images): 503 with Retry-After, for it is there again in a moment;
- a run without its manifest that no one writes (a repair that stopped half-way): 409;
- a stored soft-label file that fails its check (`SoftLabelDamaged`: its recorded sha256, or read
  whole), and any file of the run that does not read (a Parquet reader's error, a file gone):
  409 naming the file where it is known and the operator's `fadrm verify --run ... --repair`,
  never a 503 "retry later" that could not succeed;
- any other store error (the run gone, unreadable): 409 with the store's line, paths cut, and
  the same repair named;
- a full disk or quota (ENOSPC, EDQUOT), a read-only file system (EROFS), another I/O error, and
  SQLite's own words for those (the job records): 503 with Retry-After; a submit is refused so
  already when less than MIN_FREE_BYTES are left (`short_of_space`), before it makes a job that
  could not start.

An error is recognized through its whole chain (`__cause__`, `__context__`): a library that fails
while handling ENOSPC (an image writer's cleanup) raises something else, with the OSError inside.
"""
from __future__ import annotations

import errno
import os
import sqlite3

import pyarrow as pa

from fadrm_ray.evaluation.verify_files import SoftLabelDamaged
from fadrm_ray.store.records import IntegrityError, RunIncomplete, StoreError

from api.errors import clean_line

RETRY_S = 5  # what a 503 of the store tells a client to wait
MIN_FREE_BYTES = 1 << 20  # a submit needs at least this much free in the store
_OS_WORDS = {errno.ENOSPC: "the service's store is full (no space left on its disk)",
             errno.EDQUOT: "the service's store is over its disk quota",
             errno.EROFS: "the service's store is read-only",
             errno.EIO: "the service's store failed to read or write (an I/O error)"}
_SQLITE_WORDS = {"disk is full": errno.ENOSPC, "readonly database": errno.EROFS, "disk i/o error": errno.EIO}


class Unavailable(Exception):
    """503: the service cannot answer now, but will (`retry_after` seconds); `message` says why."""

    def __init__(self, message: str, retry_after: int = RETRY_S, state: str | None = None):
        super().__init__(message)
        self.message, self.retry_after, self.state = message, retry_after, state


def _chain(exc: BaseException):
    """`exc` and what it was raised from or while handling, as Python shows a traceback: a
    `raise ... from None` ends the chain."""
    seen = set()
    while exc is not None and id(exc) not in seen and len(seen) < 16:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def store_errno(exc: BaseException) -> int | None:
    """The errno of the OSError (or the SQLite error that means one) in `exc`'s chain, if any."""
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno is not None:
            return link.errno
        if isinstance(link, sqlite3.OperationalError):
            text = str(link).lower()
            for words, number in _SQLITE_WORDS.items():
                if words in text:
                    return number
    return None


def unavailable(exc: BaseException, state: str | None = None) -> Unavailable | None:
    """The 503 of a disk that failed the service (ENOSPC, EDQUOT, EROFS, EIO), else None."""
    number = store_errno(exc)
    if number in _OS_WORDS:
        return Unavailable(f"{_OS_WORDS[number]}; nothing was changed; retry later (the operator frees space "
                           f"or mends the disk)", state=state)
    return None


def short_of_space(folder) -> Unavailable | None:
    """The 503 of a store with less than MIN_FREE_BYTES left to its user (a new job writes its
    record, its plan and its log at once), else None."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        return Unavailable(f"{_OS_WORDS[errno.ENOSPC]}: a new job could not be recorded; retry later (the operator "
                           f"frees space)")
    return None


def integrity_line(job_id: str, run_id: str) -> str:
    return (f"the store files of job {job_id} failed verification (a file's sha256 differs from what its run "
            f"recorded: changed or damaged since it was written); nothing of them is served; the operator mends "
            f"them with `fadrm verify --run STORE/{run_id} --repair`")


def repair_line(run_id: str) -> str:
    return (f"the operator checks it with `fadrm verify --run STORE/{run_id}` and mends it with `fadrm verify --run "
            f"STORE/{run_id} --repair`")


def refusal(exc: BaseException, job_id: str, run_id: str, state: str) -> Exception | None:
    """The answer (a `Conflict`-like (409, line) pair or `Unavailable`) to a store error met while
    serving job `job_id`, or None for an error that is no store's (it stays a 500)."""
    for link in _chain(exc):
        if isinstance(link, IntegrityError):
            return RunRefused(integrity_line(job_id, run_id), link)
        if isinstance(link, SoftLabelDamaged):
            return RunRefused(f"the stored soft labels of job {job_id} are damaged ({link.file} {link.problem}); "
                              f"nothing of them is served; the operator recomputes them from the teacher with `fadrm "
                              f"verify --run STORE/{run_id} --repair`", link)
        if isinstance(link, RunIncomplete):
            if link.writer is not None:
                return Unavailable(f"the store's run of job {job_id} is being written by another process (a "
                                   f"`fadrm verify --repair`, or a distill of the same images); retry in {RETRY_S} s",
                                   state=state)
            return RunRefused(f"the store's run of job {job_id} is incomplete (its manifest is missing and no one is "
                              f"writing it): nothing of it is served; the operator finishes it with `fadrm verify "
                              f"--run STORE/{run_id} --repair`", link)
        if isinstance(link, StoreError):
            return RunRefused(f"the store's run of job {job_id} cannot be read ({clean_line(str(link), 300)}); "
                              f"{repair_line(run_id)}", link)
    if (answer := unavailable(exc, state)) is not None:
        return answer
    for link in _chain(exc):  # a file of the run that does not read, or is gone: no retry mends it
        if isinstance(link, pa.ArrowException) or (isinstance(link, OSError) and link.errno in (None, errno.ENOENT)):
            return RunRefused(f"a file of job {job_id}'s run cannot be read ({type(link).__name__}); nothing of it "
                              f"is served; {repair_line(run_id)}", link)
    return None


class RunRefused(Exception):
    """409: the job's run in the store cannot be served as it is (`message`, one line)."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.message, self.cause = message, cause
