"""A job's evaluation, placed where its distillation ran.

The service's driver (api/jobs/runner.py) evaluates a finished run here. On a GPU cluster it is a Ray
task holding one worker's GPU share: the students train, and the teachers label, on that GPU
(`EvalSpec.device` cuda, mixed precision), as the DistillWorkers did, never on the driver's CPU.
Where Ray hands the task a GPU that torch in the worker cannot see (a cluster that declares GPUs
it has not got), the evaluation fails in one line naming the GPU, rather than training on the
CPU unasked. The task is sent the `EvalJob` and the `EvalSpec` as JSON; what it sends back is the
`Evaluation` as JSON, read back with `model_validate_json`. Where the workers had no GPU, the
driver evaluates in its own process with one worker's CPUs, the same composition, without the
cost of starting a Ray worker.
"""
from __future__ import annotations

from pathlib import Path

import ray
from pydantic import BaseModel, ConfigDict

from actors.pool import gpu_share
from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.runs.job import ExecutionSpec
from fadrm_ray.runtime import heavy_process_env
from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.settings import EvaluationError


class EvalPlacement(BaseModel):
    """The resources of the evaluation task, and the device its students train on."""

    model_config = ConfigDict(frozen=True)
    num_cpus: float
    num_gpus: float
    device: str

    @property
    def threads(self) -> int:
        return max(1, int(self.num_cpus))


def placement(spec: ExecutionSpec) -> EvalPlacement:
    """One worker's resources of `spec` on the connected cluster: its GPU share (at most one GPU;
    none where the workers had none) and its CPUs."""
    gpus = gpu_share(spec.gpus_per_worker)
    return EvalPlacement(num_cpus=spec.cpus_per_worker, num_gpus=min(1.0, gpus or 0.0),
                         device="cuda" if gpus else "cpu")


def evaluate_on_ray(run_dir: str | Path, job: EvalJob, spec: ExecutionSpec, *, baselines: bool) -> Evaluation:
    """Evaluate the run at `run_dir` on `placement(spec)` (a Ray task where it holds a GPU): the students of
    `job.config` (with random real images and the run's patches beside them with `baselines`),
    and what the images reach with hard labels alone (`ranking.hard_label_ranking`). The students
    run as the placement says (an `EvalSpec`: its device, its threads where `spec.threads` is unset,
    no progress bar)."""
    where = placement(spec)
    how = EvalSpec(device=where.device, threads=spec.threads or where.threads, progress=False)
    if not where.num_gpus:  # a CPU job: here, as its workers' CPUs would
        return Evaluation.model_validate_json(_evaluate(str(run_dir), job.model_dump_json(), how.model_dump_json(),
                                                        baselines, False))
    task = ray.remote(_evaluate).options(num_cpus=where.num_cpus, num_gpus=where.num_gpus, max_retries=0,
                                         runtime_env={"env_vars": heavy_process_env(how.threads)})
    ref = task.remote(str(run_dir), job.model_dump_json(), how.model_dump_json(), baselines, where.num_gpus > 0)
    try:
        return Evaluation.model_validate_json(ray.get(ref))
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, Exception) else exc
        raise cause from None
    finally:
        ray.cancel(ref, force=True)  # a driver stopped while waiting leaves no task behind


def _evaluate(run_dir: str, job_json: str, spec_json: str, baselines: bool, on_gpu: bool) -> str:
    import torch

    from fadrm_ray.evaluation.store_run import EvalScope, evaluate_store_run
    from fadrm_ray.runtime import torch_threads

    job, spec = EvalJob.model_validate_json(job_json), EvalSpec.model_validate_json(spec_json)
    if on_gpu and not torch.cuda.is_available():
        raise EvaluationError(f"Ray placed the evaluation on GPU {ray.get_gpu_ids()}, but torch in that worker sees no "
                              f"CUDA device (torch {torch.__version__}); the cluster declares a GPU it cannot use")
    # Random real images and the starting patches beside it in the store (where asked), and what
    # the images reach with their hard labels alone, beside the soft-label top-1.
    with torch_threads(spec.threads):
        measured = evaluate_store_run(run_dir, job, spec, EvalScope(baselines=baselines, ranking="hard-labels"))
    return measured.evaluation.model_dump_json()
