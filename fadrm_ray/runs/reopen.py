"""A run's data and teachers found again: for an evaluation, a repair, an export's teacher.

A run records how it was made twice over: `job.json` (the `DistillJob` that wrote it, beside
config.yaml) and the provenance in every part file (`store.run_files.RunProvenance`, what a bare
copy of the parts still has). `recorded_job` reads the first; `run_dataset` and `run_teachers`
reopen the data and teachers the provenance names, each checked against the fingerprint or the
sha256 the run records, so a number about the run is never one about other data or teachers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from fadrm_ray.data import get_dataset
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.fileio import read_model, sha256_file
from fadrm_ray.layout import RunLayout
from fadrm_ray.runs.job import DistillJob
from fadrm_ray.settings import EvaluationError
from fadrm_ray.store.run_files import RecordedTeacher, RunProvenance

# What a message about the run's data or teachers suggests: the argument of the library
# functions, and the option of `fadrm evaluate` and `fadrm verify` (--repair) that sets it. The
# run's own teachers where they are now are `teacher_copies` (EvalJob, repair_run), checked by
# sha256 against the run's; `EvalJob.teacher_paths` would replace them unchecked.
GIVE_DATASET = "dataset=... (--dataset SPEC)"
GIVE_TEACHERS = "teacher_copies=[...] (--teacher PATH)"


def recorded_job(layout: RunLayout) -> DistillJob | None:
    """The job that last wrote the run (job.json), or None for a run written before it was kept
    or a file that is not one."""
    return read_model(DistillJob, layout.job)


def _check_teacher_exists(entry: RecordedTeacher) -> None:
    path = Path(entry.path)
    if not path.is_file():
        where = "" if path.is_absolute() else " (a path relative to the directory the run was distilled in)"
        raise EvaluationError(f"teacher {path} recorded in the run does not exist here{where}; say where the "
                              f"same file is now: {GIVE_TEACHERS}")


def _changed(entry: RecordedTeacher) -> str:
    return (f"teacher {entry.path} has changed since the run was distilled (sha256 differs from the recorded "
            f"{entry.sha256[:12]}...); give a copy of the teacher it was distilled with: {GIVE_TEACHERS}")


def _check_teacher_file(entry: RecordedTeacher) -> str:
    _check_teacher_exists(entry)
    if entry.sha256 and sha256_file(entry.path) != entry.sha256:
        raise EvaluationError(_changed(entry))
    return entry.path


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


def run_teachers(run_dir: Path, recorded: RunProvenance, copies: Sequence[str | Path] | None = None) -> list[str]:
    """The teacher checkpoints the run in `run_dir` was distilled with, in its order, each checked
    against the sha256 `recorded` holds: found among `copies` (the same files where they are now,
    matched by sha256: `--teacher PATH`), else at the path the run records. A copy that is none
    of the run's teachers is refused; with nothing recorded to check them against, `copies` are
    returned as they are."""
    entries = recorded.teachers
    if not entries and copies:
        return [str(path) for path in copies]
    if not entries:
        raise EvaluationError(f"{run_dir}: the run records no teacher; name its teachers: {GIVE_TEACHERS}")
    found: dict[str, str] = {}
    wanted = [e.sha256 for e in entries]
    for path in copies or ():
        if not Path(path).is_file():
            raise EvaluationError(f"teacher {path} does not exist")
        digest = sha256_file(path)
        if digest not in wanted:
            known = ", ".join(f"{d[:12]}..." for d in wanted if d)
            raise EvaluationError(f"teacher {path} is not one the run was distilled with (its sha256 {digest[:12]}... "
                                  f"is none of the run's: {known})")
        found.setdefault(digest, str(path))
    return [found[e.sha256] if e.sha256 in found else _check_teacher_file(e) for e in entries]


def load_run_teachers(run_dir: Path, recorded: RunProvenance, copies: Sequence[str | Path] | None = None,
                      device: str = "cpu") -> list[tuple]:
    """`run_teachers`, loaded: each checkpoint read, hashed and deserialized once (`load_teacher`'s
    (model, TeacherInfo) pairs, on `device`), the sha256 it computes checked against the run's."""
    from fadrm_ray.models import load_teacher

    entries = recorded.teachers
    if not entries and copies:
        return [load_teacher(path, device=device) for path in copies]
    if not entries:
        raise EvaluationError(f"{run_dir}: the run records no teacher; name its teachers: {GIVE_TEACHERS}")
    wanted = [e.sha256 for e in entries]
    by_digest: dict[str, tuple] = {}
    for path in copies or ():
        if not Path(path).is_file():
            raise EvaluationError(f"teacher {path} does not exist")
        model, info = load_teacher(path, device=device)
        if info.sha256 not in wanted:
            known = ", ".join(f"{d[:12]}..." for d in wanted if d)
            raise EvaluationError(f"teacher {path} is not one the run was distilled with (its sha256 "
                                  f"{info.sha256[:12]}... is none of the run's: {known})")
        by_digest.setdefault(info.sha256, (model, info))
    loaded = []
    for entry in entries:
        if entry.sha256 in by_digest:
            loaded.append(by_digest[entry.sha256])
            continue
        _check_teacher_exists(entry)
        model, info = load_teacher(entry.path, device=device)
        if entry.sha256 and info.sha256 != entry.sha256:
            raise EvaluationError(_changed(entry))
        loaded.append((model, info))
    return loaded
