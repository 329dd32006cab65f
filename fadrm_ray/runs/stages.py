"""One unit's recover stages, from its patches to its store records.

`distill_unit` is what every executor runs for a unit, whole or stage by stage (`unit_states`,
`run_unit_stage`, `unit_records`): this process (`fadrm distill --local`), a Ray actor, or a Tune
trial. A unit's result depends only on the config, the dataset, the teachers and the seed, so
units can run anywhere, in any order, and a finished unit found in the store is never recomputed.
Each class's patches are scored once per run and kept in it (`prepare_patches`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence


from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.models import check_teacher_fits, load_teacher
from fadrm_ray.teacher_record import TeacherRecord
from fadrm_ray.packing import pack_limit
from fadrm_ray.patches import score_class, scored, select_patches
from fadrm_ray.frozen_teacher import FrozenTeacher, equip_teachers
from fadrm_ray.recover import RecoverState, final_images, init_state, run_stage
from fadrm_ray.runs.job import JobParts
from fadrm_ray.runs.units import Unit, chunks
from fadrm_ray.store.checkpoints import pack_states, unpack_states
from fadrm_ray.store.run_files import PackRecord, StageCheckpoint, StageRecord, UnitStats
from fadrm_ray.store.selections import keep_selection, kept_selections
from fadrm_ray.store import ImageRecord, RunStore
from fadrm_ray.errors import InputError


def frozen_teachers(parts: JobParts, cfg: DistillConfig) -> list[FrozenTeacher]:
    """The job's teacher models, frozen for recover on the parts' device, with what the config's
    objective needs of them (`frozen_teacher.equip_teachers`: priors, convolution and class-wise
    targets)."""
    return equip_teachers([model.to(parts.device) for model in parts.models], parts.infos, parts.dataset, cfg,
                          parts.device)


def load_teachers(paths: Sequence[str | Path], dataset: ImageDataset, cfg: DistillConfig,
                  device: str = "cpu") -> tuple[list[FrozenTeacher], list[TeacherRecord]]:
    """Load, check against the dataset (class order, size, channels) and freeze each teacher."""
    if not paths:
        raise InputError("at least one teacher checkpoint is needed (--teacher PATH)")
    models, infos = [], []
    for path in paths:
        model, info = load_teacher(path, device=device)
        check_teacher_fits(info, dataset)
        models.append(model)
        infos.append(info)
    return frozen_teachers(JobParts(dataset, models, infos, device), cfg), infos


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
                 device: str = "cpu") -> tuple[list[ImageRecord], list[PackRecord]]:
    """The finished images of a unit as store records, and each pack's loss history."""
    records, packs = [], []
    for state in states:
        images, ce, bn = final_images(state, teachers, device)
        for j in range(images.shape[0]):
            records.append(ImageRecord(label=int(state.labels[j]),
                                       ipc_index=state.ipc_indices[j // len(unit.classes)],
                                       image=images[j], ce_loss=float(ce[j]), bn_loss=float(bn[j])))
        packs.append(PackRecord(ipc_indices=state.ipc_indices, resolutions=state.resolutions, budgets=state.budgets,
                                stages=[StageRecord.model_validate(stage) for stage in state.history]))
    return records, packs


def unit_stats(unit: Unit, packs: list[PackRecord], device: str, seconds: float, **extra) -> UnitStats:
    return UnitStats(unit_id=unit.unit_id, classes=list(unit.classes), ipc_start=unit.ipc_start,
                     ipc_end=unit.ipc_end, images=unit.images, device=str(device), seconds=seconds, packs=packs,
                     **extra)


def distill_unit(unit: Unit, cfg: DistillConfig, dataset: ImageDataset, teachers: Sequence[FrozenTeacher],
                 device: str = "cpu", on_step: Callable[[int], None] | None = None,
                 patch_cache: dict | None = None) -> tuple[list[ImageRecord], UnitStats]:
    """Recover every IPC index of `unit` in one go: the records to store and the unit's statistics."""
    started = time.perf_counter()
    states = unit_states(unit, cfg, dataset, teachers, device, patch_cache)
    while not states[0].done:
        run_unit_stage(states, teachers, cfg, device, on_step)
    records, packs = unit_records(unit, states, teachers, device)
    return records, unit_stats(unit, packs, device, time.perf_counter() - started)


def checkpoint_of(unit_id: str, states: Sequence[RecoverState]) -> tuple[StageCheckpoint, dict]:
    """A unit's states between two stages as a stage checkpoint and its tensors by name
    (`store.checkpoints.pack_states`)."""
    return pack_states(unit_id, states[0].stage, [vars(state) for state in states])


def states_of(checkpoint: StageCheckpoint, tensors: dict) -> list[RecoverState]:
    """The recover states a stage checkpoint holds (`checkpoint_of`, the way back)."""
    return [RecoverState(**fields) for fields in unpack_states(checkpoint, tensors)]


def needed_classes(units: Sequence[Unit], cfg: DistillConfig) -> list[int]:
    """Classes whose scored patches the units need (none unless the config scores patches)."""
    return sorted({c for u in units for c in u.classes}) if scored(cfg) else []


def prepare_patches(store: RunStore, units: Sequence[Unit], cfg: DistillConfig, dataset: ImageDataset,
                    teachers: Sequence[FrozenTeacher], device: str = "cpu") -> tuple[dict, list[int], float]:
    """The selections `units` need, read from the run or scored here (and kept in the run):
    (label -> ClassSelection, the labels scored now, seconds spent scoring)."""
    labels = needed_classes(units, cfg)
    cache = kept_selections(store.layout, labels)
    started, fresh = time.perf_counter(), []
    for label in labels:
        if label not in cache:
            cache[label] = score_class(dataset, label, cfg, teachers, device)
            keep_selection(store.layout, cache[label])
            fresh.append(label)
    return cache, fresh, time.perf_counter() - started
