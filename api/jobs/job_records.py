"""Job records: one SQLite database beside the store (`STORE/.fadrm-api/jobs.sqlite`).

A record holds what was asked (the plan the driver runs), its state, and the driver process that
runs it (pid and start time, so a reused pid is never taken for it). Records outlive the HTTP
process: a restarted service lists every job with its state and picks up the drivers still
running. A record whose plan this version cannot read (stored by an earlier version in a shape
`JobPlan` does not map) is still a job: `entry` and `page_entries` give it as an `UnreadableJob`
to show, and the service settles it when it was queued or running. Each job also has a folder
(`api.jobs.job_files.JobFiles`) for what its driver and the service write: the plan, the driver's
log and outcome, the dataset file, the preview. The database and every file there are the
service's user's alone (mode 0600).
"""
from __future__ import annotations

import json
import os
import secrets
import queue
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from pydantic import ValidationError

from api.jobs.job_files import JobFiles
from api.jobs.private_files import PRIVATE
from api.planning.requests import JobPlan

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    fingerprint TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    state TEXT NOT NULL,
    reused INTEGER NOT NULL DEFAULT 0,
    plan TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    pid INTEGER,
    pid_start TEXT,
    error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_fingerprint ON jobs (fingerprint, state);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, seq);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished_at);
