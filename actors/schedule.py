"""One run's scheduling state on the worker pool: its tasks, its run context in the object store,
the classes' shared patch rankings, its ledger and its progress bar.

A `RunSchedule` lives for one `WorkerPool.execute` (one request of `run_job`). It rebuilds what is
left to do from the store (finished units from their verified manifests, partial units from their
newest stage checkpoint), so a restarted driver recomputes only unfinished stages, and appends
every event to the run's ledger (`ledger.jsonl`, typed in `fadrm_ray.events`), which is what the
service's progress, the benchmarks, tests and operators read to see what ran where. The pool
(`actors.pool`) owns the schedule and drives it: it runs the schedule's tasks on the actors and
retries lost ones; the schedule says what each task is and what a reply means, and never calls
the pool.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Callable

import ray

from actors.worker import RunContext
from fadrm_ray.runs.execute import DistillResult
from fadrm_ray.runs.stages import needed_classes
from fadrm_ray.store.checkpoints import latest_checkpoints
from fadrm_ray.store.selections import kept_selections
from fadrm_ray.runs.units import Unit
from fadrm_ray.events import (LedgerEntry, PatchesFailed, PatchesScored, RunFinished, RunStarted, StageDone, StageFailed,
                              UnitDone, append_entry)
from fadrm_ray.runs.job import DistillJob, JobParts
from fadrm_ray.runs.messages import ClassScored, StageRan, UnitWritten
from fadrm_ray.store.run_files import ClassSelection
from fadrm_ray.store import RunStore


def actor_name(worker) -> str:
    """The id of a worker actor, as the ledger names it."""
    return worker._actor_id.hex()


@dataclass
class Task:
    """A stage of a unit, or (unit None) the patch scoring of class `label`."""

    unit: Unit | None
    stage: int = 0
    label: int | None = None
    attempts: int = 0

    @property
    def name(self) -> str:
        return f"patches of class {self.label}" if self.unit is None else f"unit {self.unit.unit_id} stage {self.stage}"

    def failure(self, worker, exc: Exception) -> PatchesFailed | StageFailed:
        """The ledger entry of this task's latest failed attempt on `worker`."""
        worker_id, error, message = actor_name(worker), type(exc).__name__, str(exc)[:500]
        if self.unit is None:
            return PatchesFailed(label=self.label, attempt=self.attempts, worker=worker_id, error=error,
                                 message=message)
        return StageFailed(unit=self.unit.unit_id, stage=self.stage, attempt=self.attempts, worker=worker_id,
                           error=error, message=message)


