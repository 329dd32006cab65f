"""The coordinator: splits a run into units, schedules their stages on DistillWorker actors,
retries lost work, and finishes the run's manifest.

It runs in the driver. Its ledger is rebuilt from the store at every start (finished units from
their verified manifests, partial units from their newest stage checkpoint), so a restarted
driver recomputes only unfinished stages. Every event is also appended to `ledger.jsonl` in the
run directory, which is what tests and operators read to see what ran where.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.lifeline import Lifeline, interrupt_mark
from actors.worker import DistillWorker, RunContext, latest_checkpoints
from fadrm_ray.config import DistillConfig
from fadrm_ray.data import get_dataset
from fadrm_ray.distill import DistillResult, Unit, load_selections, needed_classes, run_job
from fadrm_ray.events import (PatchesFailed, PatchesScored, RunFinished, RunStarted, StageDone, StageFailed, UnitDone,
                              WorkerLost, WorkerStarted, append_entry)
from fadrm_ray.job import DistillJob, ExecutionSpec, JobParts, prepare_job
from fadrm_ray.messages import ClassScored, UnitWritten, WorkerInfo
from fadrm_ray.runtime import ALLOCATOR_ENV, heavy_process_env
from fadrm_ray.store import RunStore


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


@dataclass
class _Task:
    unit: Unit | None            # a stage of a unit, or
    stage: int = 0
    label: int | None = None     # the patch scoring of one class (unit None)
    attempts: int = 0

    @property
    def name(self) -> str:
        return f"patches of class {self.label}" if self.unit is None else f"unit {self.unit.unit_id} stage {self.stage}"


class Coordinator:
    """The Ray executor of `fadrm_ray.distill.run_job`: schedules a job's stages on DistillWorker
    actors, retries lost ones, and keeps the run's ledger.

    The actors start as soon as the coordinator is built, so their processes import torch while
    the driver loads the dataset and builds the job (whose config resolves for `device_type`).
    `execute()` stops them when it returns; call `close()` instead if no job is run.
    """

    def __init__(self, workers: int | None = None, cpus_per_worker: float = 1.0, gpus_per_worker: float | None = None,
                 max_attempts: int = 3, progress: bool = True, share_patches: bool = True):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.max_attempts = max_attempts
        self.progress = progress
        self.share_patches = share_patches  # False: every worker scores the classes it needs (bench.scaling)
        if gpus_per_worker is None and ray.cluster_resources().get("GPU", 0) > 0:
            self.gpus_per_worker = gpus_per_worker = 1.0  # one worker per GPU by default
        self.device = self.device_type = "cuda" if gpus_per_worker else "cpu"
        self.workers = self._start_workers(workers or self._default_workers())
        self.parallelism = len(self.workers)
        self.interrupted = lambda: False  # whether Ctrl-C came during execute() (interrupt_mark)

    @classmethod
    def from_spec(cls, spec: ExecutionSpec, **options) -> "Coordinator":
        return cls(workers=spec.workers, cpus_per_worker=spec.cpus_per_worker, gpus_per_worker=spec.gpus_per_worker,
                   progress=spec.progress, **options)

    def close(self) -> None:
        """Stop the worker actors (idempotent)."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers, self.starting = [], {}

    # ------------------------------------------------------------------ ledger
    def log(self, entry) -> None:
        append_entry(self.ledger_path, entry)

    def pending(self, units: list[Unit]) -> tuple[list[_Task], int]:
        """Tasks to run, rebuilt from the store, and the stages already done."""
        finished = self.store.finished_units()
        partial = latest_checkpoints(self.store)
        tasks, done = [], 0
        for unit in units:
            if unit.unit_id in finished:
                done += self.stages
                continue
            stage = min(partial.get(unit.unit_id, 0), self.stages - 1)
            done += stage
            tasks.append(_Task(unit, stage))
        return tasks, done

    # ------------------------------------------------------------------ workers
    def _default_workers(self) -> int:
        resources = ray.cluster_resources()
        if self.gpus_per_worker:
            return max(1, int(resources.get("GPU", 0) // self.gpus_per_worker))
        return max(1, int(resources.get("CPU", 1) // self.cpus_per_worker))

    def _start_workers(self, count: int) -> list:
        threads = max(1, int(self.cpus_per_worker))
        # Each worker process starts with the passive OpenMP policy, OpenMP threads for its CPUs and
        # the allocator settings (runtime.heavy_process_env): they must be set before torch loads.
        # A run started inside a placement group (a Tune trial's) keeps its actors in that group.
        group = get_current_placement_group()
        strategy = PlacementGroupSchedulingStrategy(group) if group is not None else "SPREAD"
        actor = ray.remote(DistillWorker).options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker or 0,
            max_restarts=3, max_task_retries=0, scheduling_strategy=strategy,
            runtime_env={"env_vars": heavy_process_env(threads)})
        workers = [actor.remote(self.device, threads, min(1.0, self.gpus_per_worker or 1.0)) for _ in range(count)]
        self.starting = {w.ping.remote(): w for w in workers}  # answered once the process is up
        return workers

    # ------------------------------------------------------------------ run
    def execute(self, job: DistillJob, store: RunStore, units: list[Unit], todo: list[Unit], result: DistillResult,
                parts: JobParts | None) -> dict:
        """Run every unfinished stage of `units` (the executor protocol of `run_job`, which holds
        the run's lock around this)."""
        try:
            with interrupt_mark() as self.interrupted:
                return self._run(job, store, units, result, parts)
        finally:
            self.close()

    def _run(self, job: DistillJob, store: RunStore, units: list[Unit], result: DistillResult,
             parts: JobParts | None) -> dict:
        from tqdm.auto import tqdm

        self.cfg, self.store, self.stages = job.config, store, job.config.k + 1
        self.ledger_path = store.layout.ledger
        started = time.perf_counter()
        tasks, done_stages = self.pending(units)
        # plan: every unit of this request with the stages it already has (progress reports read it).
        plan = {u.unit_id: self.stages for u in units}
        plan.update({t.unit.unit_id: t.stage for t in tasks})
        self.log(RunStarted(units=len(units), todo=len(tasks), stages_done=done_stages, ipc=self.cfg.ipc,
                            resumed={t.unit.unit_id: t.stage for t in tasks if t.stage > 0}, stages=self.stages,
                            plan=plan))
        workers = self.workers[:len(tasks)]
        for surplus in self.workers[len(tasks):]:  # more actors than units left to run
            ray.kill(surplus)
        if tasks:
            # One copy of job, dataset and teacher weights in the object store, read by every
            # worker; wrapped in a list so Ray passes the reference instead of resolving it per call.
            # The driver checks the dataset and the teachers' bytes against the job first.
            dataset = (parts if parts is not None else JobParts.load(job)).dataset
            self.context = [ray.put(RunContext.of(job, dataset))]
            if self.share_patches:
                self._share_patches([t.unit for t in tasks if t.stage == 0], workers, result)
            bar = tqdm(total=len(units) * self.stages, initial=done_stages, unit="stage",
                       desc=f"distill {store.run_id} ({len(workers)} workers)", disable=not self.progress)
            try:
                self._schedule(deque(tasks), workers, bar, result)
            finally:
                bar.close()
        self.log(RunFinished(seconds=time.perf_counter() - started))
        return {"executor": "ray", "device": self.device, "workers": len(workers),
                "cpus_per_worker": self.cpus_per_worker, "gpus_per_worker": self.gpus_per_worker}

    def _share_patches(self, units: list[Unit], workers: list, result: DistillResult) -> None:
        """Score each class the units need once, one task per class on the workers (the run keeps
        what it scored before), and add the rankings to the context every stage receives."""
        labels = needed_classes(units, self.cfg)
        if not labels:
            return
        self.selections = load_selections(self.store.layout, labels)
        todo = [_Task(None, label=label) for label in labels if label not in self.selections]
        if todo:
            self._schedule(deque(todo), workers, None, result)
        self.context = [self.context[0], ray.put(self.selections)]

    def _submit(self, worker, task: _Task):
        if task.unit is None:
            return worker.score_class.remote(task.label, self.context)
        return worker.run_stage.remote(task.unit, task.stage, self.context)

    def _schedule(self, queue: deque, workers: list, bar, result: DistillResult) -> None:
        idle = deque(workers)
        inflight: dict = {}    # ObjectRef -> (worker, task)
        probes: dict = {}      # ObjectRef of a ping -> worker that failed a task
        starting = {ref: w for ref, w in self.starting.items() if w in workers}
        while queue or inflight:
            while queue and idle:
                worker, task = idle.popleft(), queue.popleft()
                inflight[self._submit(worker, task)] = (worker, task)
            if not inflight and not probes:
                raise RuntimeError(f"no distill worker is left alive; see {self.ledger_path}")
            ready, _ = ray.wait(list(starting) + list(inflight) + list(probes), num_returns=1, timeout=1.0)
            if self.interrupted():  # Ctrl-C, even where Ray dropped its KeyboardInterrupt (run())
                raise KeyboardInterrupt
            for ref in ready:
                if ref in starting:  # a worker's first answer: record where it runs
                    worker = starting.pop(ref)
                    self.starting.pop(ref, None)
                    try:
                        info: WorkerInfo = ray.get(ref)
                        self.log(WorkerStarted(worker=worker._actor_id.hex(), **info.model_dump()))
                    except RayActorError as exc:
                        self.log(WorkerLost(worker=worker._actor_id.hex(), message=str(exc)[:500]))
                    continue
                if ref in probes:  # a worker that failed answers again: it restarted
                    worker = probes.pop(ref)
                    try:
                        ray.get(ref)
                        idle.append(worker)
                    except RayActorError as exc:
                        self.log(WorkerLost(worker=worker._actor_id.hex(), message=str(exc)[:500]))
                    continue
                worker, task = inflight.pop(ref)
                try:
                    reply = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    task.attempts += 1
                    failed = dict(attempt=task.attempts, worker=worker._actor_id.hex(), error=type(exc).__name__,
                                  message=str(exc)[:500])
                    self.log(PatchesFailed(label=task.label, **failed) if task.unit is None else
                             StageFailed(unit=task.unit.unit_id, stage=task.stage, **failed))
                    if task.attempts >= self.max_attempts:
                        raise RuntimeError(f"{task.name} failed {task.attempts} times; "
                                           f"last error: {str(exc).splitlines()[0]}") from exc
                    queue.appendleft(task)  # from its last checkpoint, on whichever worker is free
                    if isinstance(exc, RayActorError):
                        probes[worker.ping.remote()] = worker
                    else:
                        idle.append(worker)
                    continue
                if isinstance(reply, ClassScored):
                    self.selections[reply.label] = reply.selection
                    self.log(PatchesScored(label=reply.label, pid=reply.pid, seconds=reply.seconds))
                    idle.append(worker)
                    continue
                bar.update(1)
                self.log(StageDone(unit=reply.unit_id, stage=reply.stage, pid=reply.pid, seconds=reply.seconds,
                                   patches_scored=reply.patches_scored))
                if isinstance(reply, UnitWritten):
                    self.log(UnitDone(unit=reply.unit_id, rows=reply.rows, pid=reply.pid))
                    result.units_run.append(task.unit.unit_id)
                    idle.append(worker)
                else:  # the worker holds the unit's states in memory: keep the unit there
                    following = _Task(task.unit, task.stage + 1)
                    inflight[self._submit(worker, following)] = (worker, following)


def distill_on_ray(cfg: DistillConfig, dataset_spec: str, teacher_paths: Sequence[str | Path],
                   out_root: str | Path, spec: ExecutionSpec | None = None, **options) -> DistillResult:
    """Build the job of `cfg` and run it through Ray: on the cluster at `spec.address`, or on an
    embedded local Ray (`options` go to the Coordinator)."""
    spec = spec or ExecutionSpec()
    with ray_session(spec.address):
        coordinator = Coordinator.from_spec(spec, **options)
        try:
            # The driver checks the teachers on its CPU; the config resolves for the workers' device.
            job, parts = prepare_job(cfg, get_dataset(dataset_spec, root=spec.data_root), dataset_spec, teacher_paths,
                                     out_root, device="cpu", device_type=coordinator.device_type,
                                     data_root=spec.data_root)
            return run_job(job, coordinator, parts)
        finally:
            coordinator.close()  # idempotent: also when run_job fails before executing


def run_on_ray(job: DistillJob, spec: ExecutionSpec) -> DistillResult:
    """Run a job built elsewhere (a service request) through Ray."""
    with ray_session(spec.address):
        coordinator = Coordinator.from_spec(spec)
        try:
            return run_job(job, coordinator)
        finally:
            coordinator.close()