"""
FINISHED = ("succeeded", "failed", "cancelled")
_COLUMNS = ("seq", "id", "fingerprint", "idempotency_key", "state", "reused", "plan", "created_at", "started_at",
            "finished_at", "pid", "pid_start", "error")


@dataclass
class _Columns:
    """The columns every stored job record has, whatever its plan."""

    seq: int
    id: str
    fingerprint: str
    idempotency_key: str | None
    state: str
    reused: bool
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    pid: int | None = None
    pid_start: str | None = None
    error: str | None = None

    @staticmethod
    def values(row: tuple) -> dict:
        """A row of the table by column name, `reused` as the bool it stands for."""
        values = dict(zip(_COLUMNS, row))
        values["reused"] = bool(values["reused"])
        return values


@dataclass
class JobRecord(_Columns):
    plan: JobPlan = field(kw_only=True)

    @classmethod
    def from_row(cls, row: tuple) -> "JobRecord":
        values = cls.values(row)
        values["plan"] = JobPlan.model_validate_json(values["plan"])
        return cls(**values)


@dataclass
class UnreadableJob(_Columns):
    """A job record whose plan this version cannot read (nor map from a shape it knows): shown
    from what can be read of it (`asked`), never run. `why` says what failed to validate."""

    plan: str = field(kw_only=True)  # the stored text, as it is
    why: str = field(kw_only=True, default="")

    @classmethod
    def from_row(cls, row: tuple, why: str) -> "UnreadableJob":
        return cls(**cls.values(row), why=why)

    def asked(self) -> dict:
        """What can be read of the stored plan, as JSON values: top-level fields, and those in
        its job's config, each only where it is a JSON object's value (the caller checks types)."""
        try:
            raw = json.loads(self.plan)
        except ValueError:
            return {}
        if not isinstance(raw, dict):
            return {}
        job = raw.get("job") if isinstance(raw.get("job"), dict) else {}
        config = job.get("config") if isinstance(job.get("config"), dict) else {}
        return {**config, **job, **raw}


POOL_SIZE = 8  # SQLite connections of one service: open files do not grow with threads


class JobDB:
    """The job records, read and written through a pool of at most POOL_SIZE connections (WAL:
    readers never wait for a writer). A thread borrows a connection for one statement or one
    transaction and hands it back, so the open files stay bounded however many threads the
    server's pools start and retire."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "jobs.sqlite"
        # Created 0600 before SQLite opens it: its -wal and -shm files take the database's mode.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE))
        for path in (self.path, self.path.with_name("jobs.sqlite-wal"), self.path.with_name("jobs.sqlite-shm")):
            if path.exists():  # those of an earlier version, made with the umask's mode
                os.chmod(path, PRIVATE)
        self._idle: queue.LifoQueue[sqlite3.Connection] = queue.LifoQueue()
        self._opened = 0
        self._open_lock = threading.Lock()
        self._closed = False
        with self._connection() as conn:
            conn.executescript(_SCHEMA)

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        """A connection of the pool for the block (one opened while fewer than POOL_SIZE are)."""
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            with self._open_lock:
                opening = self._opened < POOL_SIZE
                self._opened += opening
            conn = self._open() if opening else self._idle.get(timeout=60)
        try:
            yield conn
        finally:
            if self._closed:
                conn.close()
            else:
                self._idle.put(conn)

    def _execute(self, sql: str, args: tuple | list = ()) -> list[tuple]:
        """The rows of one statement, fetched before its connection goes back to the pool."""
        with self._connection() as conn:
            return conn.execute(sql, args).fetchall()

    def _changed(self, sql: str, args: tuple | list = ()) -> int:
        with self._connection() as conn:
            return conn.execute(sql, args).rowcount

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                break

    @property
    def jobs_dir(self) -> Path:
        """The jobs' folders (`files`): STATE/jobs/."""
        return self.state_dir / "jobs"

    def files(self, job_id: str) -> JobFiles:
        return JobFiles(self.jobs_dir / job_id)

    def _entries(self, sql: str, args: tuple = ()) -> list[JobRecord | UnreadableJob]:
        rows = self._execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs {sql}", args)
        records: list[JobRecord | UnreadableJob] = []
        for row in rows:
            try:
                records.append(JobRecord.from_row(row))
            except ValueError as exc:  # ValidationError included: a plan this version cannot read
                records.append(UnreadableJob.from_row(row, _why(exc)))
        return records

    def _query(self, sql: str, args: tuple = ()) -> list[JobRecord]:
        """The records of `sql` this version can run (each with its plan)."""
        return [r for r in self._entries(sql, args) if isinstance(r, JobRecord)]

    def entry(self, job_id: str) -> JobRecord | UnreadableJob | None:
        """The job, readable or not (what GET answers); None when there is no such record."""
        found = self._entries("WHERE id = ?", (job_id,))
        return found[0] if found else None

    def unreadable(self, *states: str) -> list[UnreadableJob]:
        marks = ", ".join("?" * len(states))
        return [r for r in self._entries(f"WHERE state IN ({marks}) ORDER BY seq", states)
                if isinstance(r, UnreadableJob)]

    def get(self, job_id: str) -> JobRecord | None:
        found = self._query("WHERE id = ?", (job_id,))
        return found[0] if found else None

    def by_key(self, key: str) -> JobRecord | UnreadableJob | None:
        """The job an Idempotency-Key names, readable or not (the key is its while it is kept)."""
        found = self._entries("WHERE idempotency_key = ?", (key,))
        return found[0] if found else None

    def live_with(self, fingerprint: str) -> JobRecord | None:
        """The newest job of the same request that has not failed or been cancelled."""
        found = self._query("WHERE fingerprint = ? AND state IN ('queued', 'running', 'succeeded') "
                            "ORDER BY seq DESC LIMIT 1", (fingerprint,))
        return found[0] if found else None

    def in_state(self, *states: str) -> list[JobRecord]:
        marks = ", ".join("?" * len(states))
        return self._query(f"WHERE state IN ({marks}) ORDER BY seq", states)

    def count(self, state: str | None = None) -> int:
        if state is None:
            return self._execute("SELECT COUNT(*) FROM jobs")[0][0]
        return self._execute("SELECT COUNT(*) FROM jobs WHERE state = ?", (state,))[0][0]

    def expired(self, finished_before: float, keep: int, spare: set[str] = frozenset()) -> list[str]:
        """Ids of the finished jobs to remove: those that finished before `finished_before`, then
        the oldest finished ones while more than `keep` records would stay. Jobs in `spare` (not
        tidied yet) stay; queued and running jobs always do."""
        marks = ", ".join("?" * len(FINISHED))
        old = [row[0] for row in self._execute(
            f"SELECT id FROM jobs WHERE state IN ({marks}) AND finished_at < ? ORDER BY seq",
            (*FINISHED, finished_before))]
        old = [job_id for job_id in old if job_id not in spare]
        over = self.count() - len(old) - keep
        if over > 0:
            newer = [row[0] for row in self._execute(
                f"SELECT id FROM jobs WHERE state IN ({marks}) AND finished_at >= ? ORDER BY seq LIMIT ?",
                (*FINISHED, finished_before, over + len(spare)))]
            old += [job_id for job_id in newer if job_id not in spare][:over]
        return old

    def known(self, job_ids: list[str]) -> set[str]:
        """Those of `job_ids` that have a record."""
        found: set[str] = set()
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start:start + 500]
            found |= {row[0] for row in self._execute(
                f"SELECT id FROM jobs WHERE id IN ({', '.join('?' * len(chunk))})", chunk)}
        return found

    def delete(self, job_ids: list[str]) -> int:
        """Remove the records of these jobs while they are finished; how many went."""
        gone, marks = 0, ", ".join("?" * len(FINISHED))
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start:start + 500]
            gone += self._changed(
                f"DELETE FROM jobs WHERE id IN ({', '.join('?' * len(chunk))}) AND state IN ({marks})",
                (*chunk, *FINISHED))
        return gone

    def page(self, state: str | None, limit: int, before: int | None) -> list[JobRecord]:
        """A page of the records this version can run (`page_entries`: every record)."""
        return [r for r in self.page_entries(state, limit, before) if isinstance(r, JobRecord)]

    def page_entries(self, state: str | None, limit: int, before: int | None) -> list[JobRecord | UnreadableJob]:
        """A page of the listing, newest first: every record, readable or not."""
        where, args = [], []
        if state:
            where.append("state = ?")
            args.append(state)
        if before is not None:
            where.append("seq < ?")
            args.append(before)
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        return self._entries(f"{clause}ORDER BY seq DESC LIMIT ?", (*args, limit))

    def create(self, fingerprint: str, plan: JobPlan, state: str, *, key: str | None = None,
               reused: bool = False, max_queued: int | None = None) -> JobRecord | None:
        """A new job; None when `max_queued` jobs already wait (the caller answers 429). A job
        created already `succeeded` (its images were in the store) is finished at once."""
        job_id = f"job-{secrets.token_hex(12)}"
        now = time.time()
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if max_queued is not None and state == "queued":
                    waiting = conn.execute("SELECT COUNT(*) FROM jobs WHERE state = 'queued'").fetchone()[0]
                    if waiting >= max_queued:
                        conn.execute("ROLLBACK")
                        return None
                finished = now if state in ("succeeded", "failed", "cancelled") else None
                conn.execute(
                    "INSERT INTO jobs (id, fingerprint, idempotency_key, state, reused, plan, created_at, "
                    "started_at, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, fingerprint, key, state, int(reused), plan.model_dump_json(), now, finished, finished))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # a COMMIT that failed (a full disk) has rolled back already
                    conn.execute("ROLLBACK")
                raise
        return self.get(job_id)

    def update(self, job_id: str, *, only_from: tuple[str, ...] | None = None, **values) -> bool:
        """Set columns of a job; with `only_from`, only while its state is one of those (a
        transition that lost a race with another does nothing). True when the row changed."""
        sets = ", ".join(f"{k} = ?" for k in values)
        args: list = list(values.values()) + [job_id]
        sql = f"UPDATE jobs SET {sets} WHERE id = ?"
        if only_from:
            sql += f" AND state IN ({', '.join('?' * len(only_from))})"
            args += list(only_from)
        return self._changed(sql, args) == 1


def _why(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(part) for part in first.get("loc", ())) or "plan"
        return f"{where}: {first.get('msg', 'not valid')} ({len(errors)} error{'s' if len(errors) != 1 else ''})"
    return f"not JSON: {exc}"
