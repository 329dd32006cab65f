"""A failed job's error as the API shows it: the real cause first, one line, nothing internal.

Ray wraps what a task raised in RayTaskError (its text: the coloured `ray::Actor.method()`
name, the worker's pid, IP and actor id, then the remote traceback), and the worker pool
(`actors.pool`) wraps that again. A client needs the exception at the bottom of that chain, not the wrappers, and
must not see the cluster's addresses, pids or ids, nor the server's paths (a path is cut to its
last part); the whole trace stays in the job's driver.log for the operator.
"""
from __future__ import annotations

import re

MAX_CHARS = 500

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
