"""TeacherRecord: the one record of a teacher, wherever a teacher is described.

A teacher checkpoint carries it as its metadata (`models.save_teacher` / `load_teacher`: the model,
its classes, normalization, test top-1, how it was trained or imported); once a file is written or
read, the record also says where it is and its sha256. A run keeps the same type, cut to what
finds and checks the file again (`reference()`: path, sha256, model, input channels, test top-1),
in the job that writes the run and in every part file's provenance (`store.run_files`). Files
written before the record was one type name its model `model` (jobs and provenance) or
`model_name` (checkpoints): both are read.

`match_teachers` is the one place a run's recorded teachers are matched against files: copies
given where the teachers are now (by sha256), else the paths the run records.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from fadrm_ray.settings import EvaluationError


class NormalizationCandidate(BaseModel):
    """One normalization an import measured the weights under: its name, values and test top-1."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    name: str                           # e.g. "ImageNet's mean/std", "the dataset's own statistics"
    mean: tuple[float, ...]
    std: tuple[float, ...]
    top1: float                         # percent, on the import's test images


class ImportRecord(BaseModel):
    """Where an imported teacher's weights came from, and what decided its normalization."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    source: str                         # e.g. "torchvision ResNet18_Weights.IMAGENET1K_V1 (...)", "file /abs/w.pth"
    weights_sha256: str | None = None   # of the weights file read
    normalization: str                  # where mean/std came from: flags, the weights' metadata, a measurement
    trained_size: int | None = None     # the input size the weights were trained at, where their metadata says
    eval_images: int                    # test images its top-1 was measured on
    chance: float                       # chance top-1 on them, percent
    display_names: list[str] | None = None  # human-readable class names the weights carry, in class order
    # Where nothing said the normalization: each candidate measured (the kept one first).
    measured: list[NormalizationCandidate] = []


# What a checkpoint's record must say to rebuild its model and feed it images.
CHECKPOINT_FIELDS = ("model_name", "num_classes", "in_chans", "image_size", "mean", "std", "class_names",
                     "dataset", "dataset_fingerprint")
# What a run keeps of each teacher.
REFERENCE_FIELDS = frozenset({"path", "sha256", "model_name", "in_chans", "test_accuracy"})


class TeacherRecord(BaseModel):
    """A teacher: what its checkpoint says about itself and, once written or read, where it is."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    path: str = ""                      # the checkpoint file ("" before it is written)
    sha256: str | None = None           # of the checkpoint file (None: not known, e.g. before it is written)
    model_name: str | None = Field(None, validation_alias=AliasChoices("model_name", "model"))
    model_kwargs: dict[str, Any] = {}
    num_classes: int | None = None
    in_chans: int | None = None
    image_size: int | None = None
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    class_names: list[str] = []
    dataset: str | None = None          # the dataset's name
    dataset_fingerprint: str | None = None
    test_accuracy: float | None = None  # percent, on the dataset's test split (None: not measured)
    squeeze_config: dict[str, Any] | None = None  # the SqueezeConfig it was trained with (None: not squeezed)
    imported: ImportRecord | None = None  # where its weights came from (None: not imported)

    @field_validator("class_names", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else value

    @field_validator("test_accuracy", mode="before")
    @classmethod
    def _measured(cls, value: Any) -> Any:
        # Checkpoints written before the record was typed say "not measured" with NaN.
        return None if isinstance(value, float) and math.isnan(value) else value

    def missing(self) -> list[str]:
        """The checkpoint fields this record lacks (a checkpoint needs every one)."""
        return [name for name in CHECKPOINT_FIELDS if getattr(self, name) in (None, ())]

    def at(self, path: str | Path, sha256: str) -> "TeacherRecord":
        """This record of the file at `path` whose bytes hash to `sha256`."""
        return self.model_copy(update={"path": str(path), "sha256": sha256})

    def reference(self) -> "TeacherRecord":
        """What a run keeps of this teacher: where it was, its sha256, model, channels, test top-1."""
        return TeacherRecord.model_validate(self.model_dump(include=REFERENCE_FIELDS))

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint file keeps of its own record (not where it is nor its hash)."""
        return self.model_dump(mode="json", exclude={"path", "sha256"})


T = TypeVar("T")

# How a message suggests where the teachers are now (the library argument and the CLI option).
GIVE_TEACHERS = "teacher_copies=[...] (--teacher PATH)"


def match_teachers(recorded: Sequence[TeacherRecord], copies: Sequence[str | Path] | None,
                   opened: Callable[[str], tuple[str, T]], where: str = "the run") -> list[T]:
    """The teachers `recorded` (in their order) opened once each: `opened(path)` gives a file's
    sha256 and what it opened (its path, or its loaded model). Each is found among `copies` (the
    same files where they are now, matched by sha256), else at the path recorded, and checked
    against the sha256 recorded. A copy that is none of the recorded teachers is refused; with
    nothing recorded, `copies` are opened as they are. EvaluationError says what is wrong."""
    if not recorded:
        if not copies:
            raise EvaluationError(f"{where} records no teacher; name its teachers: {GIVE_TEACHERS}")
        return [opened(str(path))[1] for path in copies]
    wanted = [entry.sha256 for entry in recorded]
    by_digest: dict[str, T] = {}
    for path in copies or ():
        if not Path(path).is_file():
            raise EvaluationError(f"teacher {path} does not exist")
        digest, value = opened(str(path))
        if digest not in wanted:
            known = ", ".join(f"{d[:12]}..." for d in wanted if d)
            raise EvaluationError(f"teacher {path} is not one {where} was distilled with (its sha256 "
                                    f"{digest[:12]}... is none of {where}'s: {known})")
        by_digest.setdefault(digest, value)
    found = []
    for entry in recorded:
        if entry.sha256 in by_digest:
            found.append(by_digest[entry.sha256])
            continue
        path = Path(entry.path)
        if not path.is_file():
            relative = "" if path.is_absolute() else f" (a path relative to the directory {where} was distilled in)"
            raise EvaluationError(f"teacher {path} recorded in {where} does not exist here{relative}; say where "
                                    f"the same file is now: {GIVE_TEACHERS}")
        digest, value = opened(entry.path)
        if entry.sha256 and digest != entry.sha256:
            raise EvaluationError(f"teacher {entry.path} has changed since {where} was distilled (sha256 differs "
                                    f"from the recorded {entry.sha256[:12]}...); give a copy of the teacher it "
                                    f"was distilled with: {GIVE_TEACHERS}")
        found.append(value)
    return found
