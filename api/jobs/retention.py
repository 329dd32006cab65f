"""How long finished jobs stay, and why a download never races their removal (`Retention`).

A job's record, its folder (`STATE/jobs/<id>/`: plan, log, outcome, the files built for its
downloads) and its build lock go together. A download holds its job (`held`) from before it
reads the record until it has opened the file it serves; the sweep decides what to remove and
removes the records under the same lock, sparing every job held, so a download either finds no
record (404) or keeps its job until its file is open (and an open file is served whole whatever
happens to its name). Build locks are made only while their job is held and go with its record,
so none comes back for a removed job.

The sweep (`sweep`, by the scheduler every min(60 s, retention / 4), and by a submit that takes
the records past the cap) removes finished jobs past FADRM_JOB_RETENTION, then the oldest
finished ones past FADRM_MAX_JOB_RECORDS, record first, then folder. The first sweep runs as the
service starts, and it removes any job folder that has no record (left by a service killed
between the two, or by an earlier version): the disk holds no more folders than there are
records. Only a crash leaves such a folder, so that walk of the job folders is done again by a
sweep at most every FADRM_ORPHAN_INTERVAL (an hour), not by every sweep.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from api.jobs.job_records import JobDB

log = logging.getLogger("fadrm.api")
_JOB_FOLDER = re.compile(r"job-[0-9a-f]{24}")


@dataclass(frozen=True)
class RetentionPolicy:
    """How long finished jobs stay: `keep_s` seconds after they finished (FADRM_JOB_RETENTION), at
    most `max_records` records (FADRM_MAX_JOB_RECORDS), and the walk for folders without a record
    at most every `orphan_interval_s` seconds (FADRM_ORPHAN_INTERVAL; 0: every sweep)."""

    keep_s: float
    max_records: int
    orphan_interval_s: float


class Retention:
    """The holds of downloads on their jobs, the jobs' build locks, and the sweep (module docstring)."""

    def __init__(self, db: JobDB, policy: RetentionPolicy, spared: Callable[[], set[str]],
                 on_gone: Callable[[list[str]], None] = lambda ids: None):
        self.db, self.policy, self.spared, self.on_gone = db, policy, spared, on_gone
        self._lock = threading.Lock()  # the holds, the build locks, and the sweep's removal of records
        self._held: dict[str, int] = {}
        self._build_locks: dict[str, threading.Lock] = {}
        self._sweeping = threading.Lock()  # one sweep at a time (the scheduler's, a submit's)
        self._orphans_due: float | None = None  # monotonic time of the next walk for orphans; None: the first sweep

    @property
    def jobs_dir(self):
        return self.db.jobs_dir

    @contextlib.contextmanager
    def held(self, job_id: str) -> Iterator[None]:
        """Keep job `job_id`'s record and folder while the block runs (read the record inside it)."""
        with self._lock:
            self._held[job_id] = self._held.get(job_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._held.pop(job_id) - 1
                if left:
                    self._held[job_id] = left

    def build_lock(self, job_id: str) -> threading.Lock:
        """The lock of one writer of the job's files; only while the job is held."""
        with self._lock:
            if job_id not in self._held:
                raise RuntimeError(f"job {job_id} is not held")
            return self._build_locks.setdefault(job_id, threading.Lock())

    def sweep(self) -> int:
        """Remove what is past retention or the cap, then, at the first sweep and when
        `orphan_interval_s` has passed since the last look, the folders without a record; how many
        records went."""
        with self._sweeping:
            with self._lock:
                spare = set(self.spared()) | set(self._held)
                gone = self.db.expired(time.time() - self.policy.keep_s, self.policy.max_records, spare)
                if gone:
                    self.db.delete(gone)
                    for job_id in gone:
                        self._build_locks.pop(job_id, None)
            for job_id in gone:
                shutil.rmtree(self.jobs_dir / job_id, ignore_errors=True)
            if gone:
                self.on_gone(gone)
                log.info("removed %d finished job record(s) past retention or the record cap", len(gone))
            now = time.monotonic()
            if self._orphans_due is None or now >= self._orphans_due:
                self._orphans_due = now + self.policy.orphan_interval_s
                self.remove_orphans()
        return len(gone)

    def remove_orphans(self) -> int:
        """Remove the job folders that have no record. The folders are listed before the records
        are read: a job's record is written before its folder is made, so a folder listed whose
        record is not found has none."""
        try:
            names = [e.name for e in os.scandir(self.jobs_dir)
                     if _JOB_FOLDER.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return 0
        known = self.db.known(names)
        orphans = [name for name in names if name not in known]
        for name in orphans:
            shutil.rmtree(self.jobs_dir / name, ignore_errors=True)
        if orphans:
            log.info("removed %d job folder(s) without a record", len(orphans))
        return len(orphans)
