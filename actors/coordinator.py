"""The Ray door of a distillation: `run(job, spec, parts=None)` and `device_type(spec)`, the same
two functions as the library's door (`fadrm_ray.runs.execute`, its `Door` protocol), and the Ray
session they run in (joined, or embedded and bound to this process).

`run` runs a job built elsewhere, once (the `fadrm` command, the service's driver, a Tune trial,
the benchmarks: `prepare_job` or `build_job`, for `device_type(spec)`), on a `WorkerPool` of
DistillWorker actors. The pool (`actors.pool`: the actors, their resources, the retries of lost
work) is the Ray executor of `fadrm_ray.runs.execute.run_job`, which holds the run's lock, plans
its units and writes the manifest; the pool keeps one run's tasks, run context and ledger in a
`RunSchedule` (`actors.schedule`).
"""
from __future__ import annotations

import contextlib
import os

import ray

from actors.lifeline import Lifeline
from actors.pool import WorkerPool
from actors.ray_output import ray_output
from fadrm_ray.layout import RunLayout
from fadrm_ray.runs import execute
from fadrm_ray.runs.execute import DistillResult
from fadrm_ray.runs.job import DistillJob, ExecutionSpec, JobParts
from fadrm_ray.runtime import ALLOCATOR_ENV


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
                temp_dir: str | None = None):
    """Use the Ray already initialized in this process, join `address`, or start an embedded one
    (its session folder and logs under `temp_dir`, where given; else Ray's default).

    Only a Ray this function started is shut down at the end; an address-less `ray.init` is never
    used, since it would join any Ray instance already running on the machine. An embedded Ray
    is bound to this process by a `Lifeline`: it ends with the driver, even a killed one.
    """
    if ray.is_initialized():
        yield
        return
    runtime_env = {"env_vars": dict(ALLOCATOR_ENV)}  # read by glibc when each worker process starts
    lifeline, token = None, contextlib.nullcontext()
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    else:
        lifeline = Lifeline() if Lifeline.supported() else None
        token = session_token()
        try:
            token.__enter__()
            with lifeline.tagging() if lifeline else contextlib.nullcontext():
                ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), num_gpus=num_gpus,
                         include_dashboard=False, runtime_env=runtime_env, log_to_driver=False,
                         object_store_memory=512 * 1024 * 1024, **({"_temp_dir": temp_dir} if temp_dir else {}))
        except BaseException:
            token.__exit__(None, None, None)
            if lifeline:
                lifeline.close()
            raise
    try:
        yield
    finally:
        ray.shutdown()
        token.__exit__(None, None, None)
        if lifeline:
            lifeline.close()


AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


@contextlib.contextmanager
def session_token():
    """Token authentication for an embedded Ray with a token of its own, made for this session and
    handed to its processes through their environment: Ray's own default writes a token to
    ~/.ray/auth_token (a file in the user's home) and warns on every start. Where the user set
    RAY_AUTH_MODE, Ray's own handling stands."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        yield
        return
    import secrets

    saved = {name: os.environ.get(name) for name in AUTH_VARIABLES}
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_urlsafe(32)})
    _reload_ray_config()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _reload_ray_config()


def _reload_ray_config() -> None:
    """Ray reads RAY_AUTH_MODE into its cached config, and the token into its token loader, once;
    make this process read both again."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # another Ray: its own defaults
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def local_gpus() -> int:
    """The GPUs torch sees on this machine: what an embedded Ray is given (`run`), so that a job
    built for this machine's device type (`device_type`) finds workers of that type."""
    import torch

    return torch.cuda.device_count()


def device_type(spec: ExecutionSpec) -> str:
    """The device type a Ray run of `spec` distills on, which its job is built for: `spec.device`
    where it is given (refused, as `--local` refuses it, where the workers could not have it: cuda
    on a cluster or machine without GPUs, or with --gpus-per-worker 0), else cuda where its workers
    get a GPU share (`spec.gpus_per_worker`; unset, one GPU each where the cluster has GPUs). Only
    a cluster named by `spec.address` (or the Ray of this process) is asked; for an embedded Ray,
    this machine's GPUs are counted without starting one."""
    import torch

    from fadrm_ray.errors import InputError
    from fadrm_ray.runtime import resolve_device

    if spec.device is not None:
        try:
            wanted = torch.device(spec.device).type
        except (RuntimeError, TypeError):
            resolve_device(spec.device)  # its one-line refusal
            raise
        if wanted not in ("cpu", "cuda"):
            resolve_device(spec.device)
        if wanted == "cuda":
            if spec.gpus_per_worker == 0:
                raise InputError("--device cuda with --gpus-per-worker 0: the workers would have no GPU")
            if cluster_gpus(spec) == 0:
                where = f"the Ray cluster at {spec.address}" if spec.address else "this machine (torch sees none)"
                raise InputError(f"--device cuda: {where} has no GPU; leave --device out, or use --device cpu")
        return wanted
    if spec.gpus_per_worker is not None:
        return "cuda" if spec.gpus_per_worker > 0 else "cpu"
    return "cuda" if cluster_gpus(spec) else "cpu"


def cluster_gpus(spec: ExecutionSpec) -> float:
    """The GPUs the run's Ray has: this machine's for an embedded Ray (counted without starting
    one), else those the cluster at `spec.address` (or the Ray of this process) reports."""
    if not spec.address and not ray.is_initialized():
        return float(local_gpus())
    with ray_output(None, spec.verbose, owner=spec), ray_session(spec.address):  # to the ray.log of spec's run
        return float(ray.cluster_resources().get("GPU", 0))


def run(job: DistillJob, spec: ExecutionSpec, parts: JobParts | None = None) -> DistillResult:
    """The Ray door: run `job` on DistillWorker actors of the cluster at `spec.address` (or of an
    embedded local Ray; or of the Ray this process already joined, a Tune trial's placement group
    included), `spec.workers` of them with `spec.cpus_per_worker` CPUs and their GPU share as the
    spec says or, unset, as the job's device type needs (`WorkerPool.for_job`). `parts`: what
    building the job loaded in this process (the dataset is sent to the workers from it). A run
    that already holds every unit the job asks for is answered without starting Ray."""
    layout = RunLayout(job.run_dir)
    if layout.unit_ids():  # a run with finished units may need no worker at all
        try:
            with ray_output(layout.ray_log, spec.verbose, owner=spec):  # what its GPU count said, if anything
                return execute.run_job(job, _AlreadyDone(job.device_type), parts)
        except _Unfinished:
            pass
    with ray_output(layout.ray_log, spec.verbose, owner=spec), \
            ray_session(spec.address, num_gpus=None if spec.address else local_gpus()):
        pool = WorkerPool.for_job(job, spec)
        try:
            return execute.run_job(job, pool, parts)
        finally:
            pool.close()  # idempotent: also when run_job fails before executing


class _Unfinished(Exception):
    """The run lacks units of the job: they need the Ray workers."""


class _AlreadyDone:
    """The executor of a run whose units are all there: it runs nothing, and hands back to Ray
    (`_Unfinished`) the moment the plan has a unit to do."""

    parallelism = 1

    def __init__(self, device_type: str):
        self.device_type = device_type

    def execute(self, job, store, units, todo, result, parts) -> dict:
        if todo:
            raise _Unfinished
        return {"executor": "none (every unit was there)"}
