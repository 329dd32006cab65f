"""The shapes of a run's own files, as pydantic models: what the writer writes and the reader
reads back, typed on both ways.

- `UnitManifest` (`units/<unit_id>.json`): the part files of one unit with their sha256, and the
  unit's statistics (`UnitStats`), among them each pack's loss history (`StageRecord` per stage);
- `RunManifest` (`manifest.json`): the run marked complete, every unit's manifest and a summary;
- `RunProvenance`: what every part file records about how the run was made (its config, the
  dataset with the spec that reopens it, the teachers with their sha256, the pilot);
- `ClassSelection` (`patches/label=<c>.json`): one class's scored patch ranking;
- `StageCheckpoint` (`checkpoints/<unit_id>.after<stage>.safetensors`, the metadata beside the
  tensors): a unit's recover states between two stages.

Every file carries one `format_version` (`RUN_FORMAT_VERSION`). Files written before it was
recorded are version 1, and `migrate` brings their raw JSON to the current shape in one step
before it is validated, so the rest of the code sees one shape only.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from fadrm_ray.config import DistillConfig
from fadrm_ray.pilot_record import PilotRecord
from fadrm_ray.teacher_record import TeacherRecord

# 1: written before the version was recorded; 2: provenance and manifests as these models (runs of
# this version may hold a job.json, no longer read or written).
RUN_FORMAT_VERSION = 2


def migrate(raw: dict[str, Any]) -> dict[str, Any]:
    """The raw JSON of a run file of any earlier format, in today's shape (one step per version).

    Version 1 (no `format_version`): a dataset recorded by its name only is reopened by that
    name (the spec of a built-in dataset, or a folder relative to where the run was made), and
    a unit's statistics may be missing."""
    version = raw.get("format_version", 1)
    if not isinstance(version, int) or version >= RUN_FORMAT_VERSION:
        return raw
    out = dict(raw)
    dataset = out.get("dataset")
    if isinstance(dataset, dict) and not dataset.get("spec") and dataset.get("name"):
        out["dataset"] = {**dataset, "spec": dataset["name"], "spec_from_name": True}
    if "unit_id" in out and not isinstance(out.get("stats"), dict):
        out["stats"] = {}
    if isinstance(out.get("units"), list):
        out["units"] = [migrate(u) if isinstance(u, dict) else u for u in out["units"]]
    out["format_version"] = RUN_FORMAT_VERSION
    return out


class _RunFile(BaseModel):
    # Fields a later version adds are kept, not refused: an older reader still opens the run.
    model_config = ConfigDict(extra="allow", frozen=True)

    @classmethod
    def from_raw(cls, raw: dict[str, Any]):
        """The model of a parsed JSON object of any format version (`migrate`)."""
        return cls.model_validate(migrate(raw))

    @classmethod
    def from_json(cls, data: bytes | str):
        """The model of a file's JSON text, migrated where it is of an earlier format; None when
        it is not valid JSON or not this model (a damaged or foreign file)."""
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                return None
            if raw.get("format_version") == RUN_FORMAT_VERSION:
                return cls.model_validate_json(data)
            return cls.from_raw(raw)
        except (ValueError, ValidationError):
            return None


class ClassSelection(_RunFile):
    """The ranking of one class's real patches: train-split indices, lowest teacher CE first,
    and the box (top, left, side) of each one's best crop. What scoring produces
    (`patches.score_class`); every patch of a scored selection is cut from it."""

    label: int
    ranked: tuple[int, ...]
    boxes: tuple[tuple[int, int, int], ...]


class PackCheckpoint(_RunFile):
    """One pack's recover state between two stages, less its tensors (the images, patches,
    labels and each group's generator state, stored beside it by name)."""

    ipc_indices: list[int]
    mean: list[float]
    std: list[float]
    budgets: list[int]
    resolutions: list[int]
    total_iterations: int
    stage: int
    iteration: int
    history: list[dict[str, Any]] = []
    has_patches: bool = True


class StageCheckpoint(_RunFile):
    """A unit's recover states after `stage` stages: one `PackCheckpoint` per pack."""

    format_version: int = RUN_FORMAT_VERSION
    unit_id: str
    stage: int
    packs: list[PackCheckpoint]


