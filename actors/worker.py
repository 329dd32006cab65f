"""DistillWorker: a Ray actor that owns frozen teachers and runs recover one stage at a time.

The actor is a plain class; `actors.pool` wraps it with `ray.remote` and the resource options of
the run. Its constructor only sets up the process (threads, allocator), so actors can
start while the driver is still planning. Everything a run needs (resolved config, dataset,
teacher weights, store location, provenance) is one `RunContext` in the object store, the *run
context*; its reference rides along with every call, and the worker unpacks it once, so a
restarted actor simply unpacks it again on its next call. Then it runs stages of units: stage 0
selects the unit's patches and builds its recover states, every stage ends with a checkpoint of
the unit's states in the run (`store.checkpoints`: a lost worker costs at most one stage), and the last stage
writes the unit's part files itself; only small manifests travel back.

Before any stage, the pool has each class's real patches scored once (`score_class`, one task
per class, spread over the workers) and sends the rankings to every worker in a second
object-store reference beside the run context, so no worker scores a class another one did.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import ray
import torch

from fadrm_ray.data.base import ImageDataset
from fadrm_ray.runs.execute import provenance
from fadrm_ray.runs.stages import (checkpoint_of, frozen_teachers, run_unit_stage, states_of, unit_records,
                                  unit_states, unit_stats)
from fadrm_ray.runs.units import Unit
from fadrm_ray.runs.job import DistillJob, JobParts, teacher_blobs
from fadrm_ray.runs.messages import ClassScored, StageRan, UnitWritten, WorkerInfo
from fadrm_ray.models import load_teacher
from fadrm_ray.patches import score_class
from fadrm_ray.recover import RecoverState
from fadrm_ray.runtime import process_info, tune_allocator
from fadrm_ray.store import RunStore
from fadrm_ray.store.checkpoints import drop_checkpoints, load_checkpoint, save_checkpoint
from fadrm_ray.store.selections import keep_selection
from fadrm_ray.store.run_files import RunProvenance


@dataclass(frozen=True)
class RunContext:
    """What every worker needs for one run, as one picklable object (put once, read by all):
    the job, its dataset, the provenance its part files record and the teachers' bytes (a node
    need not see the driver's files)."""

    job: DistillJob
    dataset: ImageDataset
    provenance: RunProvenance
    teacher_blobs: tuple[bytes, ...]

    @classmethod
    def of(cls, job: DistillJob, dataset: ImageDataset) -> "RunContext":
        return cls(job, dataset, provenance(job, dataset), teacher_blobs(job))


class DistillWorker:
    def __init__(self, device: str = "cpu", num_threads: int = 1, gpu_share: float = 1.0):
        tune_allocator()
        self.device = device
        self.num_threads = max(1, int(num_threads))
        self.gpu_share = gpu_share  # of one GPU, for the memory budget of automatic packing
        torch.set_num_threads(self.num_threads)
        self.context_key: str | None = None
        self.selections_key: str | None = None
        self.live: dict[str, list[RecoverState]] = {}  # states of units this worker is carrying

    def _enter(self, context: list) -> None:
        """Unpack the run context once per actor life (`context` is [ObjectRef] or, once the
        patches are scored, [ObjectRef, ObjectRef of the selections], kept unresolved)."""
        self._enter_run(context[0])
        if len(context) > 1 and context[1].hex() != self.selections_key:
            self.patch_cache.update(ray.get(context[1]))
            self.selections_key = context[1].hex()

    def _enter_run(self, ref) -> None:
        key = ref.hex()
        if key == self.context_key:
            return
        ctx: RunContext = ray.get(ref)
        self.cfg = ctx.job.config
        self.dataset = ctx.dataset
        self.store = RunStore(ctx.job.store, ctx.job.run_id)
        self.provenance = ctx.provenance
        loaded = [load_teacher(ref.path, self.device, blob=blob) for ref, blob in zip(ctx.job.teachers, ctx.teacher_blobs)]
        parts = JobParts.of(self.dataset, loaded, self.device)
        self.dataset = parts.dataset  # normalized as the teachers expect
        self.teachers = frozen_teachers(parts, self.cfg)
        self.patch_cache: dict = {}
        self.live = {}
        self.context_key, self.selections_key = key, None

    def ping(self) -> WorkerInfo:
        """Where this worker runs and with what (threads and OpenMP settings it started with)."""
        return WorkerInfo.model_validate({**process_info(), "host": socket.gethostname(), "device": self.device,
                                          "threads": self.num_threads})

    def score_class(self, label: int, context: list) -> ClassScored:
        """Score the real patches of class `label` for the run, keep the ranking in the run, and
        return it (small: ranked indices and crop boxes) for the pool to share with every worker."""
        torch.set_num_threads(self.num_threads)
        self._enter(context)
        started = time.perf_counter()
        selection = score_class(self.dataset, label, self.cfg, self.teachers, self.device)
        keep_selection(self.store.layout, selection)
        self.patch_cache[label] = selection
        return ClassScored(label=label, selection=selection, pid=os.getpid(), seconds=time.perf_counter() - started)

    def run_stage(self, unit: Unit, stage: int, context: list) -> StageRan:
        """Run stage `stage` of `unit` (from the checkpoint of stage - 1 unless this worker holds it):
        `UnitWritten` once the unit's last stage wrote its part files, else `StageRan`."""
        torch.set_num_threads(self.num_threads)  # a reused worker process may have another count
        self._enter(context)
        started = time.perf_counter()
        states = self.live.pop(unit.unit_id, None)
        known = len(self.patch_cache)
        if states is None or states[0].stage != stage:
            if stage == 0:
                states = unit_states(unit, self.cfg, self.dataset, self.teachers, self.device, self.patch_cache,
                                     self.gpu_share)
            else:
                states = states_of(*load_checkpoint(self.store.layout, unit.unit_id, stage))
        run_unit_stage(states, self.teachers, self.cfg, self.device)
        seconds = time.perf_counter() - started
        ran = {"unit_id": unit.unit_id, "stage": stage, "pid": os.getpid(), "seconds": seconds,
               "patches_scored": len(self.patch_cache) - known}
        if states[0].done:
            records, packs = unit_records(unit, states, self.teachers, self.device)
            stats = unit_stats(unit, packs, self.device, seconds, worker_pid=os.getpid())
            manifest = self.store.write_unit(unit.unit_id, records, self.dataset.class_names, self.provenance, stats)
            drop_checkpoints(self.store.layout, unit.unit_id)
            return UnitWritten(**ran, rows=manifest.rows)
        save_checkpoint(self.store.layout, *checkpoint_of(unit.unit_id, states))
        self.live[unit.unit_id] = states
        return StageRan(**ran)
