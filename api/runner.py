"""The driver of one service job: `python -m api.runner JOB_DIR`.

The service starts it as a process of its own session, so it outlives a restart of the HTTP
process. It reads the job's plan, distills through the coordinator on the Ray cluster the plan
names (`actors.coordinator.distill_on_ray`), evaluates when asked, and ends by writing the
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

from fadrm_ray.fileio import atomic_write_text

from api.jobs import JobFiles


class Cancelled(BaseException):
    """SIGTERM: the job was cancelled."""


def _on_sigterm(signum, frame):
    raise Cancelled()


def run(files: JobFiles) -> dict:
    from actors.coordinator import distill_on_ray
    from fadrm_ray.config import DistillConfig
    from fadrm_ray.runtime import ExecutionSpec, torch_threads

    plan = json.loads(files.plan.read_text())
    runtime = plan["runtime"]
    cfg = DistillConfig.from_dict(plan["config"])
    spec = ExecutionSpec(address=runtime["ray_address"], workers=runtime["workers"], cpus_per_worker=1.0,
                         gpus_per_worker=1.0 if runtime["device"] == "cuda" else 0.0, progress=False)
    with torch_threads(runtime["threads"]):
        result = distill_on_ray(cfg, plan["dataset_spec"], plan["teacher_paths"], runtime["store"], spec)
        if result.run_id != plan["run_id"]:
            raise RuntimeError(f"the run id is {result.run_id}, the service planned {plan['run_id']}: "
                               f"a teacher or the dataset changed since the request")
        outcome = {"state": "succeeded", "result": result.to_dict()}
        if plan["evaluate"]:
            from fadrm_ray.evaluate import evaluate_run
            from fadrm_ray.settings import EvalConfig
            from fadrm_ray.store import to_plain

            evaluation = evaluate_run(result.run_dir, EvalConfig.model_validate(plan["evaluation"]), ipc=plan["ipc"],
                                      num_threads=runtime["threads"], progress=False)
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
