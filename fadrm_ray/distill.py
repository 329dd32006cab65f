"""Distill: cut a run into units, recover each unit, write it to the store.

`distill_unit` is the one function every executor calls: this module's in-process loop
(`fadrm distill --local`), a Ray actor, or a Tune trial. A unit is a class shard (one batch =
one image per class) times a range of IPC indices; its result depends only on the config,
the dataset, the teachers and the seed, so units can run anywhere, in any order, and a
finished unit found in the store is never recomputed.

A run is identified by what decides its pixels (`DistillConfig.identity`: not the IPC, not the
speed settings), so asking the same run for a larger IPC adds units for the missing IPC indices
only, and a smaller IPC is read from the units already there (`open_run(run_dir, ipc=...)`).
`plan_units` plans around the units a run already has, finished or checkpointed, so a unit
never overlaps another whatever block sizes earlier requests used.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
from pydantic import BaseModel, Field

from fadrm_ray import __version__
from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.job import DistillJob, JobParts, prepare_job
from fadrm_ray.models import TeacherInfo, check_teacher_fits, load_teacher
from fadrm_ray.layout import RunLayout
from fadrm_ray.packing import block_size, pack_limit, split_evenly
from fadrm_ray.patches import ClassSelection, score_class, scored, select_patches
from fadrm_ray.recover import FrozenTeacher, RecoverState, final_images, init_state, run_stage
from fadrm_ray.runtime import tune_allocator
from fadrm_ray.store import ImageRecord, RunStore


_UNIT_ID = re.compile(r"^shard(\d+)-ipc(\d+)-(\d+)$")


@dataclass(frozen=True)
class Unit:
    shard: int                   # index of the class shard in the plan
    classes: tuple[int, ...]     # one image per class per IPC index
    ipc_start: int
    ipc_end: int                 # exclusive

    @property
    def unit_id(self) -> str:
        return f"shard{self.shard:04d}-ipc{self.ipc_start:05d}-{self.ipc_end:05d}"

    @property
    def ipc_indices(self) -> list[int]:
        return list(range(self.ipc_start, self.ipc_end))

    @property
    def images(self) -> int:
        return len(self.classes) * (self.ipc_end - self.ipc_start)

    @staticmethod
    def parse_id(unit_id: str) -> tuple[int, int, int] | None:
        """(shard, ipc_start, ipc_end) of a unit id; None for any other name."""
        m = _UNIT_ID.match(unit_id)
        return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def shards_of(cfg: DistillConfig, num_classes: int) -> list[tuple[int, ...]]:
    """The class shards of a run: `classes_per_batch` classes each, in class order."""
    classes = list(cfg.classes) if cfg.classes is not None else list(range(num_classes))
    per_batch = cfg.classes_per_batch or len(classes)
    return [tuple(classes[i:i + per_batch]) for i in range(0, len(classes), per_batch)]


def plan_units(cfg: DistillConfig, num_classes: int, *, image_size: int | None = None, workers: int = 1,
               finished: Sequence[str] = (), partial: Sequence[str] = (), device_type: str = "cpu") -> list[Unit]:
    """The units that cover IPC indices [0, cfg.ipc) of every shard, sorted.

    Units the run already has are kept as they are: `finished` ones (skipped by the executor)
    and `partial` ones (checkpointed, resumed) that overlap no finished unit. The IPC indices
    none of them covers are cut into new units of `ipc_per_unit` (packing.block_size for auto,
    from the number of `workers`), so a run asked for IPC 10 and then 20 adds units for 10-19.
    """
    shards = shards_of(cfg, num_classes)
    kept: dict[int, list[tuple[int, int]]] = {s: [] for s in range(len(shards))}
    for ids in (finished, partial):
        for unit_id in ids:
            parsed = Unit.parse_id(unit_id)
            if parsed is None or parsed[0] not in kept:
                continue
            s, start, end = parsed
            if start < cfg.ipc and all(end <= a or b <= start for a, b in kept[s]):
                kept[s].append((start, end))
    missing = {s: [i for i in range(cfg.ipc) if not any(a <= i < b for a, b in kept[s])] for s in kept}
    size = block_size(cfg, max((len(m) for m in missing.values()), default=0), len(shards), workers,
                      max(len(shard) for shard in shards), image_size or max(cfg.stage_resolutions or [1]),
                      device_type)
    units = [Unit(s, shards[s], a, b) for s in kept for a, b in kept[s]]
    for s, todo in missing.items():
        runs: list[list[int]] = []
        for i in todo:  # consecutive runs of missing indices
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        units += [Unit(s, shards[s], piece[0], piece[-1] + 1)
                  for run in runs for piece in chunks(run, size, cfg.ipc_per_unit == "auto")]
    return sorted(units, key=lambda u: (u.shard, u.ipc_start))


def checkpointed_units(layout: RunLayout) -> list[str]:
    """Ids of the units with a stage checkpoint in the run (begun on Ray, not yet written)."""
    return sorted({parsed[0] for path in layout.checkpoints() if (parsed := layout.checkpoint_stage(path))})


def chunks(items: list, size: int, even: bool) -> list[list]:
    """Consecutive pieces of at most `size`: of equal lengths (an automatic size), or of exactly
    `size` but the last (a size the user set)."""
    return split_evenly(items, size) if even else [items[i:i + size] for i in range(0, len(items), size)]


def make_run_id(cfg: DistillConfig, dataset_fingerprint: str, teacher_hashes: Sequence[str]) -> str:
    """Same pixel-deciding settings (`DistillConfig.identity`), data and teachers -> same run id,
    so a rerun resumes, and a rerun at another IPC or with other speed settings grows or reads
    the same run."""
    payload = json.dumps({"config": cfg.identity(), "dataset": dataset_fingerprint,
                          "teachers": list(teacher_hashes)}, sort_keys=True)
    return f"{cfg.preset.replace('+', 'plus')}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def frozen_teachers(parts: JobParts, cfg: DistillConfig) -> list[FrozenTeacher]:
    """The job's teacher models, frozen for recover on the parts' device, with what the config's
    objective needs of them (`committee.equip_teachers`: priors, convolution targets)."""
    from fadrm_ray.committee import equip_teachers

    teachers = [FrozenTeacher(model.to(parts.device), in_chans=info.in_chans, first_bn_weight=cfg.first_bn_weight)
                for model, info in zip(parts.models, parts.infos)]
    return equip_teachers(teachers, parts.infos, parts.dataset, cfg, parts.device)


def load_teachers(paths: Sequence[str | Path], dataset: ImageDataset, cfg: DistillConfig,
                  device: str = "cpu") -> tuple[list[FrozenTeacher], list[TeacherInfo]]:
    """Load, check against the dataset (class order, size, channels) and freeze each teacher."""
    if not paths:
        raise ValueError("at least one teacher checkpoint is needed (--teacher PATH)")
    models, infos = [], []
    for path in paths:
        model, info = load_teacher(path, device=device)
        check_teacher_fits(info, dataset)
        models.append(model)
        infos.append(info)
    return frozen_teachers(JobParts(dataset, models, infos, device), cfg), infos


def provenance(job: DistillJob, dataset: ImageDataset) -> dict:
    """What every part file records about how it was made: the dataset with the spec that
    reopens it and the teachers with their sha256, by the job's absolute paths
    (`job.build_job`), so `fadrm evaluate` and `fadrm verify --repair` find them from any
    directory."""
    return {
        "run_id": job.run_id,
        "config": job.config.to_dict(),
        "dataset": {**{k: v for k, v in dataset.describe().items() if k != "class_names"}, "spec": job.dataset_spec},
        "class_map": {i: name for i, name in enumerate(dataset.class_names)},
        "teachers": [{"path": t.path, "sha256": t.sha256, "model": t.model, "test_accuracy": t.test_accuracy}
                     for t in job.teachers],
        "seed": job.config.seed,
        "code_version": __version__,
    }


def unit_states(unit: Unit, cfg: DistillConfig, dataset: ImageDataset, teachers: Sequence[FrozenTeacher],
                device: str = "cpu", patch_cache: dict | None = None, gpu_share: float = 1.0) -> list[RecoverState]:
    """Select the unit's patches and build one recover state per pack of IPC indices (at most
    `packing.pack_limit` of them; with `downsample_size: auto` only groups of the same stage
    resolutions share a pack, since each group's resolutions come from its own patches)."""
    patches = None
    if cfg.init == "real":
        patches = select_patches(dataset, unit.classes, unit.ipc_indices, cfg, teachers, device, patch_cache)

    def state(members: list[int]) -> RecoverState:
        return init_state(cfg, unit.classes, [unit.ipc_indices[g] for g in members],
                          None if patches is None else patches[members],
                          dataset.image_size, dataset.channels, dataset.mean, dataset.std)

    by_schedule: dict[tuple, list[int]] = {}
    for g in range(len(unit.ipc_indices)):
        schedule = tuple(cfg.stage_resolutions) if cfg.stage_resolutions is not None else tuple(state([g]).resolutions)
        by_schedule.setdefault(schedule, []).append(g)
    limit = pack_limit(cfg, len(unit.classes), dataset.image_size, dataset.channels, teachers, device, gpu_share)
    return [state(members) for group in by_schedule.values() for members in chunks(group, limit, cfg.pack == "auto")]


