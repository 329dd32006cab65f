"""The service's evaluation runs where the job's workers ran: a Ray task with a GPU share on a
cluster with GPUs (students on cuda); without GPUs one worker's CPUs, the same result as
`evaluate_store_run` gives."""
from __future__ import annotations

import shutil

import pytest
import torch

from actors.evaluation import evaluate_on_ray, placement
from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.runs.job import ExecutionSpec
from fadrm_ray.runtime import torch_threads
from fadrm_ray.config import EvalConfig
from fadrm_ray.settings import EvaluationError

pytestmark = pytest.mark.ray

JOB = EvalJob(config=EvalConfig(epochs=2, seeds=[0]))  # evaluate_on_ray runs it without a progress bar


@pytest.fixture(scope="module")
def ray_with_a_gpu():
    """A real local Ray that declares one GPU (this machine may have none: Ray believes it)."""
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024 * 1024)
    yield
    ray.shutdown()


def test_a_job_on_a_gpu_cluster_is_evaluated_on_a_gpu(ray_with_a_gpu, run_copy):
    where = placement(ExecutionSpec())  # the workers' default: one GPU each where the cluster has GPUs
    assert (where.num_gpus, where.device) == (1.0, "cuda")
    assert placement(ExecutionSpec(gpus_per_worker=0.5)).num_gpus == 0.5
    if torch.cuda.is_available():
        result = evaluate_on_ray(run_copy, JOB, ExecutionSpec(), baselines=False)
        assert result.top1_per_seed and result.ranking is not None
    else:  # Ray handed the task the declared GPU; torch there has none, and says so
        with pytest.raises(EvaluationError, match=r"placed the evaluation on GPU \[.*sees no CUDA device"):
            evaluate_on_ray(run_copy, JOB, ExecutionSpec(), baselines=False)


def test_a_cpu_job_is_evaluated_with_one_workers_cpus_as_evaluate_store_run_does(ray_with_a_gpu, run_copy, tmp_path):
    where = placement(ExecutionSpec(gpus_per_worker=0))
    assert (where.num_gpus, where.device, where.threads) == (0.0, "cpu", 1)
    other = shutil.copytree(run_copy, tmp_path / "other" / run_copy.name)
    on_ray = evaluate_on_ray(run_copy, JOB, ExecutionSpec(gpus_per_worker=0), baselines=False)
    with torch_threads(1):
        here = evaluate_store_run(other, JOB, EvalSpec(device="cpu", threads=1, progress=False)).evaluation
    assert on_ray.top1_per_seed == here.top1_per_seed
    assert on_ray.ranking is not None and len(on_ray.ranking.hard_top1_per_seed) == 1
