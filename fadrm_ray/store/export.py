"""Exports of a run for tools that do not read Parquet: a torchvision ImageFolder, a tensor file.

Both are built from `open_run(...)`; the ImageFolder export copies the stored PNG bytes as they
are (no decode and re-encode), so exported files are bit-identical to the store's images.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Sequence

import torch

from fadrm_ray.fileio import atomic_write_bytes, fsync_dir
from fadrm_ray.store.reader import open_run
from fadrm_ray.store.records import StoreError, json_dumps

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


def export_imagefolder(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, classes: Iterable[int] | None = None,
    ipc: int | None = None,
) -> int:
    """Write ``out_dir/<class folder>/ipc<k>.png`` plus ``classes.json``; returns the image count.

    The export is built in a sibling temporary directory and renamed into place, so ``out_dir``
    is either absent or complete. ``out_dir`` must not exist or be empty. With ``classes`` given,
    ImageFolder numbers only the exported folders; ``classes.json`` maps them to global indices.
    With ``ipc``, only IPC indices 0..ipc-1 (the run read at that IPC, `open_run`).
    """
    reader = open_run(run_dir, ipc=ipc)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise StoreError(f"export target {out_dir} exists and is not an empty directory")
    if not reader.class_names:
        raise StoreError(f"{reader.run_dir}: no class names recorded; cannot name class folders")
    folders, prefixed = imagefolder_names(reader.class_names)
    images = reader.encoded(classes)

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
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out_dir.parent)
    return len(images)


def export_tensors(
    run_dir: str | os.PathLike, out_file: str | os.PathLike, classes: Iterable[int] | None = None,
    ipc: int | None = None,
) -> int:
    """``torch.save`` of {images uint8, labels int64, ipc_index int64, class_names}; returns N.
    With ``ipc``, only IPC indices 0..ipc-1."""
    reader = open_run(run_dir, ipc=ipc)
    images, labels, ipcs = reader.read(classes)
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
    atomic_write_bytes(out_file, buf.getvalue())
    return int(labels.numel())
