"""The pool of DistillWorker actors: the Ray executor of `fadrm_ray.runs.execute.run_job`.

A `WorkerPool` starts its actors as soon as it is built (in the caller's placement group, a Tune
trial's, or spread over the cluster). `execute` runs one job's pending stages on them: it keeps
the run's state in a `RunSchedule` (`actors.schedule`: the run's tasks, context, patch rankings
and ledger) and drives it; `dispatch` is the loop that hands the schedule's tasks to idle actors,
retries a task lost with its actor or node on whichever actor is free (from the unit's last
stage checkpoint), and takes back an actor that Ray restarted. Calls go one way: the pool calls
the schedule, never the reverse. The pool stops its actors when `execute` returns; call
`close()` instead if no job is run.
"""
from __future__ import annotations

from collections import deque

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.lifeline import interrupt_mark
from actors.schedule import RunSchedule, Task, actor_name
from actors.worker import DistillWorker
from fadrm_ray.runs.execute import DistillResult
from fadrm_ray.runs.units import Unit
from fadrm_ray.errors import InputError
from fadrm_ray.events import WorkerLost, WorkerStarted
from fadrm_ray.runs.job import DistillJob, ExecutionSpec, JobParts
from fadrm_ray.runs.messages import WorkerInfo
from fadrm_ray.runtime import heavy_process_env
from fadrm_ray.store import RunStore


def gpu_share(gpus_per_worker: float | None) -> float | None:
    """The GPU share of one worker on the connected cluster: as asked, or where unset one GPU
    per worker when the cluster has GPUs (none otherwise)."""
    if gpus_per_worker is None and ray.cluster_resources().get("GPU", 0) > 0:
        return 1.0
    return gpus_per_worker


