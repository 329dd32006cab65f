"""Stage checkpoints: a unit's recover states between two stages, so that a lost Ray worker costs
at most one stage. One safetensors file per unit (its newest stage only), the `StageCheckpoint`
in its metadata and the states' tensors by name (`<pack>.x`, `<pack>.labels`, `<pack>.patches`,
`<pack>.rng.<group>`). Checkpoints are work in progress: a unit's go when its part files are
written."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from fadrm_ray.fileio import atomic_write_bytes
from fadrm_ray.layout import RunLayout
from fadrm_ray.store.records import StoreError
from fadrm_ray.store.run_files import PackCheckpoint, StageCheckpoint

_METADATA_KEY = "fadrm"


def save_checkpoint(layout: RunLayout, checkpoint: StageCheckpoint, tensors: dict[str, torch.Tensor]) -> Path:
    """Write the unit's checkpoint after `checkpoint.stage` stages and drop its older ones."""
    from safetensors.torch import save

    data = save({name: t.detach().cpu().contiguous() for name, t in tensors.items()},
                metadata={_METADATA_KEY: checkpoint.model_dump_json()})
    path = atomic_write_bytes(layout.checkpoint(checkpoint.unit_id, checkpoint.stage), data)
    drop_checkpoints(layout, checkpoint.unit_id, keep=path)
    return path


def load_checkpoint(layout: RunLayout, unit_id: str, stage: int) -> tuple[StageCheckpoint, dict[str, torch.Tensor]]:
    """The unit's checkpoint after `stage` stages, and its tensors (on the host)."""
    from safetensors import safe_open

    path = layout.checkpoint(unit_id, stage)
    if not path.is_file() and layout.legacy_checkpoint(unit_id, stage).is_file():
        return _legacy(layout.legacy_checkpoint(unit_id, stage), unit_id, stage)
    try:
        with safe_open(str(path), framework="pt") as f:
            checkpoint = StageCheckpoint.from_json((f.metadata() or {}).get(_METADATA_KEY, ""))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError) as exc:
        raise StoreError(f"stage checkpoint {path} cannot be read: {exc}") from None
    if checkpoint is None or (checkpoint.unit_id, checkpoint.stage) != (unit_id, stage):
        raise StoreError(f"stage checkpoint {path} is not unit {unit_id} after stage {stage}")
    return checkpoint, tensors


def latest_checkpoints(layout: RunLayout) -> dict[str, int]:
    """unit_id -> number of stages its newest checkpoint has completed."""
    out: dict[str, int] = {}
    for path in layout.checkpoints():
        parsed = layout.checkpoint_stage(path)
        if parsed is not None:
            unit_id, stage = parsed
            out[unit_id] = max(out.get(unit_id, 0), stage)
    return out


def drop_checkpoints(layout: RunLayout, unit_id: str, keep: Path | None = None) -> None:
    for old in layout.checkpoints(unit_id):
        if old != keep:
            old.unlink(missing_ok=True)


def pack_states(unit_id: str, stage: int, states: Sequence[Mapping[str, Any]]) -> tuple[StageCheckpoint, dict]:
    """A unit's recover states after `stage` stages as a `StageCheckpoint` and its tensors by name
    (module docstring); each state a mapping of a recover state's fields (`recover.RecoverState`:
    x, labels, patches or None, rng_states, and the fields `PackCheckpoint` keeps)."""
    packs, tensors = [], {}
    for i, state in enumerate(states):
        tensors[f"{i}.x"], tensors[f"{i}.labels"] = state["x"], state["labels"]
        if state["patches"] is not None:
            tensors[f"{i}.patches"] = state["patches"]
        tensors.update({f"{i}.rng.{g}": rng for g, rng in enumerate(state["rng_states"])})
        packs.append(PackCheckpoint(**{k: state[k] for k in PackCheckpoint.model_fields if k in state},
                                    has_patches=state["patches"] is not None))
    return StageCheckpoint(unit_id=unit_id, stage=stage, packs=packs), tensors


def unpack_states(checkpoint: StageCheckpoint, tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The recover states' fields a stage checkpoint holds (`pack_states`, the way back)."""
    return [dict(x=tensors[f"{i}.x"], patches=tensors[f"{i}.patches"] if pack.has_patches else None,
                 labels=tensors[f"{i}.labels"], ipc_indices=list(pack.ipc_indices), mean=list(pack.mean),
                 std=list(pack.std), budgets=list(pack.budgets), resolutions=list(pack.resolutions),
                 total_iterations=pack.total_iterations,
                 rng_states=[tensors[f"{i}.rng.{g}"] for g in range(len(pack.ipc_indices))],
                 stage=pack.stage, iteration=pack.iteration, history=[dict(h) for h in pack.history])
            for i, pack in enumerate(checkpoint.packs)]


def _legacy(path: Path, unit_id: str, stage: int) -> tuple[StageCheckpoint, dict[str, torch.Tensor]]:
    """A checkpoint of the earlier format (torch.save of the states as plain dicts), as today's."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    return pack_states(unit_id, stage, data["states"])
