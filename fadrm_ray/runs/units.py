"""How a run is cut into units: a unit is a class shard (one batch = one image per class) times a
range of IPC indices.

A run is identified by what decides its pixels (`DistillConfig.identity`: not the IPC, not the
speed settings), so asking the same run for a larger IPC adds units for the missing IPC indices
only, and a smaller IPC is read from the units already there (`open_run(run_dir, ipc=...)`).
`plan_units` plans around the units a run already has, finished or checkpointed, so a unit
never overlaps another whatever block sizes earlier requests used.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from fadrm_ray.config import DistillConfig
from fadrm_ray.layout import RunLayout
from fadrm_ray.packing import block_size, split_evenly


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


def steps_of(units: Sequence[Unit], cfg: DistillConfig) -> int:
    """Batch-iterations a list of units takes (for progress bars; the same for any packing)."""
    return cfg.iterations * sum(len(u.ipc_indices) for u in units)


def request_images(cfg: DistillConfig, num_classes: int) -> int:
    return len(cfg.classes if cfg.classes is not None else range(num_classes)) * cfg.ipc
