"""Running a job: one door, `run(job, spec, parts=None)`, whichever executor the spec names.

A job is built once (`runs.job.build_job` / `prepare_job`), for the device type of the door that
runs it (`device_type(spec)`), and handed to the door whole with its `ExecutionSpec`. This module
is the library's door: `run` runs the job in this process (`fadrm distill --local`, the demo, a
Tune trial, the benchmarks). `actors.coordinator` is the Ray door, with the same two functions
(`Door`); the library never imports it, so the `fadrm` command is given it (actors/cli.py).
`distill` builds the job for a door and runs it through that door, in one call.

Behind both doors, `run_job` holds the run's lock, plans the units around those the run has,
hands the rest to an executor and finishes the manifest: `LocalExecutor` here, the Ray layer's
`actors.pool.WorkerPool` there.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Protocol, Sequence

import torch
from pydantic import BaseModel, Field

from fadrm_ray import __version__
from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.layout import RunLayout
from fadrm_ray.runs.job import DistillJob, ExecutionSpec, JobParts, prepare_job
from fadrm_ray.runs.stages import distill_unit, frozen_teachers, prepare_patches
from fadrm_ray.runs.units import Unit, checkpointed_units, plan_units, request_images, steps_of
from fadrm_ray.runtime import resolve_device, tune_allocator
from fadrm_ray.store import RunStore, StoreError
from fadrm_ray.store.manifests import read_config
from fadrm_ray.store.run_files import RecordedDataset, RunProvenance


class DistillResult(BaseModel):
    """What running a job did (`run_job`)."""

    run_id: str
    run_dir: Path
    images: int                  # images of this request: every class at IPC indices [0, ipc)
    units_run: list[str] = Field(default_factory=list)
    units_skipped: list[str] = Field(default_factory=list)
    seconds: float = 0.0
    ipc: int | None = None       # the IPC asked for; read the run at it with open_run(run_dir, ipc=ipc)
    recipe: str | None = None    # where the config's "auto" values came from, and why (DistillJob.recipe)
    waited_seconds: float = 0.0  # for another process writing the run (its lock), before this one planned

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def run_config(cfg: DistillConfig, layout: RunLayout) -> DistillConfig:
    """What config.yaml records: this request's resolved config, with `ipc` the largest IPC the
    run has been asked for (the images present are what the manifests list)."""
    try:
        saved = read_config(layout)
    except StoreError:
        saved = None
    return cfg.model_copy(update={"ipc": max(cfg.ipc, saved.ipc) if saved is not None else cfg.ipc})


def provenance(job: DistillJob, dataset: ImageDataset) -> RunProvenance:
    """What every part file records about how it was made: the dataset with the spec that
    reopens it and the teachers with their sha256, by the job's absolute paths
    (`job.build_job`), so `fadrm evaluate` and `fadrm verify --repair` find them from any
    directory."""
    described = {k: v for k, v in dataset.describe().items() if k != "class_names"}
    return RunProvenance(
        run_id=job.run_id, config=job.config, dataset=RecordedDataset(**described, spec=job.dataset_spec),
        class_map=dict(enumerate(dataset.class_names)), teachers=list(job.teachers), seed=job.config.seed,
        code_version=__version__, pilot=job.pilot, recipe_given=job.recipe_given, device_type=job.device_type)


class RunExecutor(Protocol):
    """Runs the units of a job: `LocalExecutor` in this process, `actors.pool.WorkerPool` on Ray
    actors. `run_job` owns everything else (the lock, the plan, the manifest)."""

    parallelism: int      # workers: units are cut so that each gets work (plan_units)
    device_type: str      # what the job's config must be resolved for

    def execute(self, job: DistillJob, store: RunStore, units: list[Unit], todo: list[Unit], result: DistillResult,
                parts: JobParts | None) -> dict:
        """Run `todo` (of the request's `units`), appending each finished unit to
        `result.units_run`; returns what the run manifest records about the execution."""
        ...


def run_job(job: DistillJob, executor: RunExecutor, parts: JobParts | None = None) -> DistillResult:
    """Run a job as the run's only writer: hold the run's lock (`RunStore.session`; a second
    writer waits here, then finds the units done), plan the units around those the run has,
    execute the rest, finish the manifest. `parts`: what building the job loaded in this process."""
    if job.device_type != executor.device_type:
        raise ValueError(f"the job was resolved for {job.device_type}, but this executor runs on "
                         f"{executor.device_type}")
    tune_allocator()
    started = time.perf_counter()
    cfg = job.config
    store = RunStore(job.store, job.run_id)
    with store.session(run_config(cfg, store.layout)):
        waited = time.perf_counter() - started
        # Planned after the lock: a writer we waited for may have added units, or done them all.
        done = store.finished_units()
        units = plan_units(cfg, job.num_classes, image_size=job.image_size, workers=executor.parallelism,
                           finished=list(done), partial=checkpointed_units(store.layout),
                           device_type=executor.device_type)
        todo = [u for u in units if u.unit_id not in done]
        result = DistillResult(run_id=job.run_id, run_dir=store.run_dir, images=request_images(cfg, job.num_classes),
                               units_skipped=[u.unit_id for u in units if u.unit_id in done], ipc=cfg.ipc,
                               recipe=job.recipe, waited_seconds=round(waited, 1) if waited >= 1 else 0.0)
        stats = executor.execute(job, store, units, todo, result, parts)
        result.seconds = time.perf_counter() - started
        if result.units_run or not store.is_complete():
            store.finalize({"seconds": result.seconds, "ipc": cfg.ipc, **stats})
    return result


class LocalExecutor:
    """Every unit in this process, one after another (`fadrm distill --local`, a Tune trial)."""

    parallelism = 1

    def __init__(self, device: str | None = None, progress: bool = True):
        self.device = resolve_device(device)
        self.device_type = torch.device(self.device).type
        self.progress = progress

    def execute(self, job: DistillJob, store: RunStore, units: list[Unit], todo: list[Unit], result: DistillResult,
                parts: JobParts | None) -> dict:
        from tqdm.auto import tqdm

        parts = (parts or JobParts.load(job, self.device)).on(self.device)
        cfg, dataset = job.config, parts.dataset
        teachers = frozen_teachers(parts, cfg)
        prov = provenance(job, dataset)
        # Every class's patches are scored once, before any unit, and kept in the run.
        cache, scored_now, patch_seconds = prepare_patches(store, todo, cfg, dataset, teachers, self.device)
        steps = steps_of(todo, cfg)
        with tqdm(total=steps, desc=f"distill {store.run_id}", unit="batch-it",
                  disable=not self.progress or steps == 0) as bar:
            for unit in todo:
                records, stats = distill_unit(unit, cfg, dataset, teachers, self.device, bar.update, cache)
                store.write_unit(unit.unit_id, records, dataset.class_names, prov, stats)
                result.units_run.append(unit.unit_id)
        return {"executor": "local", "device": self.device, "threads": torch.get_num_threads(), "pid": os.getpid(),
                "patch_seconds": patch_seconds, "patches_scored": len(scored_now)}


class Door(Protocol):
    """Where a job runs, one signature for all: this module (this process) or `actors.coordinator`
    (Ray actors). Build the job for `device_type(spec)`, then `run(job, spec, parts)`."""

    def device_type(self, spec: ExecutionSpec) -> str:
        """The device type a job must be resolved for to run through this door with `spec`."""
        ...

    def run(self, job: DistillJob, spec: ExecutionSpec, parts: JobParts | None = None) -> DistillResult:
        """Run `job` as `spec` says; `parts`: what building the job loaded in this process."""
        ...


def device_type(spec: ExecutionSpec) -> str:
    """The device type of a run in this process: `spec.device`'s (default: cuda when torch sees a GPU)."""
    return torch.device(resolve_device(spec.device)).type


def run(job: DistillJob, spec: ExecutionSpec, parts: JobParts | None = None) -> DistillResult:
    """The library's door: run `job` in this process, on `spec.device` (default: the device type
    the job was built for), with a progress bar unless `spec.progress` is off. Torch threads are
    the caller's (the `fadrm` command sets `--threads` once for the whole command)."""
    return run_job(job, LocalExecutor(spec.device or job.device_type, spec.progress), parts)


def distill(cfg: DistillConfig, dataset: ImageDataset, dataset_spec: str, teacher_paths: Sequence[str | Path],
            store: str | Path, spec: ExecutionSpec | None = None, door: Door | None = None) -> DistillResult:
    """One distillation in one call: the job built for `door` (`prepare_job`, for the door's device
    type) and run through it with `spec` (default: the door's defaults). `door`: None for this
    module's `run` (in this process), or another with the same two functions (`actors.coordinator`,
    on Ray)."""
    spec = spec or ExecutionSpec(local=door is None)
    job, parts = prepare_job(cfg, dataset, dataset_spec, teacher_paths, store,
                             device_type=(door.device_type if door else device_type)(spec), data_root=spec.data_root)
    return (door.run if door else run)(job, spec, parts)
