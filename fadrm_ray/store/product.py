"""What reaches a run's reported top-1 beside its images: the teacher checkpoint(s) and the recipe.

Every top-1 the project reports trains students on the images with the teachers' soft labels
(KD, the teachers relabelling each augmented view: evaluate.py); the images and their hard
labels alone reach less. `gather` collects, before anything is written, the bytes of the run's
teachers (the files the run records, each checked against its recorded sha256:
`evaluate.run_teachers`) and the `EvalConfig` of the run's report (`report_recipe`); `write_new`
writes files that must not exist yet, all or none. `fadrm export --with-teacher` puts them inside
an ImageFolder export (`teacher.pt`, `teacher-1.pt`, ..., `recipe.json`) or beside a tensor file
(`<stem>.teacher.pt`, `<stem>.recipe.json`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from fadrm_ray.fileio import OutputError, atomic_create_bytes, check_new_output, sha256_bytes
from fadrm_ray.settings import EvalConfig
from fadrm_ray.store.reader import open_run
from fadrm_ray.store.records import StoreError


@dataclass(frozen=True)
class Product:
    teachers: tuple[bytes, ...]  # the run's teacher checkpoints, in its order, as they are
    recipe: EvalConfig
    recipe_from: str             # the evaluation file whose config it is, or "default (N images, ipc M)"

    def files(self, prefix: str = "") -> dict[str, bytes]:
        """{file name: bytes} (`file_names`)."""
        recipe = (self.recipe.model_dump_json(indent=2) + "\n").encode()
        return dict(zip(file_names(len(self.teachers), prefix), (*self.teachers, recipe)))


def file_names(teachers: int, prefix: str = "") -> list[str]:
    """`<prefix>teacher.pt`, `<prefix>teacher-1.pt`, ... (one per teacher), `<prefix>recipe.json`."""
    names = [f"{prefix}teacher.pt"] + [f"{prefix}teacher-{i}.pt" for i in range(1, teachers)]
    return [*names, f"{prefix}recipe.json"]


def gather(run_dir: str | os.PathLike, classes: Iterable[int] | None = None, *, incomplete: bool = False,
           ipc: int | None = None) -> Product:
    """The run's teachers and report recipe, for an export of `classes` of the run read at `ipc`."""
    from fadrm_ray.evaluate import run_teacher_paths, run_teachers

    reader = open_run(run_dir, incomplete=incomplete, ipc=ipc)
    blobs = []
    for entry, path in zip(run_teacher_paths(reader.provenance), run_teachers(reader)):
        blob = Path(path).read_bytes()
        if entry.get("sha256") and sha256_bytes(blob) != entry["sha256"]:
            raise StoreError(f"teacher {path} changed while it was read (its sha256 is not the run's); nothing "
                             "was written")
        blobs.append(blob)
    recipe, source = report_recipe(reader, classes)
    return Product(tuple(blobs), recipe, source)


def report_recipe(reader, classes: Iterable[int] | None = None) -> tuple[EvalConfig, str]:
    """The `EvalConfig` the run's report used, and where it was read: the `config` of
    report/evaluation.json, else of the newest evaluation cached in the run, of these very images
    (their content hash) with augmented students; without one, the defaults resolved for the
    images of `classes` as `evaluate_run` resolves them."""
    from fadrm_ray.evaluate import resolve_protocol
    from fadrm_ray.scores import Evaluation

    layout, want = reader.layout, reader.content_hash()
    cached = layout.evaluations_dir.glob("*.json") if layout.evaluations_dir.is_dir() else ()
    for path in [layout.report_files()["evaluation"], *sorted(cached, key=_mtime, reverse=True)]:
        try:
            evaluation = Evaluation.model_validate_json(path.read_bytes())
        except (OSError, ValueError):  # missing, or a student's own file: not an evaluation
            continue
        if evaluation.content_hash == want and evaluation.augment:
            return evaluation.config, str(path)
    counts: dict[int, int] = {}
    for row in reader.records(classes):
        counts[row["label"]] = counts.get(row["label"], 0) + 1
    images, per_class = sum(counts.values()), max(counts.values(), default=1)
    return resolve_protocol(EvalConfig(), images, per_class), f"default ({images} images, ipc {per_class})"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def export_with_teacher(run_dir: str | os.PathLike, out: str | os.PathLike, format: str,
                        classes: Iterable[int] | None = None, *, incomplete: bool = False,
                        ipc: int | None = None) -> tuple[int, list[Path], str]:
    """Export the run (`export_imagefolder`, or `export_tensors` for format "pt") with its teachers
    and report recipe: inside the folder, or beside the file. All or nothing: (images exported,
    the teacher and recipe files, where the recipe came from)."""
    from fadrm_ray.evaluate import run_teacher_paths
    from fadrm_ray.store.export import export_imagefolder, export_tensors

    out = Path(out)
    if format == "imagefolder":
        product = gather(run_dir, classes, incomplete=incomplete, ipc=ipc)
        files = product.files()
        count = export_imagefolder(run_dir, out, classes, incomplete=incomplete, ipc=ipc, extra=files)
        return count, [out / name for name in files], product.recipe_from
    recorded = len(run_teacher_paths(open_run(run_dir, incomplete=incomplete).provenance))
    for name in file_names(max(1, recorded), f"{out.stem}."):  # every target checked before any work
        check_new_output(out.with_name(name), "export target")
    product = gather(run_dir, classes, incomplete=incomplete, ipc=ipc)
    beside = {out.with_name(name): data for name, data in product.files(f"{out.stem}.").items()}
    count = export_tensors(run_dir, out, classes, incomplete=incomplete, ipc=ipc)
    try:
        write_new(beside)
    except BaseException:
        out.unlink(missing_ok=True)  # the export made it: nothing of this call stays
        raise
    return count, list(beside), product.recipe_from


def write_new(files: Mapping[Path, bytes]) -> list[Path]:
    """Write each file, none replacing anything; when one fails, those written here are removed."""
    written: list[Path] = []
    try:
        for path, data in files.items():
            try:
                written.append(atomic_create_bytes(path, data))
            except FileExistsError:
                raise OutputError(f"export target {path} appeared meanwhile; nothing was written") from None
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return written