class StageRecord(_RunFile):
    """One recover stage of a pack: its resolution, budget, whether the ARC merge followed it,
    and the per-iteration CE and BN loss curves."""

    stage: int = 0
    resolution: int | None = None
    iterations: int = 0
    merged_after: bool = False
    ce: list[float] = []
    bn: list[float] = []
    seconds: float = 0.0


class PackRecord(_RunFile):
    """A pack of IPC batches recovered together, and its loss history stage by stage."""

    ipc_indices: list[int] = []
    resolutions: list[int] = []
    budgets: list[int] = []
    stages: list[StageRecord] = []


class UnitStats(_RunFile):
    """What a worker records about a unit it recovered (extra keys: where it ran)."""

    unit_id: str | None = None
    classes: list[int] = []
    ipc_start: int | None = None
    ipc_end: int | None = None
    images: int | None = None
    device: str | None = None
    seconds: float | None = None
    packs: list[PackRecord] = []


class PartFile(_RunFile):
    """One part file of a unit: its path in the run, rows, sha256, class and IPC range."""

    path: str
    rows: int
    sha256: str
    label: int
    ipc_start: int
    ipc_end: int


class UnitManifest(_RunFile):
    """units/<unit_id>.json: written last, so a unit is done only when it exists and its files verify."""

    format_version: int = RUN_FORMAT_VERSION
    unit_id: str
    files: list[PartFile]
    rows: int = 0
    stats: UnitStats = UnitStats()
    written_at: str | None = None


class RunSummary(_RunFile):
    """What the run's executor reports when it finishes (extra keys: the executor's own)."""

    seconds: float | None = None
    ipc: int | None = None
    timings: dict[str, float | None] = {}


class RunManifest(_RunFile):
    """manifest.json: the run complete, its units and their files, and a summary."""

    format_version: int = RUN_FORMAT_VERSION
    run_id: str
    complete: bool = False
    finalized_at: str | None = None
    rows: int = 0
    classes: list[int] = []
    class_names: list[str] = []
    units: list[UnitManifest] = []
    summary: RunSummary = RunSummary()


class RecordedDataset(_RunFile):
    """The dataset a run was distilled from, as its provenance records it."""

    name: str | None = None
    spec: str | None = None               # reopens it (`get_dataset`)
    spec_from_name: bool = False          # the spec is only its name (an early run): a folder by its name
    fingerprint: str | None = None
    num_classes: int | None = None
    image_size: int | None = None
    channels: int | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    train_size: int | None = None
    test_size: int | None = None
    hflip: bool = False
    test_split: str | None = None
    skipped_images: int = 0               # files left out as unreadable (--skip-bad-images)
    skipped_files: list[str] = []         # the first 100 of them, "path (reason)", relative to the folder


def _typed_or_none(model: type[BaseModel]):
    """A validator that reads a recorded value as `model`, or None where it was written by an
    earlier version of it that no longer validates: the run still opens, without that record."""
    def read(value: Any) -> Any:
        if value is None or value == {}:  # {}: nothing recorded
            return None
        if isinstance(value, model):
            return value
        try:
            return model.model_validate(value)
        except (ValidationError, ValueError, TypeError):
            return None
    return BeforeValidator(read)


class RunProvenance(_RunFile):
    """What every part file of a run records about how it was made (the ``fadrm`` metadata key):
    the run's record of what was asked, derived from the job that wrote it
    (`fadrm_ray.runs.execute.provenance`) and carried by every part, so a bare copy of the parts
    still says it."""

    format_version: int = RUN_FORMAT_VERSION
    run_id: str | None = None
    config: Annotated[DistillConfig | None, _typed_or_none(DistillConfig)] = None  # resolved, as the part was made
    dataset: RecordedDataset | None = None
    class_map: dict[int, str] = {}
    teachers: list[TeacherRecord] = Field(default_factory=list)  # each `TeacherRecord.reference()`
    seed: int | None = None
    code_version: str | None = None
    pilot: Annotated[PilotRecord | None, _typed_or_none(PilotRecord)] = None  # whose choice `auto` took
    recipe_given: bool = False            # the recipe was named (`--set recipe=NAME`), not left to auto
    device_type: str | None = None        # the device type the config was resolved for


class ExportedRun(RunProvenance):
    """The ``fadrm`` metadata of a run exported as one Parquet file: its provenance, and the IPC
    and classes exported."""

    ipc: int | None = None
    classes: list[int] = []
