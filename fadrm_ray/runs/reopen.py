"""A run's data and teachers found again: for an evaluation, a repair, an export's teacher.

What a run was made from is recorded in every part file's provenance
(`store.run_files.RunProvenance`, what a bare copy of the parts still has): `run_dataset` and
`run_teachers` reopen the data and teachers it names, each checked against the fingerprint or the
sha256 the run records, so a number about the run is never one about other data or teachers.
The teachers are matched by `teacher_record.match_teachers`, the one matcher.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from fadrm_ray.data import get_dataset
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.fileio import sha256_file
from fadrm_ray.settings import EvaluationError
from fadrm_ray.store.run_files import RunProvenance
from fadrm_ray.teacher_record import GIVE_TEACHERS, match_teachers

# What a message about the run's data suggests: the argument of the library functions, and the
# option of `fadrm evaluate` and `fadrm verify` (--repair) that sets it. The run's own teachers
# where they are now are `teacher_copies` (EvalJob, repair_run; `GIVE_TEACHERS`), checked by
# sha256 against the run's; `EvalJob.teacher_paths` would replace them unchecked.
GIVE_DATASET = "dataset=... (--dataset SPEC)"


def run_dataset(run_dir: Path, recorded: RunProvenance, dataset: ImageDataset | str | None = None) -> ImageDataset:
    """The data the run in `run_dir` was distilled from, checked by fingerprint (a different test
    split would make any number about the run meaningless): `dataset` (a spec or a loaded dataset:
    where the run's data is now), else the dataset `recorded` names, reopened by its spec. Runs
    distilled before the spec was recorded name a folder or Parquet dataset only by its folder's
    name, which reopens only from the directory they were distilled in."""
    data = recorded.dataset
    want = data.fingerprint if data is not None else None
    if dataset is None:
        if data is None or not data.spec:
            raise EvaluationError(f"{run_dir}: the run records no dataset; name it: {GIVE_DATASET}")
        try:
            dataset = get_dataset(data.spec)
        except ValueError as exc:
            older = " (the run records its name only)" if data.spec_from_name else ""
            raise EvaluationError(f"{run_dir}: dataset {data.spec!r} of the run cannot be reopened here{older}: "
                                  f"{exc}; say where its data is now: {GIVE_DATASET}") from None
    elif isinstance(dataset, str):
        dataset = get_dataset(dataset)
    if want and not dataset.matches(want):
        raise EvaluationError(f"dataset {dataset.name} (fingerprint {dataset.fingerprint()}) is not the data the run "
                              f"was distilled from ({data.name}, fingerprint {want}); give the run's own "
                              f"data: {GIVE_DATASET}")
    return dataset


def _recorded(run_dir: Path, recorded: RunProvenance, copies: Sequence[str | Path] | None):
    if not recorded.teachers and not copies:
        raise EvaluationError(f"{run_dir}: the run records no teacher; name its teachers: {GIVE_TEACHERS}")
    return recorded.teachers


def run_teachers(run_dir: Path, recorded: RunProvenance, copies: Sequence[str | Path] | None = None) -> list[str]:
    """The teacher checkpoints the run in `run_dir` was distilled with, in its order, each checked
    against the sha256 `recorded` holds: found among `copies` (the same files where they are now,
    matched by sha256: `--teacher PATH`), else at the path the run records. A copy that is none
    of the run's teachers is refused; with nothing recorded to check them against, `copies` are
    returned as they are."""
    entries = _recorded(run_dir, recorded, copies)
    if not entries:
        return [str(path) for path in copies]
    return match_teachers(entries, copies, lambda path: (sha256_file(path), path))


def load_run_teachers(run_dir: Path, recorded: RunProvenance, copies: Sequence[str | Path] | None = None,
                      device: str = "cpu") -> list[tuple]:
    """`run_teachers`, loaded: each checkpoint read, hashed and deserialized once (`load_teacher`'s
    (model, TeacherRecord) pairs, on `device`), the sha256 it computes checked against the run's."""
    from fadrm_ray.models import load_teacher

    def loaded(path: str) -> tuple[str, tuple]:
        model, info = load_teacher(path, device=device)
        return info.sha256, (model, info)

    return match_teachers(_recorded(run_dir, recorded, copies), copies, loaded)
