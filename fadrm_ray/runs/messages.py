"""What a distill worker answers the worker pool that drives it: one pydantic model per reply.

The worker lives in another process (a Ray actor), so its replies cross a process boundary; they
travel through Ray as these model objects and are read by attribute. The library defines them (it
never imports Ray) so that the worker, the pool and its schedule, and the ledger (`fadrm_ray.events`) share
one spelling of each field.

- `WorkerInfo`: `DistillWorker.ping`, where a worker runs and with what threads and OpenMP settings
  (the ledger's `worker_started` records it whole);
- `ClassScored`: `DistillWorker.score_class`, the ranking of one class's real patches;
- `StageRan`: `DistillWorker.run_stage` for a stage that leaves the unit unfinished (its states
  stay on that worker and in a checkpoint);
- `UnitWritten`: `DistillWorker.run_stage` for the unit's last stage, after the worker wrote the
  unit's part files.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from fadrm_ray.store.run_files import ClassSelection


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WorkerInfo(_Reply):
    """Where a worker process runs and with what (`fadrm_ray.runtime.process_info` and the worker's
    own settings)."""

    pid: int
    host: str
    device: str                  # cpu or cuda
    threads: int                 # torch threads the worker was given
    torch_threads: int           # torch threads it has
    cpus: int                    # CPUs the process may use
    omp_wait_policy: str | None  # what the process started with (None: not set)
    omp_num_threads: str | None


class ClassScored(_Reply):
    """The ranking of class `label`'s real patches, which the worker also saved in the run."""

    label: int
    selection: ClassSelection
    pid: int
    seconds: float


class StageRan(_Reply):
    """One stage of a unit ran; the unit has stages left."""

    unit_id: str
    stage: int
    pid: int
    seconds: float
    patches_scored: int  # classes the worker had to score itself (0 when the pool shared them)


class UnitWritten(StageRan):
    """The unit's last stage ran and its part files are written."""

    rows: int  # images in the unit's part files