class RunSchedule:
    """The scheduling state of one run of a job on the pool (module docstring)."""

    def __init__(self, job: DistillJob, store: RunStore, units: list[Unit], result: DistillResult,
                 interrupted: Callable[[], bool]):
        self.job = job
        self.cfg = job.config
        self.store = store
        self.units = units                    # every unit of this request
        self.result = result                  # units_run grows as units finish
        self.interrupted = interrupted        # whether Ctrl-C came during the run (interrupt_mark)
        self.started = time.perf_counter()    # reset by log_started
        self.stages = self.cfg.k + 1
        self.ledger_path = store.layout.ledger
        self.tasks, self.stages_done = self._pending(units)
        self.context: list = []               # [ref of the RunContext] and, once shared, [.., ref of the rankings]
        self.selections: dict[int, ClassSelection] = {}  # class -> its patch ranking, shared with every stage
        self.bar = None                       # the progress bar of the stages, while they run
        self.workers = 0                      # the actors the run was given (set by progress_bar)
        self.lost: set[str] = set()           # those lost and not back, by actor id (worker_lost)

    def log(self, entry: LedgerEntry) -> None:
        append_entry(self.ledger_path, entry)

    def _pending(self, units: list[Unit]) -> tuple[list[Task], int]:
        """Tasks to run, rebuilt from the store, and the stages already done."""
        finished = self.store.finished_units()
        partial = latest_checkpoints(self.store.layout)
        tasks, done = [], 0
        for unit in units:
            if unit.unit_id in finished:
                done += self.stages
                continue
            stage = min(partial.get(unit.unit_id, 0), self.stages - 1)
            done += stage
            tasks.append(Task(unit, stage))
        return tasks, done

    # ------------------------------------------------------------------ the run, as the pool drives it
    def log_started(self) -> None:
        """The ledger's `run_started`: every unit of this request with the stages it already has
        (progress reports read it)."""
        self.started = time.perf_counter()
        plan = {u.unit_id: self.stages for u in self.units}
        plan.update({t.unit.unit_id: t.stage for t in self.tasks})
        self.log(RunStarted(units=len(self.units), todo=len(self.tasks), stages_done=self.stages_done,
                            ipc=self.cfg.ipc, resumed={t.unit.unit_id: t.stage for t in self.tasks if t.stage > 0},
                            stages=self.stages, plan=plan))

    def log_finished(self) -> None:
        self.log(RunFinished(seconds=time.perf_counter() - self.started))

    def share_context(self, parts: JobParts | None) -> None:
        """One copy of job, dataset and teacher weights in the object store, read by every worker;
        wrapped in a list so Ray passes the reference instead of resolving it per call. The
        driver checks the dataset and the teachers' bytes against the job first."""
        dataset = (parts if parts is not None else JobParts.load(self.job)).dataset
        self.context = [ray.put(RunContext.of(self.job, dataset))]

    def patch_tasks(self) -> list[Task] | None:
        """The scoring tasks of the classes the new units need whose rankings the run does not
        keep yet (one per class; the rankings it keeps are loaded), or None when no new unit
        needs patches."""
        labels = needed_classes([t.unit for t in self.tasks if t.stage == 0], self.cfg)
        if not labels:
            return None
        self.selections = kept_selections(self.store.layout, labels)
        return [Task(None, label=label) for label in labels if label not in self.selections]

    def share_selections(self) -> None:
        """Add the classes' patch rankings to the context every stage receives."""
        self.context = [self.context[0], ray.put(self.selections)]

    @contextlib.contextmanager
    def progress_bar(self, workers: int, progress: bool = True):
        """The progress bar of the stages, while they run on `workers` actors (its count is of the
        workers alive: `worker_lost`, `worker_back`)."""
        from tqdm.auto import tqdm

        self.workers = workers
        self.bar = tqdm(total=len(self.units) * self.stages, initial=self.stages_done, unit="stage",
                        desc=self._desc(), disable=not progress)
        try:
            yield self.bar
        finally:
            self.bar.close()
            self.bar = None

    def _desc(self) -> str:
        alive = self.workers - len(self.lost)
        return f"distill {self.store.run_id} ({alive} worker{'' if alive == 1 else 's'})"

    def worker_lost(self, worker, task: Task | None, exc: Exception) -> None:
        """Say once, in one line, that `worker` was lost (its process or node gone) and which unit
        runs again; the bar counts one worker less until it is back (`worker_back`)."""
        name = actor_name(worker)
        if name in self.lost:
            return
        self.lost.add(name)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        again = f"; {task.name} runs again from its last stage checkpoint on a worker left" if task else ""
        alive = max(0, self.workers - len(self.lost)) if self.workers else None
        left = f" ({alive} of {self.workers} workers left)" if alive is not None else ""
        self.say(f"a distill worker was lost ({type(exc).__name__}: {reason}){again}{left}")
        if self.bar is not None:
            self.bar.set_description_str(self._desc())

    def worker_back(self, worker) -> None:
        """`worker`, lost before, answers again (Ray restarted it): the bar counts it again."""
        self.lost.discard(actor_name(worker))
        if self.bar is not None:
            self.bar.set_description_str(self._desc())

    def say(self, line: str) -> None:
        """One line for the user on stderr, above the progress bar where one is shown."""
        from tqdm.auto import tqdm

        tqdm.write(f"fadrm: {line}", file=sys.stderr)

    # ------------------------------------------------------------------ tasks
    def submit(self, worker, task: Task):
        """Start `task` on `worker`; the reference of its reply."""
        if task.unit is None:
            return worker.score_class.remote(task.label, self.context)
        return worker.run_stage.remote(task.unit, task.stage, self.context)

    def done(self, task: Task, reply: ClassScored | StageRan) -> Task | None:
        """Record what a worker answered; the unit's next stage, which stays on that worker (it
        holds the unit's states in memory), or None."""
        if isinstance(reply, ClassScored):
            self.selections[reply.label] = reply.selection
            self.log(PatchesScored(label=reply.label, pid=reply.pid, seconds=reply.seconds))
            return None
        if self.bar is not None:
            self.bar.update(1)
        self.log(StageDone(unit=reply.unit_id, stage=reply.stage, pid=reply.pid, seconds=reply.seconds,
                           patches_scored=reply.patches_scored))
        if isinstance(reply, UnitWritten):
            self.log(UnitDone(unit=reply.unit_id, rows=reply.rows, pid=reply.pid))
            self.result.units_run.append(reply.unit_id)
            return None
        return Task(task.unit, task.stage + 1)
