"""Exports of a run: a torchvision ImageFolder, a tensor file, one Parquet file.

Each is built from `open_run(...)`, whose reads are verified against the run's manifests, so
nothing that fails that check is exported; the ImageFolder export copies the stored PNG bytes as
they are (no decode and re-encode), so exported files are bit-identical to the store's images;
so does the Parquet export (`parquet_bytes`, also what the REST service serves). None replaces anything that exists, and the target is checked before the run is read.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fadrm_ray.fileio import atomic_create_bytes, check_new_output, fsync_dir
from pydantic import BaseModel

from fadrm_ray.store.reader import RunReader, open_run
from fadrm_ray.store.records import StoreError, json_dumps, part_schema
from fadrm_ray.store.run_files import ExportedRun

_UNSAFE_DIR_CHARS = re.compile(r"[/\\\x00]")


def imagefolder_names(class_names: Sequence[str]) -> tuple[list[str], bool]:
    """Folder name per class index, and whether an index prefix was needed.

    torchvision's ImageFolder numbers classes by the sorted folder names, so the plain names are
    kept only when they already sort in class-index order (and are unique and usable as folder
    names); otherwise every folder gets a zero-padded index prefix, e.g. ``003_cat``.
    """
    cleaned = [_UNSAFE_DIR_CHARS.sub("_", str(n)).strip() for n in class_names]
    usable = all(c and c not in (".", "..") for c in cleaned) and len(set(cleaned)) == len(cleaned)
    if usable and cleaned == sorted(cleaned):
        return cleaned, False
    width = max(3, len(str(max(len(class_names) - 1, 0))))
    return [f"{i:0{width}d}_{c}" if c not in ("", ".", "..") else f"{i:0{width}d}" for i, c in enumerate(cleaned)], True


def _nothing_to_export(reader: RunReader, count: int) -> None:
    if count == 0:
        raise StoreError(f"{reader.run_dir} has no images to export")


def export_imagefolder(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, classes: Iterable[int] | None = None,
    *, incomplete: bool = False, ipc: int | None = None, extra: Mapping[str, bytes] | None = None,
) -> int:
    """Write ``out_dir/<class folder>/ipc<k>.png`` plus ``classes.json``; returns the image count.

    The export is built in a sibling temporary directory and renamed into place, so ``out_dir``
    is either absent or complete. ``out_dir`` must not exist or be empty. With ``classes`` given,
    ImageFolder numbers only the exported folders; ``classes.json`` maps them to global indices.
    `incomplete` allows a run that is not finished, `ipc` reads the run at that IPC (IPC indices
    0..ipc-1; `open_run`). `extra` maps file names to bytes written at the top of the folder
    with the rest (the run's teacher and recipe: `fadrm_ray.evaluation.product`).
    """
    out_dir = Path(out_dir)
    check_new_output(out_dir, "export target", empty_dir_ok=True)
    reader = open_run(run_dir, incomplete=incomplete, ipc=ipc)
    if not reader.class_names:
        raise StoreError(f"{reader.run_dir}: no class names recorded; cannot name class folders")
    folders, prefixed = imagefolder_names(reader.class_names)
    taken = set(folders) | {"classes.json"}
    for name in extra or {}:
        if name in taken or Path(name).name != name or name.startswith("."):
            raise StoreError(f"cannot add {name!r} to the export: it is not a free plain file name there")
    images = reader.encoded(classes)
    _nothing_to_export(reader, len(images))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for label, ipc_index, png in images:
            if label >= len(folders):
                raise StoreError(f"{reader.run_dir}: label {label} has no class name")
            target = tmp / folders[label] / f"ipc{ipc_index:05d}.png"
            target.parent.mkdir(exist_ok=True)
            with open(target, "wb") as f:
                f.write(png)
        present = sorted({label for label, _, _ in images})
        mapping = {
            "prefixed": prefixed,
            "classes": [
                {"index": i, "name": reader.class_names[i], "folder": folders[i], "exported": i in present}
                for i in range(len(folders))
            ],
            "imagefolder_index": {folders[c]: k for k, c in enumerate(present)},
        }
        (tmp / "classes.json").write_text(json_dumps(mapping), encoding="utf-8")
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if out_dir.exists():
            out_dir.rmdir()  # only an empty directory: this fails if anything appeared since the check
        os.rename(tmp, out_dir)  # fails rather than replace a directory someone filled meanwhile
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not exc.filename:
            exc.filename = str(out_dir)  # the export that failed, not its temporary folder
        raise
    fsync_dir(out_dir.parent)
    return len(images)


def export_tensors(
    run_dir: str | os.PathLike, out_file: str | os.PathLike, classes: Iterable[int] | None = None,
    *, incomplete: bool = False, ipc: int | None = None,
) -> int:
    """``torch.save`` of {images uint8, labels int64, ipc_index int64, class_names}; returns N.
    ``out_file`` must not exist; `incomplete` allows a run that is not finished, `ipc` reads the
    run at that IPC (`open_run`)."""
    check_new_output(out_file, "export target")
    reader = open_run(run_dir, incomplete=incomplete, ipc=ipc)
    images, labels, ipcs = reader.read(classes)
    _nothing_to_export(reader, int(labels.numel()))
    buf = io.BytesIO()
    torch.save(
        {
            "images": images,
            "labels": labels,
            "ipc_index": ipcs,
            "class_names": list(reader.class_names),
            "run_id": reader.run_id,
        },
        buf,
    )
    try:
        atomic_create_bytes(out_file, buf.getvalue())
    except FileExistsError:
        raise StoreError(f"export target {out_file} appeared while the run was read; nothing was written") from None
    return int(labels.numel())


def parquet_bytes(reader: RunReader, classes: Iterable[int] | None, about: BaseModel | dict) -> bytes:
    """One Parquet file of the images of `classes` as the store keeps them (PNG bytes, label,
    ipc_index, the recover losses), sorted by (label, ipc_index), with the class names (a
    ClassLabel in the `huggingface` metadata) and `about` (the `fadrm` metadata)."""
    images = reader.encoded(classes)
    _nothing_to_export(reader, len(images))
    losses = {(r["label"], r["ipc_index"]): (r["ce_loss"], r["bn_loss"]) for r in reader.records(classes)}
    names = reader.class_names
    table = pa.Table.from_pydict(
        {
            "image": [{"bytes": png, "path": f"{names[label]}/ipc{index:05d}.png"} for label, index, png in images],
            "label": [label for label, _, _ in images],
            "ipc_index": [index for _, index, _ in images],
            "ce_loss": [losses[(label, index)][0] for label, index, _ in images],
            "bn_loss": [losses[(label, index)][1] for label, index, _ in images],
        },
        schema=part_schema(names, about),
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="none")  # PNG bytes are compressed already
    return sink.getvalue().to_pybytes()


def export_parquet(
    run_dir: str | os.PathLike, out_file: str | os.PathLike, classes: Iterable[int] | None = None,
    *, incomplete: bool = False, ipc: int | None = None,
) -> int:
    """One Parquet file (`parquet_bytes`) with the run's provenance, id, IPC and classes in its
    metadata: what `fadrm train-student --data` reads. ``out_file`` must not exist."""
    check_new_output(out_file, "export target")
    reader = open_run(run_dir, incomplete=incomplete, ipc=ipc)
    chosen = sorted({r["label"] for r in reader.records(classes)})
    about = ExportedRun(**{**reader.provenance.model_dump(), "run_id": reader.run_id, "classes": chosen,
                           "ipc": ipc or (reader.config.ipc if reader.config is not None else None)})
    data = parquet_bytes(reader, classes, about)
    try:
        atomic_create_bytes(out_file, data)
    except FileExistsError:
        raise StoreError(f"export target {out_file} appeared while the run was read; nothing was written") from None
    return len(reader.records(classes))
