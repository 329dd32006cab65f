"""The driver of one service job: `python -m api.runner JOB_DIR`.

The service starts it as a process of its own session, so it outlives a restart of the HTTP
process. It reads the job the request built (`DriverInput`: the plan and its execution spec),
runs it through the coordinator on the Ray cluster the spec names (`actors.coordinator.run_on_ray`;
the job is neither resolved again nor given a new run id), evaluates when asked, and ends by writing the
job's outcome file once: succeeded (with the result), failed (with one line saying why:
`api.errors.job_error`) or cancelled. SIGTERM stops the run: the coordinator's cleanup kills its
actors and leaves the Ray session, and finished units stay in the store for a later request.
The service writes why it stopped the driver (`JobFiles.stop`: cancelled, or failed past the
time limit) before it sends SIGTERM, and the outcome says the same, whichever exception the
signal raised here (Ray's own SIGTERM handler replaces this one once the driver joins Ray).
Before an evaluation that stores soft labels, the driver records the run's soft-label folder
(`api.leftovers`), so the service can remove what a job that did not succeed added there.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from fadrm_ray.fileio import read_json_object
from fadrm_ray.job import ExecutionSpec

from api.errors import job_error
from api.files import private_write
from api.jobs import JobFiles
from api.leftovers import write_snapshot
from api.requests import JobPlan


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


def run(files: JobFiles) -> dict:
    from actors.coordinator import run_on_ray
    from fadrm_ray.runtime import torch_threads

    given = DriverInput.model_validate_json(files.plan.read_text())
    plan, spec = given.plan, given.execution
    with torch_threads(spec.threads):
        result = run_on_ray(plan.job, spec)
        outcome = {"state": "succeeded", "result": result.to_dict()}
        if plan.evaluate:
            from fadrm_ray.evaluate import evaluate_run
            from fadrm_ray.layout import RunLayout

            if plan.evaluation is not None and plan.evaluation.soft_labels == "stored":
                write_snapshot(RunLayout(result.run_dir).soft_labels, files.soft_labels_before)
            evaluation = evaluate_run(result.run_dir, plan.evaluation, ipc=plan.ipc, num_threads=spec.threads,
                                      progress=False)
            private_write(files.evaluation, evaluation.model_dump_json())
            files.soft_labels_before.unlink(missing_ok=True)  # the labels are the finished evaluation's
    return outcome


def main(argv: list[str]) -> int:
    files = JobFiles(Path(argv[0]))
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.time()
    try:
        outcome = run(files)
    except BaseException as exc:
        outcome = _ended(files, exc)
    outcome.update(pid=os.getpid(), seconds=time.time() - started)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the outcome is written whatever comes now
    private_write(files.outcome, json.dumps(outcome))
    return 0 if outcome["state"] == "succeeded" else 1


def _ended(files: JobFiles, exc: BaseException) -> dict:
    """The outcome of a driver that did not finish: what the service stopped it for, or why it failed."""
    import traceback

    stop = read_json_object(files.stop)
    if stop is not None and stop.get("state") in ("cancelled", "failed"):
        print(f"stopped by the service: {stop['state']}: {stop.get('error')}", flush=True)
        return {"state": stop["state"], "error": stop.get("error")}
    if isinstance(exc, Cancelled) or (isinstance(exc, SystemExit) and exc.code == signal.SIGTERM):
        return {"state": "cancelled", "error": "the driver was stopped (SIGTERM)"}
    traceback.print_exc()  # the whole chain stays in driver.log; the API shows one clean line
    return {"state": "failed", "error": job_error(exc)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
