"""What the endpoints share (`Service`, on `app.state.service`): the catalog, the job records and
the driver supervisor, with the threads that keep them going (the scheduler, with the retention
sweep of `api.jobs.retention`, and the watch of the local Ray head), how a job is reported
(`Service.view`), and how a job's files are served: held against the sweep (`Service.serving`),
built once, and every store error answered in one line (`api.contract.service_errors`).

`Service(settings)` is where the service's settings are read: each part is handed the values it
uses (`Catalog` its folders, `DriverSupervisor` its `DriverSettings`, `Retention` its
`RetentionPolicy`), and the service keeps those its endpoints read (`store`, `limits`, ...).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Iterator

from fastapi import HTTPException
from pydantic import TypeAdapter

from fadrm_ray.fileio import probe_writable

from api.contract.schemas import FINAL_STATES, Job, JobAsked, Ready
from api.contract.service_errors import VERIFIED_DAMAGE, Conflict, Unavailable, clean_line, refusal, scrub
from api.jobs.drivers import DriverSettings, DriverSupervisor
from api.jobs.job_outputs import progress
from api.jobs.job_records import JobDB, JobRecord, UnreadableJob
from api.jobs.retention import Retention, RetentionPolicy
from api.planning.catalog import Catalog, CatalogReader
from api.planning.requests import run_dir
from api.planning.service_settings import ServiceSettings, SettingsError
from api.web.probes import Readiness
from api.web.proxies import trusted_line

log = logging.getLogger("fadrm.api")
TICK_S = 0.5
RAY_WATCH_S = 2.0  # how often the local Ray head is checked (and started again when it is gone)
SWEEP_MAX_S = 60.0  # how often, at most, job records past their retention are removed
FINAL_PROGRESS_KEPT = 4096


class Scheduler(threading.Thread):
    """Runs `drivers.tick` every TICK_S seconds, and `sweep` (retention) every `sweep_every`."""

    def __init__(self, drivers: DriverSupervisor, sweep, sweep_every: float):
        super().__init__(name="fadrm-scheduler", daemon=True)
        self.drivers, self.stopping = drivers, threading.Event()
        self.sweep, self.sweep_every = sweep, sweep_every

    def run(self) -> None:
        next_sweep = 0.0
        while not self.stopping.wait(TICK_S):
            try:
                self.drivers.tick()
            except Exception:  # keep scheduling; the next tick retries
                log.exception("scheduler tick failed")
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + self.sweep_every
                try:
                    self.sweep()
                except Exception:
                    log.exception("removing expired job records failed")


class RayWatch(threading.Thread):
    """Keeps the service's local Ray head up: starts it at once (not at the first job), checks it
    every RAY_WATCH_S seconds and starts it again when it is gone, waiting longer after each
    start that fails (up to a minute) and logging one line for each."""

    def __init__(self, drivers: DriverSupervisor):
        super().__init__(name="fadrm-ray-watch", daemon=True)
        self.drivers, self.stopping = drivers, threading.Event()
        self.error: str | None = None  # why the last start failed, for /readyz

    def run(self) -> None:
        wait = 0.0
        while not self.stopping.wait(wait):
            try:
                if self.drivers.local is None:
                    return
                self.drivers.keep_ray()
                self.error, wait = None, RAY_WATCH_S
            except Exception as exc:
                self.error = clean_line(str(exc), 200)
                log.warning("the local Ray head could not be started: %s", self.error)
                wait = min(60.0, max(RAY_WATCH_S, 2 * wait))


class Service:
    """What the endpoints share: the catalog, the job records, the driver supervisor, and the values
    of the settings they read."""

    def __init__(self, settings: ServiceSettings):
        # What the endpoints read: where the runs go and what one request may ask (planning a
        # submit), the queue and the records' cap, whether teachers are served.
        self.store, self.state_dir, self.device = settings.store, settings.state_dir, settings.device
        self.limits = settings.limits
        self.max_queued, self.max_job_records = settings.max_queued, settings.max_job_records
        self.private_teachers = settings.private_teachers
        self.trusted_proxies = settings.trusted_proxies  # said in the log as the service starts
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._server_lock = open(self.state_dir / "server.lock", "w")
        try:
            fcntl.flock(self._server_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._server_lock.close()
            raise SettingsError(f"another fadrm serve is using the store {settings.store}") from None
        self.catalog = Catalog(settings.teachers, settings.datasets)
        self.db = JobDB(self.state_dir)
        self.drivers = DriverSupervisor(DriverSettings(
            store=settings.store, state_dir=settings.state_dir, ray_address=settings.ray_address,
            ray_cpus=settings.ray_cpus, max_running=settings.max_running, job_seconds=settings.limits.job_seconds,
            heartbeat_timeout=settings.driver_heartbeat_timeout, log_max_bytes=settings.driver_log_max_bytes,
            workers=settings.workers, cpus_per_worker=settings.cpus_per_worker, device=settings.device,
            threads=settings.threads), self.db)
        policy = RetentionPolicy(keep_s=settings.job_retention, max_records=settings.max_job_records,
                                 orphan_interval_s=settings.orphan_interval)
        self.retention = Retention(self.db, policy, spared=lambda: set(self.drivers.ending.copy()),
                                   on_gone=self._forget)
        self.scheduler = Scheduler(self.drivers, self.sweep, max(TICK_S, min(SWEEP_MAX_S, policy.keep_s / 4)))
        self.ray_watch = RayWatch(self.drivers)
        self.catalog_reader = CatalogReader(self.catalog)
        self.readiness = Readiness(self.ready)
        self.submit_lock = threading.Lock()
        # Files built at once, whatever the number of downloads waiting: each build is CPU work in
        # a thread of this process, and more of them than cores only slow each other and the loop.
        self._builds = threading.BoundedSemaphore(min(4, os.cpu_count() or 1))
        # The progress of finished jobs, which never changes (the most recent FINAL_PROGRESS_KEPT).
        self.final_progress: OrderedDict[str, tuple] = OrderedDict()
        self._progress_lock = threading.Lock()

    def start(self) -> None:
        log.info(trusted_line(self.trusted_proxies))
        self.ray_watch.start()
        self.scheduler.start()
        self.catalog_reader.start()
        self.readiness.start()

    def stop(self) -> None:
        log.info("stopping: the scheduler and the Ray watch")
        self.ray_watch.stopping.set()
        self.scheduler.stopping.set()
        self.readiness.stopping.set()
        self.catalog_reader.stopping.set()
        self.scheduler.join(timeout=30)
        self.ray_watch.join(timeout=30)
        for thread in (self.readiness, self.catalog_reader):
            if thread.is_alive():
                thread.join(timeout=10)
        self.drivers.shutdown()
        self.db.close()
        self._server_lock.close()

    def ready(self) -> Ready:
        """What /readyz answers (checked by `readiness` in its thread, never in a request): Ray
        reachable, the store writable, the datasets read; `detail` says what is not."""
        ray_ok, store_ok = self.drivers.ray_reachable(), probe_writable(self.state_dir, write_byte=True) is None
        catalog_ok = self.catalog.read.is_set()
        why = self.ray_watch.error
        details = [] if ray_ok else [f"Ray is not reachable: {why}" if why else "Ray is not reachable (yet)"]
        if not store_ok:
            details.append("the store is not writable")
        if not catalog_ok:
            details.append(f"the datasets are still being read ({', '.join(self.catalog.pending())})")
        return Ready(ready=ray_ok and store_ok and catalog_ok, ray=ray_ok, store=store_ok, catalog=catalog_ok,
                     detail="; ".join(details) or None)

    def view(self, job: JobRecord | UnreadableJob) -> Job:
        if isinstance(job, UnreadableJob):
            return _unreadable_view(job)
        plan = job.plan
        with self._progress_lock:
            kept = self.final_progress.get(job.id)
        if kept is not None:  # a finished job's progress never changes
            prog, eta = kept
        else:
            prog, eta = progress(run_dir(self.store, plan), plan, job.state, job.started_at,
                                 self.db.files(job.id).evaluating)
            if job.state in FINAL_STATES:
                with self._progress_lock:
                    self.final_progress[job.id] = (prog, eta)
                    while len(self.final_progress) > FINAL_PROGRESS_KEPT:
                        self.final_progress.popitem(last=False)
        asked = {name: getattr(plan, name) for name in JobAsked.model_fields}
        return Job(id=job.id, state=job.state, run_id=plan.run_id, **asked, reused=job.reused, progress=prog,
                   timings=_timings(job), eta_seconds=eta, error=job.error, links=_links(job.id))

    def sweep(self) -> int:
        """Remove the finished jobs past FADRM_JOB_RETENTION or FADRM_MAX_JOB_RECORDS, record and
        folder, and folders without a record (api.jobs.retention); never a run in the store, which
        other jobs may share. How many records went."""
        return self.retention.sweep()

    def _forget(self, job_ids: list[str]) -> None:
        with self._progress_lock:
            for job_id in job_ids:
                self.final_progress.pop(job_id, None)

    def entry(self, job_id: str) -> JobRecord | UnreadableJob:
        """The job, readable by this version or not; 404 when there is none."""
        job = self.db.entry(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job

    def job(self, job_id: str) -> JobRecord:
        """The job with its plan; 409 for a record this version cannot read (nothing of it is served)."""
        job = self.entry(job_id)
        if isinstance(job, UnreadableJob):
            raise Conflict(job.state, f"job {job.id}'s record could not be read after an upgrade of the service "
                                      f"({clean_line(job.why, 200)}): it is only listed; submit the request again")
        return job

    def finished(self, job_id: str) -> JobRecord:
        job = self.job(job_id)
        if job.state in ("queued", "running"):
            raise Conflict(job.state, f"job {job.id} is {job.state}: its results are served once it has succeeded")
        if job.state != "succeeded":
            raise Conflict(job.state, f"job {job.id} {job.state}: it has no results; submit the request again for a "
                                      "new job")
        return job

    @contextlib.contextmanager
    def serving(self, job_id: str) -> Iterator[JobRecord]:
        """The succeeded job, held against the retention sweep for the block (open what is served
        inside it), its store errors answered in one line: 409 or 503 (`service_errors.refusal`)."""
        with self.retention.held(job_id):
            job = self.finished(job_id)
            try:
                yield job
            except Exception as exc:
                answer = refusal(exc, job.id, job.plan.run_id, job.state)
                if answer is None:
                    raise
                if isinstance(answer, Unavailable):
                    raise answer from None
                # Damage a check found is said once in the log and kept in the record (until a build
                # reads the files again); a file that failed to read otherwise is answered, not kept.
                if job.error != answer.message and isinstance(answer.cause, VERIFIED_DAMAGE):
                    log.error("job %s: %s (%s)", job.id, answer.message, scrub(str(answer.cause))[:300])
                    self.db.update(job.id, error=answer.message)
                raise Conflict(self.job(job.id).state, answer.message) from None

    def build(self, job: JobRecord, path, writer):
        """A job's file, written once (one writer at a time, and at most as many builds at once as
        cores, up to 4) and then served as it is; inside `serving`. The first build after the job's record kept an error of its store files
        (damaged, then repaired) clears it: the files were read and checked again."""
        with self.retention.build_lock(job.id):
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                with self._builds:
                    writer(run_dir(self.store, job.plan), job.plan, path)
                if job.error is not None:
                    self.db.update(job.id, only_from=("succeeded",), error=None)
        return path


def _timings(job: JobRecord | UnreadableJob) -> dict:
    end = job.finished_at
    return {"created_at": _iso(job.created_at), "started_at": _iso(job.started_at), "finished_at": _iso(end),
            "queued_seconds": _span(job.created_at, job.started_at or end),
            "running_seconds": _span(job.started_at, end) if job.started_at else None}


def _links(job_id: str) -> dict:
    base = f"/v1/distillations/{job_id}"
    return {"self": base, "dataset": f"{base}/dataset", "preview": f"{base}/preview.png", "report": f"{base}/report",
            "teacher": f"{base}/teacher", "recipe": f"{base}/recipe"}


# What a record this version cannot read shows for each field of the request it cannot read.
_UNKNOWN_ASKED = {"dataset": "", "teachers": [], "classes": [], "class_names": [], "ipc": 0, "preset": "", "seed": 0,
                  "evaluate": False, "baselines": False}


def _unreadable_view(job: UnreadableJob) -> Job:
    """A job whose record this version cannot read: what can be read of its request, each field
    where it has the type the field needs, else empty; its error says why nothing else is."""
    raw = job.asked()
    asked = {}
    for name, empty in _UNKNOWN_ASKED.items():
        try:
            asked[name] = TypeAdapter(JobAsked.model_fields[name].annotation).validate_python(raw.get(name, empty))
        except ValueError:
            asked[name] = empty
    run_id = raw.get("run_id") if isinstance(raw.get("run_id"), str) else ""
    error = job.error or (f"this job's record could not be read after an upgrade of the service "
                          f"({clean_line(job.why, 200)}); it is only listed")
    return Job(id=job.id, state=job.state, run_id=run_id, **asked, reused=job.reused, progress={},
               timings=_timings(job), error=error, links=_links(job.id))


def _iso(t: float | None) -> str | None:
    import datetime as dt

    return None if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None else round((b or time.time()) - a, 3)
