"""Distill: cut a run into units, recover each unit, write it to the store.

`distill_unit` is the one function every executor calls: this module's in-process loop
(`fadrm distill --local`), a Ray actor, or a Tune trial. A unit is a class shard (one batch =
one image per class) times a range of IPC indices; its result depends only on the config,
the dataset, the teachers and the seed, so units can run anywhere, in any order, and a
finished unit found in the store is never recomputed.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from fadrm_ray import __version__
from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.models import TeacherInfo, check_teacher_fits, load_teacher
from fadrm_ray.patches import select_patches
from fadrm_ray.recover import FrozenTeacher, RecoverState, final_images, init_state, run_stage
from fadrm_ray.runtime import tune_allocator
from fadrm_ray.store import ImageRecord, RunStore


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


def plan_units(cfg: DistillConfig, num_classes: int) -> list[Unit]:
    classes = list(cfg.classes) if cfg.classes is not None else list(range(num_classes))
    per_batch = cfg.classes_per_batch or len(classes)
    shards = [tuple(classes[i:i + per_batch]) for i in range(0, len(classes), per_batch)]
    return [Unit(s, shard, start, min(start + cfg.ipc_per_unit, cfg.ipc))
            for s, shard in enumerate(shards) for start in range(0, cfg.ipc, cfg.ipc_per_unit)]


def make_run_id(cfg: DistillConfig, dataset_fingerprint: str, teacher_hashes: Sequence[str]) -> str:
    """Same resolved config, data and teachers -> same run id, so a rerun resumes."""
    payload = json.dumps({"config": cfg.to_dict(), "dataset": dataset_fingerprint,
                          "teachers": list(teacher_hashes)}, sort_keys=True)
    return f"{cfg.preset.replace('+', 'plus')}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_teachers(paths: Sequence[str | Path], dataset: ImageDataset, cfg: DistillConfig,
                  device: str = "cpu") -> tuple[list[FrozenTeacher], list[TeacherInfo]]:
    """Load, check against the dataset (class order, size, channels) and freeze each teacher."""
    if not paths:
        raise ValueError("at least one teacher checkpoint is needed (--teacher PATH)")
    teachers, infos = [], []
    for path in paths:
        model, info = load_teacher(path, device=device)
        check_teacher_fits(info, dataset)
        teachers.append(FrozenTeacher(model.to(device), in_chans=info.in_chans, first_bn_weight=cfg.first_bn_weight))
        infos.append(info)
    return teachers, infos


def provenance(cfg: DistillConfig, dataset: ImageDataset, infos: Sequence[TeacherInfo], run_id: str) -> dict:
    """What every part file records about how it was made."""
    return {
        "run_id": run_id,
        "config": cfg.to_dict(),
        "dataset": {k: v for k, v in dataset.describe().items() if k != "class_names"},
        "class_map": {i: name for i, name in enumerate(dataset.class_names)},
        "teachers": [{"path": str(i.path), "sha256": i.sha256, "model": i.model_name,
                      "test_accuracy": i.test_accuracy} for i in infos],
        "seed": cfg.seed,
        "code_version": __version__,
    }


def unit_states(unit: Unit, cfg: DistillConfig, dataset: ImageDataset, teachers: Sequence[FrozenTeacher],
                device: str = "cpu", patch_cache: dict | None = None) -> list[RecoverState]:
    """Select the unit's patches and build one recover state per pack of `cfg.pack` IPC indices."""
    patches = None
    if cfg.init == "real":
        patches = select_patches(dataset, unit.classes, unit.ipc_indices, cfg, teachers, device, patch_cache)
    states = []
    for p in range(0, len(unit.ipc_indices), cfg.pack):
        states.append(init_state(cfg, unit.classes, unit.ipc_indices[p:p + cfg.pack],
                                 None if patches is None else patches[p:p + cfg.pack],
                                 dataset.image_size, dataset.channels, dataset.mean, dataset.std))
    return states


def run_unit_stage(states: Sequence[RecoverState], teachers: Sequence[FrozenTeacher], cfg: DistillConfig,
                   device: str = "cpu", on_step: Callable[[int], None] | None = None) -> int:
    """Run the next stage of every pack of a unit; returns the stage that ran."""
    stage = states[0].stage
    for state in states:
        run_stage(state, teachers, cfg, device, on_step)
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
    """Optimizer steps a list of units takes (for progress bars)."""
    return cfg.iterations * sum(-(-len(u.ipc_indices) // cfg.pack) for u in units)


@dataclass
class DistillResult:
    run_id: str
    run_dir: Path
    images: int
    units_run: list[str] = field(default_factory=list)
    units_skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "run_dir": str(self.run_dir), "images": self.images,
                "units_run": self.units_run, "units_skipped": self.units_skipped, "seconds": self.seconds}


def prepare_run(cfg: DistillConfig, dataset: ImageDataset, teacher_paths: Sequence[str | Path],
                out_root: str | Path, device: str = "cpu", run_device: str | None = None):
    """Resolve the config for this dataset and the device the run uses (`run_device`, default
    `device`), load the teachers on `device`, open the run's store."""
    if cfg.preset == "fadrm+" and len(teacher_paths) < 2:
        raise ValueError("preset fadrm+ needs several teachers (--teacher PATH, repeated)")
    cfg = cfg.resolve(dataset.image_size, dataset.num_classes, dataset.hflip,
                      torch.device(run_device or device).type)
    teachers, infos = load_teachers(teacher_paths, dataset, cfg, device)
    run_id = make_run_id(cfg, dataset.fingerprint(), [i.sha256 for i in infos])
    store = RunStore(out_root, run_id)  # written in a `store.session`, which holds the run's lock
    return cfg, teachers, infos, store


def distill_local(cfg: DistillConfig, dataset: ImageDataset, teacher_paths: Sequence[str | Path],
                  out_root: str | Path, device: str | None = None, progress: bool = True) -> DistillResult:
    """Run every unfinished unit of a run in this process (`fadrm distill --local`)."""
    from tqdm.auto import tqdm

    tune_allocator()
    started = time.perf_counter()
    device = device or default_device()
    cfg, teachers, infos, store = prepare_run(cfg, dataset, teacher_paths, out_root, device)
    prov = provenance(cfg, dataset, infos, store.run_id)
    units = plan_units(cfg, dataset.num_classes)
    with store.session(cfg.to_dict()):
        done = store.finished_units()  # after the lock: a writer we waited for may have done it all
        todo = [u for u in units if u.unit_id not in done]
        steps = steps_of(todo, cfg)
        result = DistillResult(store.run_id, store.run_dir, 0,
                               units_skipped=[u.unit_id for u in units if u.unit_id in done])
        cache: dict = {}
        with tqdm(total=steps, desc=f"distill {store.run_id}", unit="it", disable=not progress or steps == 0) as bar:
            for unit in todo:
                records, stats = distill_unit(unit, cfg, dataset, teachers, device, bar.update, cache)
                store.write_unit(unit.unit_id, records, dataset.class_names, prov, stats)
                result.units_run.append(unit.unit_id)
        result.seconds = time.perf_counter() - started
        summary = {"seconds": result.seconds, "executor": "local", "device": device,
                   "threads": torch.get_num_threads(), "pid": os.getpid()}
        manifest = store.finalize(summary)
    result.images = int(manifest["rows"])
    return result
