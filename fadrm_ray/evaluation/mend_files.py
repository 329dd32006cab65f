"""`fadrm verify --repair` for the files an evaluation keeps in a run (checked by
`verify_files.evaluation_file_problems`), once the run's units read right (`fadrm_ray.repair`):

- each damaged or missing epoch of stored soft labels recomputed from the run's images and
  teachers: the same labels again, for the folder's key (a hash of the images, the teachers and
  the settings its meta records) must come out the same, or nothing is written. The images are
  those the meta hashes, found among the image sets the run's evaluations record (each one's IPC
  and classes, and the whole run); the teachers are the run's own (`--teacher` where they are now);
- a damaged cached evaluation removed (trained again when it is next asked for);
- the report's damaged figures drawn again (the evaluation's from report/evaluation.json).

What it cannot mend (a folder whose meta.json is damaged, labels of images or teachers the run
does not record, a damaged report/evaluation.json) it leaves, saying why.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from fadrm_ray.config import LabelStorage
from fadrm_ray.evaluation.relabel import OnlineSoftLabels, SoftLabeler
from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.evaluation.soft_labels import (SoftLabelMeta, images_digest, precompute_soft_labels,
                                              soft_label_key)
from fadrm_ray.evaluation.verify_files import evaluation_file_problems, folder_problems
from fadrm_ray.fileio import read_model
from fadrm_ray.layout import RunLayout
from fadrm_ray.runs.reopen import load_run_teachers
from fadrm_ray.runtime import resolve_device
from fadrm_ray.store import StoreError, open_run
from fadrm_ray.store.verify import FileProblem


def mend_evaluation_files(run_dir: str | os.PathLike, teacher_copies: Sequence[str | Path] | None = None,
                          device: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Mend what can be of the evaluation's damaged files (module docstring): the paths mended,
    and why each soft-label folder that could not be was not (the files no repair mends say so in
    the check)."""
    layout = RunLayout(run_dir)
    damaged = evaluation_file_problems(layout.run_dir)
    files = {rel: layout.run_dir / rel for rel, problem in damaged.items() if problem.mended}
    left: dict[str, str] = {}
    mended = [rel for rel, path in files.items() if path.parent == layout.evaluations_dir]
    for rel in mended:
        files[rel].unlink(missing_ok=True)
    report = [path for path in files.values() if path.parent == layout.report_dir]
    if report:
        _redraw_report(layout, report)
        mended += [layout.relative(path) for path in report]
    folders = sorted({path.parent for path in files.values() if path.parent.parent == layout.soft_labels})
    if folders:
        device = resolve_device(device)
        teachers = load_run_teachers(layout.run_dir, open_run(layout.run_dir).provenance, teacher_copies, device)
        under = layout.relative(layout.soft_labels)
        for folder in folders:
            try:
                _recompute_soft_labels(layout, folder, teachers, device)
            except StoreError as exc:
                left[layout.relative(folder)] = str(exc)
                continue
            still = folder_problems(folder, under)
            mended += [rel for rel, path in files.items() if path.parent == folder and rel not in still]
    return mended, left


def left_unmended(problems: dict[str, FileProblem], left: dict[str, str]) -> dict[str, FileProblem]:
    """`problems` (the evaluation's files, checked after a mend) with those in a soft-label folder
    the mend could not recompute (`left`: folder -> why) marked as not mended by `--repair`, with
    why as their remedy: a repair that just failed is not offered again."""
    out = dict(problems)
    for folder, why in left.items():
        for rel, problem in problems.items():
            if rel.startswith(f"{folder}/"):
                out[rel] = problem.model_copy(update={"remedy": why, "mended": False})
    return out


def _redraw_report(layout: RunLayout, damaged: list[Path]) -> None:
    """The damaged report figures drawn again (the evaluation's from report/evaluation.json)."""
    from fadrm_ray.evaluation.report import write_report

    for path in damaged:
        path.unlink(missing_ok=True)
    layout.report_source.unlink(missing_ok=True)  # the figures are drawn again, whatever it recorded
    write_report(open_run(layout.run_dir), evaluation=read_model(Evaluation, layout.report_files()["evaluation"]))


def _recompute_soft_labels(layout: RunLayout, folder: Path, teachers: list[tuple], device: str) -> None:
    """The damaged and missing epochs of one soft-label folder computed again (module docstring);
    StoreError, with nothing changed, where the run's images and teachers do not make its labels."""
    name = layout.relative(folder)
    meta = SoftLabelMeta.model_validate_json((folder / "meta.json").read_bytes())
    images = _images_of(layout, meta.images_sha256)
    if images is None:
        raise StoreError(f"{name}: no image set the run's evaluations record is the one these labels were made for "
                         f"(sha256 {(meta.images_sha256 or 'not recorded')[:12]}...), so they cannot be recomputed; "
                         f"remove the folder (an evaluation that stores soft labels makes it again)")
    by_id = {info.sha256: (model, info) for model, info in teachers}
    missing = [t for t in meta.teachers if t not in by_id]
    if missing:
        raise StoreError(f"{name}: labelled by teacher(s) the run does not record (sha256 "
                         f"{', '.join(t[:12] + '...' for t in missing)}), so they cannot be recomputed here; remove the "
                         f"folder (an evaluation that stores soft labels makes it again)")
    chosen = [by_id[t] for t in meta.teachers]
    labeler = SoftLabeler.from_loaded([m for m, _ in chosen], [i for _, i in chosen], device)
    source = OnlineSoftLabels(images, labeler.with_batch_statistics(meta.teacher_bn == "batch"), meta.spec,
                              meta.batch_size, meta.seed)
    storage = LabelStorage(dtype=meta.dtype, topk=meta.topk, epochs=meta.epochs_kept,
                           **({"temperature": meta.temperature} if meta.temperature else {}))
    if (key := soft_label_key(source, storage)) != folder.name:
        raise StoreError(f"{name}: the run's images and teachers with the folder's settings make other labels (key "
                         f"{key}); nothing was changed")
    for rel in folder_problems(folder, layout.relative(layout.soft_labels)):
        if rel.rsplit("/", 1)[1].startswith("epoch="):
            (layout.run_dir / rel).unlink(missing_ok=True)
    precompute_soft_labels(source, meta.epochs, folder.parent, storage)


def _images_of(layout: RunLayout, digest: str | None):
    """The run's images whose `images_digest` is `digest`, among those its evaluations were of
    (each kept evaluation's IPC and classes, and the whole run); None when none is."""
    if digest is None:
        return None
    asked = {(None, None)}
    for path in [*sorted(layout.evaluations_dir.glob("*.json")), layout.report_files()["evaluation"]]:
        evaluation = read_model(Evaluation, path)
        if evaluation is not None:
            asked.add((evaluation.ipc, tuple(evaluation.classes) if evaluation.classes is not None else None))
    for ipc, classes in sorted(asked, key=str):
        images, _, _ = open_run(layout.run_dir, ipc=ipc).read(classes)
        if images_digest(images) == digest:
            return images
    return None
