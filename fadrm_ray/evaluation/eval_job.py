"""EvalJob and EvalSpec: what one evaluation measures, and how its students run.

The evaluation side's counterpart of `DistillJob`, `ExecutionSpec` and `JobParts` (runs/job.py). A
door (`fadrm evaluate`, `fadrm train-student`, the service's runner, a sweep's trainable, a
benchmark) turns what its user said into one frozen `EvalJob`, what is evaluated: the student
recipe (`EvalConfig`), what the students see (augmented views or the images as they are), which
images of a run are read (`ipc`, `incomplete`), whether the run's cache is used, and which data
and teachers replace the run's own (a dataset spec, checkpoint paths, the run's teachers where
they moved); and one frozen `EvalSpec`, how its students run: the device, torch threads, a
progress bar. Both are plain data: they cross processes and files as JSON.

`EvalParts` is what a caller hands over already loaded in its process, which no JSON carries: a
dataset and soft labeler (so nothing is loaded twice), targets that replace the teachers' soft
labels, where stored soft labels go, and the test images decoded once for every student of an
evaluation. A store run is evaluated once it is opened: `OpenedRun`
holds its reader, its images read once, its data and teachers loaded once;
`store_run.evaluate_store_run` opens it, and every step after it (evaluate.evaluate_run,
baselines.py, ranking.py, report.py) takes the opened run as its first argument. `EvalHooks` are
the callbacks that watch an evaluation: each test of a student, each new student, a line for the
user, the run just opened, the name a progress bar shows. The evaluation functions (training.py, baselines.py, ranking.py) take the job, the spec, the parts and the hooks,
in that order, and hand them down (a spec of None is `EvalSpec()`); a step that needs other
settings (a baseline's IPC, a plain student's recipe) derives its own with `model_copy` or
`dataclasses.replace`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict, field_validator

from fadrm_ray.config import EvalConfig

if TYPE_CHECKING:
    import torch

    from fadrm_ray.data.base import ImageDataset
    from fadrm_ray.store.reader import RunReader
    from fadrm_ray.evaluation.on_device import TestImages
    from fadrm_ray.evaluation.relabel import SoftLabeler
    from fadrm_ray.evaluation.scores import StudentScore


def _paths(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    return tuple(str(p) for p in value)


class EvalJob(BaseModel):
    """What one evaluation is told to measure: the recipe, and what and on which data its students learn."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: EvalConfig = EvalConfig()     # the students' recipe (its seeds are the students trained)
    augment: bool = True                  # False: students see the images as they are (no crop, flip, CutMix)
    cache: bool = True                    # read and keep evaluations in the run (evaluate_run)
    incomplete: bool = False              # evaluate a run that is not finished
    ipc: int | None = None                # read the run at this IPC; None: every image it holds
    dataset: str | None = None            # a dataset spec; None: the run's own (or EvalParts.dataset)
    teacher_paths: tuple[str, ...] | None = None  # checkpoints whose soft labels replace the run's teachers'
    teacher_copies: tuple[str, ...] = ()  # the run's own teachers where they are now (checked by sha256)
    classes: tuple[int, ...] | None = None  # the classes tested (None: every class; a store run: its own)

    @field_validator("teacher_paths", mode="before")
    @classmethod
    def _teacher_paths(cls, value: Any) -> tuple[str, ...] | None:
        return _paths(value)

    @field_validator("classes", mode="before")
    @classmethod
    def _classes(cls, value: Any) -> tuple[int, ...] | None:
        return None if value is None else tuple(sorted(int(c) for c in value))

    @field_validator("teacher_copies", mode="before")
    @classmethod
    def _copy_paths(cls, value: Any) -> tuple[str, ...]:
        return _paths(value) or ()

    def with_config(self, config: EvalConfig) -> "EvalJob":
        """The same job under another recipe (a resolved one, a baseline's, a plain student's)."""
        return self.model_copy(update={"config": config})


class EvalSpec(BaseModel):
    """How an evaluation's students run: where, with how many torch threads, with a progress bar."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str | None = None             # where the students (and the teachers labelling) run; None: cuda
                                          # where the process that trains them has it (on_device)
    threads: int | None = None            # torch threads while they train; None: leave the count alone
    progress: bool = True                 # a progress bar per student

    def on_device(self) -> str:
        """The device the students train on in this process (runtime.resolve_device)."""
        from fadrm_ray.runtime import resolve_device

        return resolve_device(self.device)


@dataclass(frozen=True)
class OpenedRun:
    """A store run opened once for an evaluation (`open_for_evaluation`): its reader, its images
    read once (every part hashed once against its manifest), their content hash, and the data
    and teachers it was distilled with, loaded once. Every step of one evaluation (the run's
    students, DD-Ranking's hard-label and plain students, the report) takes them from here."""

    reader: "RunReader"
    images: "torch.Tensor"       # uint8 (N, C, H, W), by (label, ipc_index)
    labels: "torch.Tensor"
    ipc_index: "torch.Tensor"
    content_hash: str
    dataset: "ImageDataset"      # checked by fingerprint against the run's
    labeler: "SoftLabeler"       # the teachers that label its students
    own_teachers: tuple = ()     # the run's own teachers, loaded ((model, TeacherRecord) pairs), where asked for
    own_missing: str | None = None  # why they could not be loaded (then no baseline can be distilled)

    @property
    def run_dir(self) -> Path:
        return self.reader.run_dir

    def check(self, job: "EvalJob") -> None:
        """ValueError unless `job` reads the run as it was opened (at its IPC)."""
        if job.ipc != self.reader.ipc:
            raise ValueError(f"{self.run_dir} was opened at IPC {self.reader.ipc}, but the job reads it at {job.ipc}")


@dataclass(frozen=True)
class EvalParts:
    """What an evaluation is handed already loaded in this process (module docstring); all optional."""

    dataset: "ImageDataset | None" = None      # loaded; replaces EvalJob.dataset
    labeler: "SoftLabeler | None" = None       # loaded teachers; replaces EvalJob.teacher_paths
    targets: Any = None                        # training.Targets: batches and loss instead of soft labels
    soft_label_dir: str | Path | None = None   # where stored soft labels are kept
    test_images: "TestImages | None" = None    # the test split decoded on the students' device (one per evaluation)


@dataclass(frozen=True)
class EvalHooks:
    """What watches an evaluation (module docstring); all optional."""

    on_eval: Callable[[int, int, int, float], None] | None = None  # (seed, epoch, epochs, top1) per test
    on_seed: "Callable[[StudentScore], None] | None" = None        # each new student once trained
    on_note: Callable[[str], None] | None = None                   # a line for the user: a cost about to be paid
    on_open: "Callable[[RunReader], None] | None" = None           # the evaluated run just opened, before it is read
    on_plan: Callable[[Any], None] | None = None                   # its plan.EvalPlan, before it trains anything
    progress_label: str | None = None          # the set a student's progress bar names before its model and seed
