"""The Ray door of a distillation: `run(job, spec, parts=None)` and `device_type(spec)`, the same
two functions as the library's door (`fadrm_ray.run.execute`, its `Door` protocol), and the Ray
session they run in (joined, or embedded and bound to this process).

`run` runs a job built elsewhere, once (the `fadrm` command, the service's driver, a Tune trial,
the benchmarks: `prepare_job` or `build_job`, for `device_type(spec)`), on a `WorkerPool` of
DistillWorker actors. The pool (`actors.pool`: the actors, their resources, the retries of lost
work) is the Ray executor of `fadrm_ray.run.execute.run_job`, which holds the run's lock, plans
its units and writes the manifest; the pool keeps one run's tasks, run context and ledger in a
`RunSchedule` (`actors.schedule`).
"""
from __future__ import annotations

import contextlib
import os

import ray

from actors.lifeline import Lifeline
from actors.pool import WorkerPool
from fadrm_ray.run import execute
from fadrm_ray.run.execute import DistillResult
from fadrm_ray.run.job import DistillJob, ExecutionSpec, JobParts
from fadrm_ray.runtime import ALLOCATOR_ENV


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


def local_gpus() -> int:
    """The GPUs torch sees on this machine: what an embedded Ray is given (`run`), so that a job
    built for this machine's device type (`device_type`) finds workers of that type."""
    import torch

    return torch.cuda.device_count()


def device_type(spec: ExecutionSpec) -> str:
    """The device type a Ray run of `spec` distills on, which its job is built for: cuda where its
    workers get a GPU share (`spec.gpus_per_worker`; unset, one GPU each where the cluster has
    GPUs). Only a cluster named by `spec.address` (or the Ray of this process) is asked; for an
    embedded Ray, this machine's GPUs are counted without starting one."""
    if spec.gpus_per_worker is not None:
        return "cuda" if spec.gpus_per_worker > 0 else "cpu"
    if not spec.address and not ray.is_initialized():
        return "cuda" if local_gpus() else "cpu"
    with ray_session(spec.address):
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def run(job: DistillJob, spec: ExecutionSpec, parts: JobParts | None = None) -> DistillResult:
    """The Ray door: run `job` on DistillWorker actors of the cluster at `spec.address` (or of an
    embedded local Ray; or of the Ray this process already joined, a Tune trial's placement group
    included), `spec.workers` of them with `spec.cpus_per_worker` CPUs and their GPU share as the
    spec says or, unset, as the job's device type needs (`WorkerPool.for_job`). `parts`: what
    building the job loaded in this process (the dataset is sent to the workers from it)."""
    with ray_session(spec.address, num_gpus=None if spec.address else local_gpus()):
        pool = WorkerPool.for_job(job, spec)
        try:
            return execute.run_job(job, pool, parts)
        finally:
            pool.close()  # idempotent: also when run_job fails before executing
