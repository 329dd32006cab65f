"""The service's errors, in one place: what it answers when a request cannot be served, and how
any error is told to a client, in one line with nothing internal.

The answers, each an exception the app maps to its status (api.web.app): `RequestInvalid` (422:
a request refused, naming the field), `Conflict` (409: the job is not in the state the request
needs), `RunRefused` (409: the job's run in the store cannot be served as it is) and
`Unavailable` (503 with Retry-After: the service cannot answer now, but will).

How an error is told (`job_error`, `clean_line`, `scrub`): Ray wraps what a task raised in
RayTaskError (its text: the coloured `ray::Actor.method()` name, the worker's pid, IP and actor
id, then the remote traceback), and the worker pool (`actors.pool`) wraps that again. A client
needs the exception at the bottom of that chain, not the wrappers, and must not see the
cluster's addresses, pids or ids, nor the server's paths (a path is cut to its last part); the
whole trace stays in the job's driver.log for the operator.

What the service answers when its store fails it (`refusal`): one line, no path, never a 500. A
download reads a job's run and writes the file it serves beside the job record; a submit writes
a record. Each of those can meet a store that is not what it should be, and each case has its
answer:

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
import re
import sqlite3

import pyarrow as pa

from fadrm_ray.evaluation.verify_files import SoftLabelDamaged
from fadrm_ray.store.records import IntegrityError, RunIncomplete, StoreError

RETRY_S = 5  # what a 503 of the store tells a client to wait
MIN_FREE_BYTES = 1 << 20  # a submit needs at least this much free in the store
_OS_WORDS = {errno.ENOSPC: "the service's store is full (no space left on its disk)",
             errno.EDQUOT: "the service's store is over its disk quota",
             errno.EROFS: "the service's store is read-only",
             errno.EIO: "the service's store failed to read or write (an I/O error)"}
_SQLITE_WORDS = {"disk is full": errno.ENOSPC, "readonly database": errno.EROFS, "disk i/o error": errno.EIO}
MAX_CHARS = 500  # of a line told to a client

_ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|[@-Z\\-_])")
_RAY_NAME = re.compile(r"ray::[\w.]+(\(\))?")
_REPR = re.compile(r"\brepr=<[^>]*>")
# pid=12, ip=10.0.0.1, actor_id=ab12... in Ray's parentheses; `pid: 12` in its multi-line texts.
_KEYED = re.compile(r"\b(pid|ip|node_ip|node_id|actor_id|worker_id|task_id|raylet_id)\s*[=:]\s*[^\s,)]+,?")
_ADDRESS = re.compile(r"\[?(::ffff:)?\b\d{1,3}(\.\d{1,3}){3}\b\]?(:\d+)?")
_LONG_HEX = re.compile(r"\b[0-9a-fA-F]{24,}\b")  # actor, node, task and worker ids
_OBJECT_AT = re.compile(r"\s*(object )?at 0x[0-9a-fA-F]+")
_EMPTY_PARENS = re.compile(r"\(\s*[,;\s]*\)")
# An absolute path of two parts or more (/srv/store/run-1/manifest.json), not a URL's.
_PATH = re.compile(r"(?<![\w:/.~-])(/[\w.+~-]+){2,}/?")


# --------------------------------------------------------------------------- the answers
class RequestInvalid(ValueError):
    """422: a request the service refuses: `field` is where, the message says what, in one line
    without the server's paths (`scrub`), whatever the error it came from held."""

    def __init__(self, field: str | tuple, message: str):
        self.loc = ("body", *((field,) if isinstance(field, str) else field))
        super().__init__(scrub(message))


class Conflict(Exception):
    """409: the job is not in a state the request needs (`state`, the job's); `message` says
    which and why."""

    def __init__(self, state: str, message: str):
        super().__init__(message)
        self.state, self.message = state, message


class Unavailable(Exception):
    """503: the service cannot answer now, but will (`retry_after` seconds); `message` says why."""

    def __init__(self, message: str, retry_after: int = RETRY_S, state: str | None = None):
        super().__init__(message)
        self.message, self.retry_after, self.state = message, retry_after, state


class RunRefused(Exception):
    """409: the job's run in the store cannot be served as it is (`message`, one line)."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.message, self.cause = message, cause


# --------------------------------------------------------------------------- errors told in one line
def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain: through `raise ... from` and Ray's `.cause`."""
    seen = {id(exc)}
    while True:
        inner = getattr(exc, "cause", None)  # RayTaskError keeps what the task raised here
        if not isinstance(inner, BaseException):
            inner = exc.__cause__
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def scrub(text: str) -> str:
    """One line without colour codes, addresses, pids, Ray ids or server paths."""
    text = _ANSI.sub("", text)
    text = _RAY_NAME.sub("", text)
    text = _REPR.sub("", text)
    text = _KEYED.sub("", text)
    text = _ADDRESS.sub("<address>", text)
    text = _LONG_HEX.sub("<id>", text)
    text = _OBJECT_AT.sub("", text)
    text = _PATH.sub(lambda m: ".../" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)
    text = _EMPTY_PARENS.sub("", text)
    return " ".join(text.split()).strip(" ;,:")


def _message(exc: BaseException) -> str:
    text = str(exc)
    if "Traceback (most recent call last)" in text:  # a remote traceback as text: its last line says what
        lines = [line for line in text.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return scrub(text)


def _type_name(exc: BaseException) -> str:
    name = type(exc).__name__
    # Ray's dual-typed wrapper is named `RayTaskError(FileExistsError)`: the cause's own name.
    return name[name.index("(") + 1:-1] if name.startswith("RayTaskError(") and name.endswith(")") else name


def job_error(exc: BaseException, limit: int = MAX_CHARS) -> str:
    """`Cause: message (what failed)`, at most `limit` characters."""
    cause = root_cause(exc)
    text = f"{_type_name(cause)}: {_message(cause)}".rstrip(" :")
    if cause is not exc:
        # The outermost exception says what was being done; its first clause is enough, and
        # whatever it quotes of the cause is said already.
        context = _message(exc).split(";")[0].strip()
        if context and context not in text:
            text += f" ({context})"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def clean_line(text: str, limit: int = MAX_CHARS) -> str:
    """A message that is already text (an outcome file's), held to the same rules."""
    text = scrub(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


# --------------------------------------------------------------------------- the store's failures
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


# What a check of the run's files found (a recorded digest or manifest that differs, a run not
# finished): kept in the job's record until its files are read again; any other 409 is only answered.
VERIFIED_DAMAGE = (StoreError, SoftLabelDamaged)


def refusal(exc: BaseException, job_id: str, run_id: str, state: str) -> RunRefused | Unavailable | None:
    """The answer (`RunRefused`, a 409, or `Unavailable`, a 503) to a store error met while serving
    job `job_id`, or None for an error that is no store's (it stays a 500)."""
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
        if isinstance(link, pa.ArrowMemoryError):
            return None  # the server's memory, not the run: a 500
        if isinstance(link, pa.ArrowException) or (isinstance(link, OSError) and link.errno in (None, errno.ENOENT)):
            return RunRefused(f"a file of job {job_id}'s run cannot be read ({type(link).__name__}); nothing of it "
                              f"is served; {repair_line(run_id)}", link)
    return None