class WorkerPool:
    """DistillWorker actors with their resources, and the retries of lost work (module docstring)."""

    def __init__(self, workers: int | None = None, cpus_per_worker: float = 1.0, gpus_per_worker: float | None = None,
                 max_attempts: int = 3, progress: bool = True, share_patches: bool = True):
        if workers is not None and workers < 1:
            raise InputError(f"workers must be >= 1, got {workers}")
        gpus_per_worker = gpu_share(gpus_per_worker)
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.max_attempts = max_attempts      # attempts of one task before the run fails
        self.progress = progress
        self.share_patches = share_patches    # False: every worker scores the classes it needs (bench.speed.scaling)
        self.device = self.device_type = "cuda" if gpus_per_worker else "cpu"
        self.workers: list = self._start_workers(workers or self._default_workers())
        self.parallelism = len(self.workers)
        # each actor's first ping, answered once its process is up (the ledger's worker_started)
        self.starting: dict = {worker.ping.remote(): worker for worker in self.workers}

    @classmethod
    def for_job(cls, job: DistillJob, spec: ExecutionSpec, **options) -> "WorkerPool":
        """The pool `spec` asks for, to run `job`: its GPU share as the spec says or, unset, one
        GPU per worker for a job built for cuda (where the cluster has GPUs) and none for a job
        built for the CPU. `options` go to the pool (max_attempts, share_patches)."""
        gpus = spec.gpus_per_worker
        if gpus is None and job.device_type != "cuda":
            gpus = 0.0
        return cls(workers=spec.workers, cpus_per_worker=spec.cpus_per_worker, gpus_per_worker=gpus,
                   progress=spec.progress, **options)

    def close(self) -> None:
        """Stop the worker actors (idempotent)."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers, self.starting = [], {}

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
        return [actor.remote(self.device, threads, min(1.0, self.gpus_per_worker or 1.0)) for _ in range(count)]

    # ------------------------------------------------------------------ the executor protocol
    def execute(self, job: DistillJob, store: RunStore, units: list[Unit], todo: list[Unit], result: DistillResult,
                parts: JobParts | None) -> dict:
        """Run every unfinished stage of `units` (the executor protocol of `run_job`, which holds
        the run's lock around this)."""
        try:
            with interrupt_mark() as interrupted:
                run = RunSchedule(job, store, units, result, interrupted)
                workers = self.workers[:len(run.tasks)]
                for surplus in self.workers[len(run.tasks):]:  # more actors than units left to run
                    ray.kill(surplus)
                self._run(run, workers, parts)
        finally:
            self.close()
        return {"executor": "ray", "device": self.device, "workers": len(workers),
                "cpus_per_worker": self.cpus_per_worker, "gpus_per_worker": self.gpus_per_worker}

    def _run(self, run: RunSchedule, workers: list, parts: JobParts | None) -> None:
        """Every pending task of `run` on `workers`, between the ledger's `run_started` and
        `run_finished`: the classes' patch scoring first (one task per class, the rankings then
        shared with every stage), then the units' stages."""
        run.log_started()
        run.workers = len(workers)
        if run.tasks:
            run.share_context(parts)
            if self.share_patches:
                scoring = run.patch_tasks()
                if scoring is not None:
                    if scoring:
                        self.dispatch(run, deque(scoring), workers)
                    run.share_selections()
            with run.progress_bar(len(workers), self.progress):
                self.dispatch(run, deque(run.tasks), workers)
        run.log_finished()

    # ------------------------------------------------------------------ the loop
    def dispatch(self, run: RunSchedule, queue: deque[Task], workers: list) -> None:
        """Run the tasks of `queue` on `workers` until none is left, retrying failed ones."""
        idle = deque(workers)
        inflight: dict = {}    # ObjectRef -> (worker, task)
        probes: dict = {}      # ObjectRef of a ping -> worker that failed a task
        starting = {ref: w for ref, w in self.starting.items() if w in workers}
        while queue or inflight:
            while queue and idle:
                worker, task = idle.popleft(), queue.popleft()
                inflight[run.submit(worker, task)] = (worker, task)
            if not inflight and not probes:
                raise RuntimeError(f"no distill worker is left alive; see {run.ledger_path}")
            ready, _ = ray.wait(list(starting) + list(inflight) + list(probes), num_returns=1, timeout=1.0)
            if run.interrupted():  # Ctrl-C, even where Ray dropped its KeyboardInterrupt (run())
                raise KeyboardInterrupt
            for ref in ready:
                if ref in starting:  # a worker's first answer: record where it runs
                    self.starting.pop(ref, None)
                    self._started(run, ref, starting.pop(ref))
                elif ref in probes:  # a worker that failed answers again: it restarted
                    worker = probes.pop(ref)
                    try:
                        ray.get(ref)
                        idle.append(worker)
                        run.worker_back(worker)
                    except RayActorError as exc:
                        run.log(WorkerLost(worker=actor_name(worker), message=str(exc)[:500]))
                else:
                    worker, task = inflight.pop(ref)
                    try:
                        reply = ray.get(ref)
                    except (RayActorError, RayTaskError) as exc:
                        self._failed(run, worker, task, exc, queue, idle, probes)
                        continue
                    following = run.done(task, reply)
                    if following is None:
                        idle.append(worker)
                    else:  # the worker holds the unit's states in memory: keep the unit there
                        inflight[run.submit(worker, following)] = (worker, following)

    @staticmethod
    def _started(run: RunSchedule, ref, worker) -> None:
        try:
            info: WorkerInfo = ray.get(ref)
        except RayActorError as exc:
            run.log(WorkerLost(worker=actor_name(worker), message=str(exc)[:500]))
            run.worker_lost(worker, None, exc)
            return
        run.log(WorkerStarted(worker=actor_name(worker), **info.model_dump()))

    def _failed(self, run: RunSchedule, worker, task: Task, exc: Exception, queue: deque, idle: deque,
                probes: dict) -> None:
        """Log a failed attempt and queue the task again (from its last checkpoint, on whichever
        worker is free), or fail the run after `max_attempts`."""
        task.attempts += 1
        run.log(task.failure(worker, exc))
        if task.attempts >= self.max_attempts:
            raise RuntimeError(f"{task.name} failed {task.attempts} times; "
                               f"last error: {str(exc).splitlines()[0]}") from exc
        queue.appendleft(task)
        if isinstance(exc, RayActorError):  # its process or node is gone: said once, counted out
            run.worker_lost(worker, task, exc)
            probes[worker.ping.remote()] = worker  # answered once Ray restarted the actor
        else:
            idle.append(worker)
