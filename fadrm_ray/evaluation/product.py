"""What reaches a run's reported top-1 beside its images: the teacher checkpoint(s) or stored soft
labels, and the recipe.

Every top-1 the project reports trains students on the images with the teachers' soft labels
(KD, the teachers relabelling each augmented view: training.py); the images and their hard
labels alone reach less. `gather` collects, before anything is written, the bytes of the run's
teachers (the files the run records, each checked against its recorded sha256:
`reopen.run_teachers`), the `EvalConfig` of the run's report (`report_recipe`) and, asked
for, the soft labels of that recipe's students stored in one file (evaluation/soft_labels.py: top-k
logits of a number of epochs, for teachers that must not leave); `write_new` writes files that
must not exist yet, all or none. `fadrm export --with-teacher` / `--soft-labels` puts them inside
an ImageFolder export (`teacher.pt`, `teacher-1.pt`, ..., `soft-labels.parquet`, `recipe.json`)
or beside a Parquet or tensor file (`<stem>.teacher.pt`, `<stem>.soft-labels.parquet`,
`<stem>.recipe.json`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from pydantic import BaseModel, ConfigDict

from fadrm_ray.fileio import OutputError, atomic_create_bytes, check_new_output, sha256_bytes
from fadrm_ray.config import EvalConfig, LabelStorage
from fadrm_ray.store.reader import RunReader, open_run
from fadrm_ray.store.records import StoreError


@dataclass(frozen=True)
class Product:
    teacher_files: tuple[bytes, ...]  # the run's teacher checkpoints, in its order, as they are (or none)
    recipe: EvalConfig
    recipe_from: str             # the evaluation file whose config it is, or "default (N images, ipc M)"
    soft_labels: bytes | None = None  # the recipe's students' stored soft labels, packed
    soft_label_bytes_per_image: float | None = None  # of one student seed

    def files(self, prefix: str = "") -> dict[str, bytes]:
        """{file name: bytes} (`file_names`)."""
        recipe = (self.recipe.model_dump_json(indent=2) + "\n").encode()
        blobs = (*self.teacher_files, *(() if self.soft_labels is None else (self.soft_labels,)), recipe)
        return dict(zip(file_names(len(self.teacher_files), prefix, self.soft_labels is not None), blobs, strict=True))


def file_names(teacher_count: int, prefix: str = "", soft_labels: bool = False) -> list[str]:
    """`<prefix>teacher.pt`, `<prefix>teacher-1.pt`, ... (one per teacher), then
    `<prefix>soft-labels.parquet` where asked, then `<prefix>recipe.json`."""
    names = ([f"{prefix}teacher.pt"] + [f"{prefix}teacher-{i}.pt" for i in range(1, teacher_count)]) if teacher_count else []
    return [*names, *([f"{prefix}soft-labels.parquet"] if soft_labels else []), f"{prefix}recipe.json"]


def gather(run_dir: str | os.PathLike, classes: Iterable[int] | None = None, *, incomplete: bool = False,
           ipc: int | None = None, with_teachers: bool = True, soft_labels: LabelStorage | None = None,
           progress: bool = False) -> Product:
    """The run's teachers (unless `with_teachers` is False) and report recipe, for an export of
    `classes` of the run read at `ipc`; with `soft_labels`, the recipe's students' labels stored
    so (at the recipe's temperature), and the recipe says so."""
    from fadrm_ray.runs.reopen import run_teachers

    reader = open_run(run_dir, incomplete=incomplete, ipc=ipc)
    blobs = []
    paths = run_teachers(reader.run_dir, reader.provenance)
    for entry, path in zip(reader.provenance.teachers, paths):
        blob = Path(path).read_bytes()
        if entry.sha256 and sha256_bytes(blob) != entry.sha256:
            raise StoreError(f"teacher {path} changed while it was read (its sha256 is not the run's); nothing "
                             "was written")
        blobs.append(blob)
    recipe, source = report_recipe(reader, classes)
    packed, per_image = None, None
    if soft_labels is not None:
        recipe = EvalConfig.model_validate({**recipe.model_dump(), "soft_labels": "stored",
                                            "soft_label_dtype": soft_labels.dtype, "soft_label_topk": soft_labels.topk,
                                            "soft_label_epochs": soft_labels.epochs})
        packed, per_image = stored_soft_labels(reader, classes, recipe, paths, progress=progress)
    return Product(tuple(blobs) if with_teachers else (), recipe, source, packed, per_image)


def stored_soft_labels(reader: RunReader, classes: Iterable[int] | None, recipe: EvalConfig, teacher_paths: list[str], *,
                       progress: bool = False) -> tuple[bytes, float]:
    """The soft labels that students of `recipe` (one part per seed) learn from on the images of
    `classes`, stored as `recipe.label_storage()` says and packed in one file; and their bytes
    per image for one seed."""
    import tempfile

    from fadrm_ray.evaluation.relabel import AugmentSpec, OnlineSoftLabels, SoftLabeler
    from fadrm_ray.evaluation.soft_labels import pack_soft_labels, precompute_soft_labels

    images, _, _ = reader.read(classes)
    labeler = SoftLabeler.from_paths(teacher_paths).with_batch_statistics(recipe.teacher_bn == "batch")
    dataset = reader.provenance.dataset
    spec = AugmentSpec(out_size=int(images.shape[-1]), crop_scale=tuple(recipe.crop_scale),
                       hflip=dataset is not None and dataset.hflip, cutmix_prob=recipe.cutmix_prob)
    with tempfile.TemporaryDirectory(prefix="fadrm-soft-labels-") as tmp:
        folders = [precompute_soft_labels(OnlineSoftLabels(images, labeler, spec, recipe.batch_size, seed),
                                          recipe.epochs, tmp, recipe.label_storage(), progress=progress)
                   for seed in recipe.seed_list]
        packed = pack_soft_labels(folders)
    return packed, len(packed) / len(folders) / max(1, int(images.shape[0]))


def report_recipe(reader: RunReader, classes: Iterable[int] | None = None) -> tuple[EvalConfig, str]:
    """The `EvalConfig` the run's report used, and where it was read: the `config` of
    report/evaluation.json, else of the newest evaluation cached in the run, of these very images
    (their content hash) with augmented students; without one, the defaults resolved for the
    images of `classes` as `evaluate_run` resolves them."""
    from fadrm_ray.evaluation.training import resolve_protocol
    from fadrm_ray.evaluation.scores import Evaluation

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


class Shipped(BaseModel):
    """What an export ships beside the images: the run's teachers, and/or the report recipe's
    soft labels stored so (None: not shipped). The recipe always goes."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    with_teachers: bool = True
    soft_labels: LabelStorage | None = None


def export_with_product(run_dir: str | os.PathLike, out: str | os.PathLike, format: str,
                        classes: Iterable[int] | None = None, *, incomplete: bool = False,
                        ipc: int | None = None, shipped: Shipped | None = None,
                        progress: bool = False) -> tuple[int, Product, list[Path]]:
    """Export the run (`export_imagefolder`, `export_parquet` for format "parquet",
    `export_tensors` for "pt") with what `shipped` names (default: its teachers; and/or stored soft labels)
    and the report recipe (`gather`): inside the folder, or beside the file. All or nothing:
    (images exported, what was gathered, the files written beside the images)."""
    from fadrm_ray.store.export import export_imagefolder, export_parquet, export_tensors

    shipped = shipped or Shipped()
    with_teachers, soft_labels = shipped.with_teachers, shipped.soft_labels
    out = Path(out)
    if format == "imagefolder":
        check_new_output(out, "--out", empty_dir_ok=True)
        product = gather(run_dir, classes, incomplete=incomplete, ipc=ipc, with_teachers=with_teachers,
                         soft_labels=soft_labels, progress=progress)
        files = product.files()
        count = export_imagefolder(run_dir, out, classes, incomplete=incomplete, ipc=ipc, extra=files)
        return count, product, [out / name for name in files]
    recorded = len(open_run(run_dir, incomplete=incomplete).provenance.teachers) if with_teachers else 0
    for name in [out.name, *file_names(max(1, recorded) if with_teachers else 0, f"{out.stem}.", soft_labels is not None)]:
        check_new_output(out.with_name(name), "export target")  # every target checked before any work
    product = gather(run_dir, classes, incomplete=incomplete, ipc=ipc, with_teachers=with_teachers,
                     soft_labels=soft_labels, progress=progress)
    beside = {out.with_name(name): data for name, data in product.files(f"{out.stem}.").items()}
    export = export_parquet if format == "parquet" else export_tensors
    count = export(run_dir, out, classes, incomplete=incomplete, ipc=ipc)
    try:
        write_new(beside)
    except BaseException:
        out.unlink(missing_ok=True)  # the export made it: nothing of this call stays
        raise
    return count, product, list(beside)


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
