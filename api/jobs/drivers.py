"""Where jobs run: a Ray cluster, and one driver process per job.

With FADRM_RAY_ADDRESS the drivers join that cluster. Without it the service starts a local Ray
head (`LocalRay`) as a process group of its own, with a private temporary folder, token
authentication (a token file in the service's state folder) and no dashboard. The drivers are
not children that die with the HTTP process: a restarted service finds each running job's driver
by the pid its record holds, and the head by its record (pid and start time). The head lives
while the service, or the driver of a running job, holds its lease: its lifeline
(`api.jobs.head_lifeline`) stops it within seconds once none does (a service killed with SIGKILL
and no job running takes its head with it). The service stops it itself when it stops with no
job running, and `fadrm serve --stop-ray` stops it.

The local head (`api.jobs.local_ray`) binds to loopback only: Ray turns a loopback
`--node-ip-address` into the machine's routable address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (its
single-machine mode), and without that its GCS and raylet listen on every interface and its
metrics endpoints answer anyone without a token. Metrics export is off
(RAY_enable_metrics_collection=0); the monitor's and the minimal dashboard's metrics endpoints,
which cannot be turned off, follow the node's loopback address. Drivers get the same variables,
or they would look for the node elsewhere.

The service also watches its local head (`DriverSupervisor.keep_ray`, every RAY_WATCH_S seconds
from a thread of its own): a head that died is started again at once, not when the next job
starts, so `/readyz` is 200 again without a job. A job whose driver failed because the head it
ran on went away says so in one line.

`DriverSupervisor.tick` is the scheduler, called about twice a second by the service: it settles
the jobs whose driver ended (from the outcome file the driver writes, checked against the store:
a run is complete only when its manifest says so), ends jobs running longer than the limit
(`DriverSettings.job_seconds`, FADRM_MAX_JOB_SECONDS: failed, with that reason) and those whose
driver's heartbeat stopped (`heartbeat_timeout`: a driver stopped with SIGSTOP, or hung), starts
queued jobs while fewer than FADRM_MAX_RUNNING run, and finishes off stopped drivers that did
not stop in time. A job the service stops (cancel, time limit) has its end written first
(`JobFiles.stop`), so the driver's outcome says what the API says. Once the driver of a job that
did not succeed is gone, the service removes what the job left (`api.jobs.leftovers`) and writes
the outcome file itself where the driver could not (killed), or where it disagrees with the
record.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from fadrm_ray.layout import RunLayout
from fadrm_ray.runs.job import ExecutionSpec
from fadrm_ray.runtime import heavy_process_env

from api.contract.service_errors import clean_line, job_error
from api.jobs.job_files import Outcome, SoftLabelSnapshot, StopOrder, read_model, write_model
from api.jobs.job_records import JobDB, JobRecord, UnreadableJob
from api.jobs.leftovers import remove_added, remove_job_temporaries
from api.jobs.local_ray import REPO, START_TIMEOUT_S, Holder, LocalRay, alive, clean_env, proc_start, signal_group
from api.jobs.private_files import private_append, private_write
from api.jobs.runner import HEARTBEAT_S, DriverInput
from api.planning.requests import images_in_store, run_dir

log = logging.getLogger("fadrm.api")

CANCEL_GRACE_S = 10.0
CANCELLED = "cancelled by request"
UNREADABLE = ("the job's record could not be read after an upgrade of the service (its plan is not in a shape this "
              "version reads: {why}); submit the request again")
HEAD_LOST = ("the service's Ray head stopped while the job ran (the service starts a new one); "
             "submit the request again")


@dataclass(frozen=True)
class DriverSettings:
    """What the driver supervisor is given of the service's settings (api.planning.service_settings)."""

    store: Path                # the runs (FADRM_STORE)
    state_dir: Path            # the service's own folder: the local head's record, lease and token
    ray_address: str | None    # a Ray cluster (FADRM_RAY_ADDRESS); None: the service's local head
    ray_cpus: int | None       # that head's CPUs (FADRM_RAY_CPUS; None: this machine's)
    max_running: int           # jobs running at once (FADRM_MAX_RUNNING)
    job_seconds: float         # a job's wall-clock limit (FADRM_MAX_JOB_SECONDS)
    heartbeat_timeout: float   # a running driver's silence before it is failed (FADRM_DRIVER_HEARTBEAT_TIMEOUT)
    log_max_bytes: int         # a driver.log's size before it is rotated (FADRM_DRIVER_LOG_MAX_BYTES)
    workers: int | None        # distill actors per job (FADRM_WORKERS)
    cpus_per_worker: float     # CPUs each actor reserves (FADRM_CPUS_PER_WORKER)
    device: str                # cpu, or cuda: one GPU per actor (FADRM_DEVICE)
    threads: int               # torch threads of a driver (FADRM_THREADS)


