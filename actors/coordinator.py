"""The Ray door of a distillation: a Ray session (joined, or embedded and bound to this process)
and `distill_on_ray`, which runs a job on a `WorkerPool` of DistillWorker actors.

The pool (`actors.pool.WorkerPool`: the actors, their resources, the retries of lost work) is the
Ray executor of `fadrm_ray.run.execute.run_job`; one run's tasks, run context and ledger are a
`RunSchedule` (`actors.schedule`). `run_job` holds the run's lock, plans its units and writes the
manifest.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import ray

from actors.lifeline import Lifeline
from actors.pool import WorkerPool
from fadrm_ray.config import DistillConfig
from fadrm_ray.data import get_dataset
from fadrm_ray.run.execute import DistillResult, run_job
from fadrm_ray.run.job import DistillJob, ExecutionSpec, prepare_job
from fadrm_ray.runtime import ALLOCATOR_ENV

if TYPE_CHECKING:
    from fadrm_ray.data.base import ImageDataset


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None):
    """Use the Ray already initialized in this process, join `address`, or start an embedded one.

    Only a Ray this function started is shut down at the end; an address-less `ray.init` is never
    used, since it would join any Ray instance already running on the machine. An embedded Ray
    is bound to this process by a `Lifeline`: it ends with the driver, even a killed one.
    """
    if ray.is_initialized():
        yield
        return
    runtime_env = {"env_vars": dict(ALLOCATOR_ENV)}  # read by glibc when each worker process starts
    lifeline = None
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    else:
        lifeline = Lifeline() if Lifeline.supported() else None
        try:
            with lifeline.tagging() if lifeline else contextlib.nullcontext():
                ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), num_gpus=num_gpus,
                         include_dashboard=False, runtime_env=runtime_env, log_to_driver=False,
                         object_store_memory=512 * 1024 * 1024)
        except BaseException:
            if lifeline:
                lifeline.close()
            raise
    try:
        yield
    finally:
        ray.shutdown()
        if lifeline:
            lifeline.close()


def distill_on_ray(cfg: DistillConfig | DistillJob, dataset_spec: str | None = None,
                   teacher_paths: Sequence[str | Path] = (), out_root: str | Path | None = None,
                   spec: ExecutionSpec | None = None, dataset: "ImageDataset | None" = None,
                   **options) -> DistillResult:
    """Run a distillation through Ray: on the cluster at `spec.address`, or on an embedded local
    Ray (`options` go to the WorkerPool).

    `cfg` is either a config, whose job is built here from `dataset_spec` (or the `dataset` the
    caller loaded from it), `teacher_paths` and `out_root` (the CLI, benchmarks, tests), or a
    `DistillJob` built elsewhere (a service request, `run_on_ray`), which is run as it is.
    """
    spec = spec or ExecutionSpec()
    built_elsewhere = isinstance(cfg, DistillJob)
    building = (dataset_spec, out_root) != (None, None) or bool(teacher_paths)
    if built_elsewhere == building or not built_elsewhere and (dataset_spec is None or out_root is None):
        raise TypeError("distill_on_ray takes a config with its dataset_spec, teacher_paths and out_root, "
                        "or a job alone")
    with ray_session(spec.address):
        pool = WorkerPool.from_spec(spec, **options)
        try:
            if built_elsewhere:
                return run_job(cfg, pool)
            # The driver checks the teachers on its CPU; the config resolves for the workers' device.
            if dataset is None:
                dataset = get_dataset(dataset_spec, root=spec.data_root)
            job, parts = prepare_job(cfg, dataset, dataset_spec, teacher_paths, out_root, device="cpu",
                                     device_type=pool.device_type, data_root=spec.data_root)
            return run_job(job, pool, parts)
        finally:
            pool.close()  # idempotent: also when run_job fails before executing


def run_on_ray(job: DistillJob, spec: ExecutionSpec) -> DistillResult:
    """Run a job built elsewhere (the service's driver, api/runner.py) through Ray."""
    return distill_on_ray(job, spec=spec)
