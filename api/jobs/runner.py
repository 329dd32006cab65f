"""The driver of one service job: `python -m api.jobs.runner JOB_DIR`.

The service starts it as a process of its own session, so it outlives a restart of the HTTP
process. It reads the job the request built (`DriverInput`: the plan and its execution spec),
runs it through the Ray door on the cluster the spec names (`actors.coordinator.run(job, spec)`;
the job is neither resolved again nor given a new run id), evaluates when asked (a Ray task on
the resources of one of the job's workers, a GPU share on a GPU cluster: `actors.evaluation`),
and ends by writing the job's outcome file once: succeeded (with the result), failed (with one
line saying why: `api.contract.service_errors.job_error`) or cancelled. SIGTERM stops the run:
the coordinator's cleanup kills its actors and leaves the Ray session, and finished units stay
in the store for a later request. The service writes why it stopped the driver (`JobFiles.stop`:
cancelled, or failed past the time limit) before it sends SIGTERM, and the outcome says the
same, whichever exception the signal raised here (Ray's own SIGTERM handler replaces this one
once the driver joins Ray). Before an evaluation that stores soft labels, the driver records the
run's soft-label folder (`api.jobs.leftovers`), so the service can remove what a job that did not
succeed added there; as the evaluation starts, it says when (`JobFiles.evaluating`: the
service's phase and ETA).

While it runs, the driver touches its heartbeat file (`JobFiles.heartbeat`) every HEARTBEAT_S
seconds (less when the service's timeout is short), from a thread of its own: the service fails
a running job whose heartbeat is older than its FADRM_DRIVER_HEARTBEAT_TIMEOUT (a driver that
was stopped, SIGSTOP, or hangs). Its output (its own lines, a traceback) goes through a pipe to
`driver.log`, which is rotated once it holds `log_max_bytes` (one older file, `driver.log.1`,
kept). Ray's own lines (joining the cluster, its warnings) go to the run's `ray.log`, as those of
`fadrm distill` do (`actors.ray_output`).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from fadrm_ray.runs.job import ExecutionSpec

from api.contract.service_errors import job_error
from api.jobs.job_files import EvaluationStarted, JobFiles, Outcome, StopOrder, read_model, write_model
from api.jobs.leftovers import write_snapshot
from api.jobs.private_files import PRIVATE, private_write
from api.planning.requests import JobPlan

HEARTBEAT_S = 5.0
DRIVER_LOG_MAX_BYTES = 16 * 2**20


class Cancelled(BaseException):
    """SIGTERM: the job was cancelled."""


def _on_sigterm(signum, frame):
    raise Cancelled()


class DriverInput(BaseModel):
    """What the service hands a job's driver (`JobFiles.plan`): the plan, built and checked at
    request time, and how to run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    plan: JobPlan
    execution: ExecutionSpec
    log_max_bytes: int = DRIVER_LOG_MAX_BYTES
    heartbeat_s: float = HEARTBEAT_S


def beat(path: Path, every: float = HEARTBEAT_S) -> threading.Thread:
    """Touch `path` now and every `every` seconds for as long as this process runs."""
    def touch():
        while True:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE))
                os.utime(path)
            except OSError:
                pass
            time.sleep(every)

    thread = threading.Thread(target=touch, name="fadrm-heartbeat", daemon=True)
    thread.start()
    return thread


def bounded_output(path: Path, max_bytes: int) -> threading.Thread:
    """Send this process's stdout and stderr (file descriptors 1 and 2) through a pipe to `path`,
    moved to `path.1` (the one before it dropped) once it holds `max_bytes`."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump():
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE)
        size = os.fstat(out).st_size
        while chunk := os.read(read_end, 65536):
            if size + len(chunk) > max_bytes and size > 0:
                os.close(out)
                os.replace(path, path.with_name(path.name + ".1"))
                out, size = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE), 0
            os.write(out, chunk[-max_bytes:])
            size += min(len(chunk), max_bytes)
        os.close(out)

    thread = threading.Thread(target=pump, name="fadrm-log", daemon=True)
    thread.start()
    return thread


def run(files: JobFiles) -> Outcome:
    from actors import coordinator
    from actors.ray_output import ray_output
    from fadrm_ray.layout import RunLayout
    from fadrm_ray.runtime import torch_threads

    given = DriverInput.model_validate_json(files.plan.read_text())
    plan, spec = given.plan, given.execution
    # This process's torch threads, set once; the Ray session held for the evaluation too, its
    # lines (joining the cluster included) in the run's ray.log.
    with torch_threads(spec.threads), ray_output(RunLayout(plan.job.run_dir).ray_log, spec.verbose), \
            coordinator.ray_session(spec.address):
        result = coordinator.run(plan.job, spec)
        outcome = Outcome(state="succeeded")
        if plan.evaluate:
            from actors.evaluation import evaluate_on_ray
            from fadrm_ray.evaluation.eval_job import EvalJob

            if plan.evaluation is not None and plan.evaluation.soft_labels == "stored":
                write_snapshot(RunLayout(result.run_dir).soft_labels, files.soft_labels_before)
            write_model(files.evaluating, EvaluationStarted(t=time.time()))  # the service's phase and ETA
            # On the cluster, where the job's workers ran: a GPU share on a GPU cluster.
            eval_job = EvalJob(config=plan.evaluation, ipc=plan.ipc)  # how: evaluate_on_ray's EvalSpec
            evaluation = evaluate_on_ray(result.run_dir, eval_job, spec, baselines=plan.baselines)
            private_write(files.evaluation, evaluation.model_dump_json())
            files.soft_labels_before.unlink(missing_ok=True)  # the labels are the finished evaluation's
    return outcome


def main(argv: list[str]) -> int:
    files = JobFiles(Path(argv[0]))
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.time()
    pump = None
    try:
        given = DriverInput.model_validate_json(files.plan.read_text())
        beat(files.heartbeat, given.heartbeat_s)
        pump = bounded_output(files.log, given.log_max_bytes)
        outcome = run(files)
    except BaseException as exc:
        outcome = _ended(files, exc)
    outcome = outcome.model_copy(update={"pid": os.getpid(), "seconds": time.time() - started})
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the outcome is written whatever comes now
    write_model(files.outcome, outcome)
    if pump is not None:  # the last lines reach the log before the process ends
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # the pipe's last write ends: the pump reads to its end
        os.dup2(null, 2)
        os.close(null)
        pump.join(timeout=5)
    return 0 if outcome.state == "succeeded" else 1


def _ended(files: JobFiles, exc: BaseException) -> Outcome:
    """The outcome of a driver that did not finish: what the service stopped it for, or why it failed."""
    import traceback

    stop = read_model(files.stop, StopOrder)
    if stop is not None and stop.state in ("cancelled", "failed"):
        print(f"stopped by the service: {stop.state}: {stop.error}", flush=True)
        return Outcome(state=stop.state, error=stop.error)
    if isinstance(exc, Cancelled) or (isinstance(exc, SystemExit) and exc.code == signal.SIGTERM):
        return Outcome(state="cancelled", error="the driver was stopped (SIGTERM)")
    traceback.print_exc()  # the whole chain stays in driver.log; the API shows one clean line
    return Outcome(state="failed", error=job_error(exc))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