class DriverSupervisor:
    """Launches each job's driver process and watches it to its end (the module docstring): the
    scheduler's `tick`, `cancel`, and the service's local Ray head they run on."""

    def __init__(self, settings: DriverSettings, db: JobDB):
        self.settings = settings
        self.db = db
        self.local = None if settings.ray_address else LocalRay(settings.state_dir, settings.ray_cpus)
        self.children: list[subprocess.Popen] = []
        # Jobs that ended other than succeeded and are not tidied yet: job id -> (driver pid, its
        # start time, when to SIGKILL it). Rebuilt at start from the marker files those jobs still
        # have, so a restart in between loses nothing.
        self.ending: dict[str, tuple[int | None, str | None, float]] = {}
        for marker in [*db.jobs_dir.glob("*/stop.json"), *db.jobs_dir.glob("*/soft-labels-before.json")]:
            job = db.get(marker.parent.name)
            if job is not None and job.state in ("failed", "cancelled"):
                self.ending[job.id] = (job.pid, job.pid_start, time.time() + CANCEL_GRACE_S)
        # A plan becomes unreadable only across an upgrade, that is across a restart: settled here.
        for old in db.unreadable("queued", "running"):
            self._settle_unreadable(old)
        if self.local is not None:  # this process holds the head now (a head left running is taken over)
            self.local.claim(_drivers(db.in_state("running")))

    def _settle_unreadable(self, job: UnreadableJob) -> None:
        """Fail a queued or running job whose record this version cannot read (no driver of this
        version can run its plan), and stop a driver of the earlier version still running it."""
        error = clean_line(UNREADABLE.format(why=job.why))
        if not self.db.update(job.id, only_from=("queued", "running"), state="failed", error=error,
                              finished_at=time.time()):
            return
        log.warning("job %s: %s", job.id, error)
        if job.state == "running":
            self._stop(replace(job, state="failed", error=error))

    # ------------------------------------------------------------------ ray
    def ray_address(self) -> str:
        return self.settings.ray_address or self.local.address()

    def keep_ray(self) -> bool:
        """Start the local head again when it is gone (the watch), and keep its lifeline; True
        when one was started."""
        if self.local is None:
            return False
        if self.local.running() is not None:
            self.local.keep_lifeline()
            return False
        if self.local.record.exists():
            log.warning("the local Ray head is gone; starting a new one")
        for job in self.db.in_state("running"):  # their drivers' head is gone: they cannot go on
            # A driver that ended first (while no service ran: its head's lifeline stopped the head
            # once it had) is settled by its outcome; one still running has lost its head.
            if not self._settle(job):
                self._end(job, "failed", HEAD_LOST)
        self.local.address()
        return True

    def ray_reachable(self) -> bool:
        if self.local is not None:
            head = self.local.running()
            return head is not None and (Path(head.temp_dir) / "ray_current_cluster").is_file()
        return _tcp_reachable(self.settings.ray_address)

    # ------------------------------------------------------------------ scheduling
    def tick(self) -> None:
        for proc in list(self.children):
            if proc.poll() is not None:
                self.children.remove(proc)
        limit = self.settings.job_seconds
        running = self.db.in_state("running")
        if self.local is not None:  # the head's lease: this process and the running jobs' drivers
            self.local.claim(_drivers(running))
        for job in running:
            if self._settle(job) or job.started_at is None:
                continue
            if time.time() - job.started_at > limit:
                self._end(job, "failed", f"ran longer than the service's job limit of {limit:g} s "
                                         "(FADRM_MAX_JOB_SECONDS)")
            elif (silent := self._silent_for(job)) is not None:
                self._end(job, "failed", f"the job's driver stopped answering (no heartbeat for {silent:.0f} s: "
                                         "stopped or hung); submit the request again")
        for job_id, (pid, start, kill_at) in list(self.ending.items()):
            if alive(pid, start):
                if time.time() > kill_at:
                    signal_group(pid, signal.SIGKILL)
            elif self._tidy(job_id):
                self.ending.pop(job_id, None)
        queued = self.db.in_state("queued")
        if queued:
            free = self.settings.max_running - self.db.count("running")
            for job in queued[:max(0, free)]:
                self._start(job)

    def _silent_for(self, job: JobRecord) -> float | None:
        """Seconds since the heartbeat of a running job's driver, when that is past the timeout."""
        timeout = self.settings.heartbeat_timeout
        if job.pid is None or time.time() - job.started_at <= timeout:
            return None
        try:
            silent = time.time() - self.db.files(job.id).heartbeat.stat().st_mtime
        except OSError:  # no beat yet: the driver is still starting (its imports, Ray's connection)
            silent, timeout = time.time() - job.started_at, max(timeout, START_TIMEOUT_S)
        return silent if silent > timeout else None

    def _head_lost(self, job: JobRecord) -> bool:
        """Whether the local head the job's driver joined is gone (another is up, or none)."""
        if self.local is None:
            return False
        try:
            ran_on = DriverInput.model_validate_json(self.db.files(job.id).plan.read_text()).execution.address
        except (OSError, ValueError):
            return False
        return ran_on != self.local.current_address()

    def _settle(self, job: JobRecord) -> bool:
        """Finish a running job whose driver has ended; True when it did."""
        files = self.db.files(job.id)
        outcome = read_model(files.outcome, Outcome)
        if outcome is None:
            if job.pid is None or alive(job.pid, job.pid_start):
                if job.pid is None and job.started_at and time.time() - job.started_at > START_TIMEOUT_S:
                    return self._finish(job, "failed", "the job's driver did not start")
                return False
            outcome = read_model(files.outcome, Outcome)  # it may have written it just before it ended
            if outcome is None:
                return self._finish(job, "failed", HEAD_LOST if self._head_lost(job) else
                                    f"the job's driver ended without an outcome; see {files.log.name}")
        state, error = outcome.state, outcome.error
        if state == "succeeded" and not images_in_store(self.settings.store, job.plan):
            state, error = "failed", "the driver ended, but the store's run is not complete"
        if state not in ("succeeded", "failed", "cancelled"):
            state, error = "failed", f"the job's driver wrote an outcome the service does not know: {state!r}"
        if state == "failed" and self._head_lost(job):
            error = HEAD_LOST
        return self._finish(job, state, None if error is None else clean_line(str(error)))

    def _finish(self, job: JobRecord, state: str, error: str | None) -> bool:
        """Record the end of a running job whose driver has ended (or never started)."""
        if not self.db.update(job.id, only_from=("running",), state=state, error=error, finished_at=time.time()):
            return False
        if state != "succeeded":
            self.ending[job.id] = (job.pid, job.pid_start, time.time() + CANCEL_GRACE_S)
        return True

    def _end(self, job: JobRecord, state: str, error: str) -> bool:
        """End a running job now (failed past the time limit): record it, then stop its driver."""
        if not self.db.update(job.id, only_from=("running",), state=state, error=error, finished_at=time.time()):
            return False
        self._stop(self.db.get(job.id) or job)
        return True

    def _stop(self, job: JobRecord | UnreadableJob) -> None:
        """Stop the driver of a job the service has ended: say why (its outcome repeats it), then
        SIGTERM it (it kills its actors and leaves Ray); SIGKILL after a grace period."""
        files = self.db.files(job.id)
        if files.root.is_dir():
            write_model(files.stop, StopOrder(state=job.state, error=job.error))
        if job.pid is not None and alive(job.pid, job.pid_start):
            signal_group(job.pid, signal.SIGTERM)
            signal_group(job.pid, signal.SIGCONT)  # a stopped driver wakes to handle it
        self.ending[job.id] = (job.pid, job.pid_start, time.time() + CANCEL_GRACE_S)

    def _tidy(self, job_id: str) -> bool:
        """Once the driver of a job that did not succeed is gone: remove what it left and make
        its outcome file say what the record says. False to try again later (another running job
        evaluates the same run, and may be writing soft labels it would take for this one's)."""
        job = self.db.entry(job_id)
        if isinstance(job, UnreadableJob):  # its plan cannot say what it added: only the marker goes
            self.db.files(job_id).stop.unlink(missing_ok=True)
            return True
        if job is None or job.state not in ("failed", "cancelled"):
            return True
        files = self.db.files(job.id)
        before = read_model(files.soft_labels_before, SoftLabelSnapshot)
        if before is not None:
            if any(other.plan.run_id == job.plan.run_id and other.plan.evaluate
                   for other in self.db.in_state("running")):
                return False
            remove_added(RunLayout(run_dir(self.settings.store, job.plan)).soft_labels, before)
            files.soft_labels_before.unlink(missing_ok=True)
        remove_job_temporaries(files.root)
        outcome = read_model(files.outcome, Outcome)
        if files.root.is_dir() and (outcome is None or outcome.state != job.state or outcome.error != job.error):
            write_model(files.outcome, (outcome or Outcome(state=job.state)).model_copy(
                update={"state": job.state, "error": job.error}))
        files.stop.unlink(missing_ok=True)
        return True

    def _start(self, job: JobRecord) -> None:
        if not self.db.update(job.id, only_from=("queued",), state="running", started_at=time.time()):
            return  # cancelled meanwhile
        files = self.db.files(job.id)
        try:
            address = self.ray_address()
            files.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            execution = ExecutionSpec(address=address, workers=self.settings.workers,
                                      cpus_per_worker=self.settings.cpus_per_worker,
                                      gpus_per_worker=1.0 if self.settings.device == "cuda" else 0.0,
                                      device=self.settings.device, threads=self.settings.threads, progress=False)
            private_write(files.plan, DriverInput(plan=job.plan, execution=execution,
                                                  log_max_bytes=self.settings.log_max_bytes,
                                                  heartbeat_s=min(HEARTBEAT_S, self.settings.heartbeat_timeout / 4)
                                                  ).model_dump_json())
            env = {**clean_env(), **heavy_process_env(self.settings.threads), "RAY_ADDRESS": address,
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            if self.local is not None:
                env.update(self.local.env())
            log = private_append(files.log)
            try:
                proc = subprocess.Popen([sys.executable, "-m", "api.jobs.runner", str(files.root)],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, env=env)
            finally:
                os.close(log)
        except Exception as exc:
            self._finish(job, "failed", f"the job could not start: {job_error(exc)}")
            return
        self.children.append(proc)
        start = proc_start(proc.pid)
        if not self.db.update(job.id, only_from=("running",), pid=proc.pid, pid_start=start):
            ended = self.db.get(job.id)  # cancelled while it started
            if ended is not None:
                self._stop(replace(ended, pid=proc.pid, pid_start=start))

    # ------------------------------------------------------------------ cancel
    def cancel(self, job: JobRecord) -> bool:
        """Cancel a queued or running job; True when it was (a finished job is left as it is)."""
        if job.state == "running" and self._settle(job):
            return False  # its driver had ended: the job is what its outcome says, not cancelled
        if not self.db.update(job.id, only_from=("queued", "running"), state="cancelled", error=CANCELLED,
                              finished_at=time.time()):
            return False
        fresh = self.db.get(job.id)
        if fresh is not None and fresh.started_at is not None:  # it was running: a driver may be up
            self._stop(fresh)
        return True

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the local head unless running jobs still need it: their drivers hold its lease, so
        a restarted service takes it over, and without one the head's lifeline stops it once they
        have ended (api.jobs.local_ray)."""
        if self.local is None:
            return
        running = self.db.in_state("running")
        if running:
            self.local.claim(_drivers(running))
            log.info("stopping: the local Ray head stays up while the drivers of the %d running job(s) run (a "
                     "restarted service takes it over; without one it stops once they have ended)", len(running))
            return
        started = time.monotonic()
        log.info("stopping the local Ray head (SIGTERM, SIGKILL after 5 s)")
        self.local.stop()
        log.info("the local Ray head stopped in %.1f s", time.monotonic() - started)


def _drivers(running: list[JobRecord]) -> list[Holder]:
    """The drivers of running jobs, as the head's lease names them."""
    return [Holder(pid=job.pid, start=job.pid_start) for job in running if job.pid is not None]


def _tcp_reachable(address: str | None) -> bool:
    import socket
    from urllib.parse import urlparse

    if not address:
        return False
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 6379), timeout=2):
            return True
    except (OSError, ValueError):
        return False