def run_unit_stage(states: Sequence[RecoverState], teachers: Sequence[FrozenTeacher], cfg: DistillConfig,
                   device: str = "cpu", on_step: Callable[[int], None] | None = None) -> int:
    """Run the next stage of every pack of a unit; returns the stage that ran. `on_step` counts
    batch-iterations (one IPC batch through one iteration), whatever the packing."""
    stage = states[0].stage
    for state in states:
        run_stage(state, teachers, cfg, device, None if on_step is None else (lambda n, g=state.groups: on_step(n * g)))
    return stage


def unit_records(unit: Unit, states: Sequence[RecoverState], teachers: Sequence[FrozenTeacher],
                 device: str = "cpu") -> tuple[list[ImageRecord], list[dict]]:
    """The finished images of a unit as store records, and each pack's loss history."""
    records, packs = [], []
    for state in states:
        images, ce, bn = final_images(state, teachers, device)
        for j in range(images.shape[0]):
            records.append(ImageRecord(label=int(state.labels[j]),
                                       ipc_index=state.ipc_indices[j // len(unit.classes)],
                                       image=images[j], ce_loss=float(ce[j]), bn_loss=float(bn[j])))
        packs.append({"ipc_indices": state.ipc_indices, "resolutions": state.resolutions,
                      "budgets": state.budgets, "stages": state.history})
    return records, packs


def unit_stats(unit: Unit, packs: list[dict], device: str, seconds: float, **extra) -> dict:
    return {"unit_id": unit.unit_id, "classes": list(unit.classes), "ipc_start": unit.ipc_start,
            "ipc_end": unit.ipc_end, "images": unit.images, "device": str(device), "seconds": seconds,
            "packs": packs, **extra}


def distill_unit(unit: Unit, cfg: DistillConfig, dataset: ImageDataset, teachers: Sequence[FrozenTeacher],
                 device: str = "cpu", on_step: Callable[[int], None] | None = None,
                 patch_cache: dict | None = None) -> tuple[list[ImageRecord], dict]:
    """Recover every IPC index of `unit` in one go: the records to store and the unit's statistics."""
    started = time.perf_counter()
    states = unit_states(unit, cfg, dataset, teachers, device, patch_cache)
    while not states[0].done:
        run_unit_stage(states, teachers, cfg, device, on_step)
    records, packs = unit_records(unit, states, teachers, device)
    return records, unit_stats(unit, packs, device, time.perf_counter() - started)


def steps_of(units: Sequence[Unit], cfg: DistillConfig) -> int:
    """Batch-iterations a list of units takes (for progress bars; the same for any packing)."""
    return cfg.iterations * sum(len(u.ipc_indices) for u in units)


# --------------------------------------------------------------------------- patch selections
def needed_classes(units: Sequence[Unit], cfg: DistillConfig) -> list[int]:
    """Classes whose scored patches the units need (none unless the config scores patches)."""
    return sorted({c for u in units for c in u.classes}) if scored(cfg) else []


def load_selections(layout: RunLayout, labels: Sequence[int]) -> dict[int, ClassSelection]:
    """The selections of `labels` the run has kept (a run scores each class once, whatever the
    requests, workers and restarts); unreadable files count as missing."""
    out = {}
    for label in labels:
        try:
            selection = ClassSelection.from_dict(json.loads(layout.patch_selection(label).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if selection.label == label:
            out[label] = selection
    return out


def save_selection(layout: RunLayout, selection: ClassSelection) -> None:
    from fadrm_ray.fileio import atomic_write_text

    atomic_write_text(layout.patch_selection(selection.label), json.dumps(selection.to_dict()))


def prepare_patches(store: RunStore, units: Sequence[Unit], cfg: DistillConfig, dataset: ImageDataset,
                    teachers: Sequence[FrozenTeacher], device: str = "cpu") -> tuple[dict, list[int], float]:
    """The selections `units` need, read from the run or scored here (and kept in the run):
    (label -> ClassSelection, the labels scored now, seconds spent scoring)."""
    labels = needed_classes(units, cfg)
    cache = load_selections(store.layout, labels)
    started, fresh = time.perf_counter(), []
    for label in labels:
        if label not in cache:
            cache[label] = score_class(dataset, label, cfg, teachers, device)
            save_selection(store.layout, cache[label])
            fresh.append(label)
    return cache, fresh, time.perf_counter() - started


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

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def request_images(cfg: DistillConfig, num_classes: int) -> int:
    return len(cfg.classes if cfg.classes is not None else range(num_classes)) * cfg.ipc


def run_config(cfg: DistillConfig, layout: RunLayout) -> dict:
    """What config.yaml records: this request's resolved config, with `ipc` the largest IPC the
    run has been asked for (the images present are what the manifests list)."""
    import yaml

    saved = {}
    if layout.config.is_file():
        try:
            saved = yaml.safe_load(layout.config.read_text()) or {}
        except (OSError, yaml.YAMLError):
            saved = {}
    before = saved.get("ipc") if isinstance(saved, dict) else None
    ipc = max(cfg.ipc, before) if isinstance(before, int) and not isinstance(before, bool) else cfg.ipc
    return {**cfg.to_dict(), "ipc": ipc}


# --------------------------------------------------------------------------- running a job
class Executor(Protocol):
    """Runs the units of a job: `LocalExecutor` in this process, `actors.coordinator.RayExecutor`
    on Ray actors. `run_job` owns everything else (the lock, the plan, the manifest)."""

    parallelism: int      # workers: units are cut so that each gets work (plan_units)
    device_type: str      # what the job's config must be resolved for

    def execute(self, job: DistillJob, store: RunStore, units: list[Unit], todo: list[Unit], result: DistillResult,
                parts: JobParts | None) -> dict:
        """Run `todo` (of the request's `units`), appending each finished unit to
        `result.units_run`; returns what the run manifest records about the execution."""
        ...


def run_job(job: DistillJob, executor: Executor, parts: JobParts | None = None) -> DistillResult:
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
        # Planned after the lock: a writer we waited for may have added units, or done them all.
        done = store.finished_units()
        units = plan_units(cfg, job.num_classes, image_size=job.image_size, workers=executor.parallelism,
                           finished=list(done), partial=checkpointed_units(store.layout),
                           device_type=executor.device_type)
        todo = [u for u in units if u.unit_id not in done]
        result = DistillResult(run_id=job.run_id, run_dir=store.run_dir, images=request_images(cfg, job.num_classes),
                               units_skipped=[u.unit_id for u in units if u.unit_id in done], ipc=cfg.ipc,
                               recipe=job.recipe)
        stats = executor.execute(job, store, units, todo, result, parts)
        result.seconds = time.perf_counter() - started
        if result.units_run or not store.is_complete():
            store.finalize({"seconds": result.seconds, "ipc": cfg.ipc, **stats})
    return result


class LocalExecutor:
    """Every unit in this process, one after another (`fadrm distill --local`, a Tune trial)."""

    parallelism = 1

    def __init__(self, device: str | None = None, progress: bool = True):
        self.device = device or default_device()
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


def distill_local(cfg: DistillConfig, dataset: ImageDataset, teacher_paths: Sequence[str | Path],
                  out_root: str | Path, device: str | None = None, progress: bool = True,
                  dataset_spec: str | None = None, data_root: str | None = None) -> DistillResult:
    """Build the job of `cfg` and run it in this process (`fadrm distill --local`, the library's
    own door)."""
    executor = LocalExecutor(device, progress)
    job, parts = prepare_job(cfg, dataset, dataset_spec or dataset.name, teacher_paths, out_root, executor.device,
                             data_root=data_root)
    return run_job(job, executor, parts)
