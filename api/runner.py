"""The driver of one service job: `python -m api.runner JOB_DIR`.

The service starts it as a process of its own session, so it outlives a restart of the HTTP
process. It reads the job the request built (`DriverInput`: the plan and its execution spec),
runs it through the coordinator on the Ray cluster the spec names (`actors.coordinator.run_on_ray`;
the job is neither resolved again nor given a new run id), evaluates when asked, and ends by writing the
job's outcome file once: succeeded (with the result), failed (with one line saying why) or
cancelled. SIGTERM (a cancel) stops the run: the coordinator's cleanup kills its actors and
leaves the Ray session, and finished units stay in the store for a later request.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from fadrm_ray.fileio import atomic_write_text
from fadrm_ray.job import ExecutionSpec

from api.jobs import JobFiles
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
            from fadrm_ray.store import to_plain

            evaluation = evaluate_run(result.run_dir, plan.evaluation, ipc=plan.ipc, num_threads=spec.threads,
                                      progress=False)
            evaluation = {k: v for k, v in evaluation.items() if k != "model"}
            atomic_write_text(files.evaluation, json.dumps(to_plain(evaluation)))
    return outcome


def main(argv: list[str]) -> int:
    files = JobFiles(Path(argv[0]))
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.time()
    try:
        outcome = run(files)
    except Cancelled:
        outcome = {"state": "cancelled", "error": "cancelled"}
    except BaseException as exc:  # the job failed: say why in one line, and keep the trace in the log
        import traceback

        traceback.print_exc()
        message = " ".join(str(exc).split()) or type(exc).__name__
        outcome = {"state": "failed", "error": f"{type(exc).__name__}: {message}"[:2000]}
    outcome.update(pid=os.getpid(), seconds=time.time() - started)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the outcome is written whatever comes now
    atomic_write_text(files.outcome, json.dumps(outcome))
    return 0 if outcome["state"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
