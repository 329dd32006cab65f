"""One writer per run: a lock file naming its owner, safe on a shared file system.

Two commands that distill the same run (the same config, data and teachers) would otherwise
both compute every unit. The result would still be right, since units are deterministic and
written atomically, but the work would be doubled; with the REST service and sweeps writing to
one store, that is the normal case. So a writer holds `RunLayout.lock` while it writes, and a
second writer of the same run waits for it, then finds the finished units in the store and
skips them. Readers never look at the lock.

The lock is a file created under its final name with `os.link`, which fails if the name exists,
is atomic on local file systems and on NFS, and never shows a half-written file. It records the
owner's pid, host and process start time. While held, a thread touches it every few seconds
(the heartbeat). A lock is stale, and is broken, when its owner is on this host and no longer
runs (checked at once, pid reuse included), or when its heartbeat has stopped for
`stale_after_s` as measured on the waiter's own clock (other hosts; clocks need not agree).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Callable

from fadrm_ray.layout import RunLayout
from fadrm_ray.store.records import StoreError, utc_now

HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0  # a dozen missed heartbeats: a stalled NFS client, not a slow one
_POLL_S = 0.5


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), to tell a reused pid apart."""
    from fadrm_ray.runtime import proc_stat

    stat = proc_stat(pid)
    return None if stat is None else stat[2]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    now = _start_time(pid)
    return started is None or now is None or now == started


def read_owner(layout: RunLayout) -> dict | None:
    """Who holds the run's writer lock ({pid, host, since, ...}), or None if nobody does."""
    try:
        data = json.loads(layout.lock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def live_owner(layout: RunLayout) -> dict | None:
    """Who holds the run's writer lock, when it is held by a process that runs: one of this host
    that is alive (pid reuse included), or one of another host (whose liveness only its
    heartbeat tells); None when no one holds it or its owner here has died."""
    owner = read_owner(layout)
    if owner is None:
        return None
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        return owner if _alive(owner["pid"], owner.get("started")) else None
    return owner


def describe(owner: dict) -> str:
    return f"pid {owner.get('pid')} on {owner.get('host')} (since {owner.get('since')})"


def waiting_notice(layout: RunLayout) -> Callable[[dict], None]:
    """An `on_wait` that says on stderr, once, whom a writer is waiting for."""
    def notice(owner: dict) -> None:
        print(f"fadrm: {layout.run_dir} is being written by {describe(owner)}; waiting for it to finish",
              file=sys.stderr)
    return notice


class RunLock:
    """The writer lock of one run; use as ``with RunLock(layout).held(): ...``."""

    def __init__(self, layout: RunLayout, *, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S):
        self.layout = layout
        self.path = layout.lock
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.token: str | None = None
        self.lost = False  # set by the heartbeat if another process broke this lock
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._watched: dict[str, tuple[int, float]] = {}  # token -> (mtime seen, when first seen)

    def __repr__(self) -> str:
        return f"RunLock({str(self.path)!r})"

    @contextlib.contextmanager
    def held(self, timeout: float | None = None, on_wait: Callable[[dict], None] | None = None):
        self.acquire(timeout, on_wait if on_wait is not None else waiting_notice(self.layout))
        try:
            yield self
        finally:
            self.release()

    # ------------------------------------------------------------------ taking it
    def acquire(self, timeout: float | None = None, on_wait: Callable[[dict], None] | None = None) -> None:
        """Take the lock, waiting while a live writer holds it and breaking it when stale.
        `on_wait(owner)` is called once when the wait begins; StoreError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        told = False
        while True:
            if self._try_create():
                self._beat = threading.Thread(target=self._heartbeat, name="fadrm-run-lock", daemon=True)
                self._beat.start()
                return
            owner = read_owner(self.layout)
            if owner is None:
                if not self.path.exists():  # released between our attempt and the read: try again
                    continue
                owner = {"token": None}  # unreadable (damaged, hand-made): judged by its age alone
            if self._stale(owner):
                self._break(owner)
                continue
            if not told and on_wait is not None:
                on_wait(owner)
                told = True
            if deadline is not None and time.monotonic() > deadline:
                raise StoreError(f"{self.layout.run_dir} is being written by {describe(owner)}; gave up waiting")
            time.sleep(_POLL_S)

    def _try_create(self) -> bool:
        token = uuid.uuid4().hex
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()),
                 "token": token, "since": utc_now(), "command": " ".join(sys.argv)[:300]}
        tmp = self.path.with_name(f".{self.path.name}.{token}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(owner), encoding="utf-8")
            os.link(tmp, self.path)
        except (FileExistsError, FileNotFoundError):  # held, or the run folder was just removed
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self.token = token
        self.lost = False
        self._stop.clear()
        return True

    def _stale(self, owner: dict) -> bool:
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
            return not _alive(owner["pid"], owner.get("started"))
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        token = str(owner.get("token"))
        seen = self._watched.get(token)
        now = time.monotonic()
        if seen is None or seen[0] != mtime:  # first sight, or a heartbeat since
            self._watched[token] = (mtime, now)
            return False
        return now - seen[1] > self.stale_after_s

    def _break(self, owner: dict) -> None:
        """Remove a stale lock, and only the one judged stale: it is renamed aside (one process
        wins a rename) and put back if a new owner had taken its place in the meantime."""
        aside = self.path.with_name(f".{self.path.name}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            taken = json.loads(aside.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            taken = {}
        if taken.get("token") != owner.get("token"):
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        aside.unlink(missing_ok=True)

    # ------------------------------------------------------------------ holding it
    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            owner = read_owner(self.layout)
            if owner is None or owner.get("token") != self.token:
                # Broken by a waiter that took this process for dead: the run stays correct
                # (units are deterministic and atomic), but work may now be done twice.
                self.lost = True
                print(f"fadrm: lost the writer lock of {self.layout.run_dir} (heartbeat too late); "
                      "another process may now write the same units", file=sys.stderr)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        owner = read_owner(self.layout)
        if owner is not None and owner.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        self.token = None
