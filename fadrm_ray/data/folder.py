"""torchvision ImageFolder layout, decoded on demand.

``PATH/train/<class>/*`` with ``PATH/test/<class>/*`` (or ``PATH/val/<class>/*``); without split
folders, ``PATH/<class>/*`` gets a deterministic stratified 80/20 split. Class index = position
of the folder name in sorted order, the torchvision convention.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torchvision.datasets.folder import find_classes, make_dataset

from .. import codec
from .base import DatasetError, ImageDataset, Split
from .common import all_grey, decode_bytes, hash_parts, resize_uint8, sample_stats, stratified_split

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".avif")
DEFAULT_SIZE = 224
_HEAD_BYTES = 65536


def _class_dirs(root: Path) -> list[str]:
    try:
        names, _ = find_classes(root)
    except FileNotFoundError:  # torchvision's "no class folder": the caller says it in this reader's words
        return []
    # torchvision counts hidden folders (.git, .ipynb_checkpoints) as classes; a dataset never has them.
    return [name for name in names if not name.startswith(".")]


def _is_image(path: str) -> bool:
    name = os.path.basename(path)
    return (not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
            and os.path.isfile(path))  # a broken link is listed by the walk but is no image


def _list_files(root: Path, classes: list[str], strict: bool) -> tuple[list[Path], list[int]]:
    """The image files under each class folder (subfolders included) and their labels, a class's
    files in path order. `strict`: every class folder must hold an image.

    torchvision's walk follows linked subfolders, as its ImageFolder does; a link back up the
    tree lists the same files again, until the system's link limit stops it."""
    samples = make_dataset(root, {name: label for label, name in enumerate(classes)}, is_valid_file=_is_image,
                           allow_empty=True)
    # make_dataset lists a folder's own files before its subfolders'; path order (by components)
    # keeps the file order, and so the 80/20 split, this reader has always had.
    samples = sorted(((Path(path), label) for path, label in samples), key=lambda s: (s[1], s[0]))
    if strict:
        found = {label for _, label in samples}
        empty = next((name for label, name in enumerate(classes) if label not in found), None)
        if empty is not None:
            raise DatasetError(f"class folder {root / empty} has no images ({', '.join(IMAGE_EXTENSIONS)})")
    return [path for path, _ in samples], [label for _, label in samples]


def _file_fingerprint(base: Path, files: list[Path], labels: list[int]) -> str:
    parts = []
    for f, y in zip(files, labels):
        parts.append(f"{f.relative_to(base).as_posix()}:{f.stat().st_size}:{y}")
    return hash_parts(sorted(parts))


def _read_head(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(_HEAD_BYTES)


def _decoded_channels(path: Path) -> int:
    try:
        return codec.stored_channels(path.read_bytes())
    except codec.CodecError as exc:
        raise DatasetError(f"cannot decode image {path}: {exc}") from None


def file_split(base: Path, files: list[Path], labels: list[int], channels: int, size: int) -> Split:
    """A split whose loader reads and decodes only the requested files."""
    files = list(files)
    label_tensor = torch.as_tensor(labels, dtype=torch.int64)

    def load(indices):
        idx = torch.as_tensor(indices, dtype=torch.long).flatten().tolist()
        if not idx:
            return torch.empty((0, channels, size, size), dtype=torch.uint8)
        out = [resize_uint8(decode_bytes(files[i].read_bytes(), channels, what=str(files[i])), size) for i in idx]
        return torch.stack(out)

    return Split(labels=label_tensor, load=load, fingerprint_source=_file_fingerprint(base, files, labels))


def load_image_folder(path: str, image_size: int | None = None) -> ImageDataset:
    if not path:
        raise DatasetError("imagefolder needs a path: imagefolder:PATH")
    root = Path(path).expanduser()
    if not root.exists():
        raise DatasetError(f"image folder not found: {root}")
    if not root.is_dir():
        raise DatasetError(f"image folder is not a directory: {root}")

    train_dir = root / "train"
    test_dir = next((root / n for n in ("test", "val") if (root / n).is_dir()), None)
    if train_dir.is_dir():
        classes = _class_dirs(train_dir)
        if not classes:
            raise DatasetError(f"no class folders in {train_dir}")
        train_files, train_labels = _list_files(train_dir, classes, strict=True)
        if test_dir is not None:
            extra = sorted(set(_class_dirs(test_dir)) - set(classes))
            if extra:
                raise DatasetError(f"{test_dir} has class folders missing from {train_dir}: {', '.join(extra)}")
            test_files, test_labels = _list_files(test_dir, classes, strict=False)
            layout = f"train/{test_dir.name}"
        else:
            all_files, all_labels = train_files, train_labels
            layout = "train (80/20 split)"
    else:
        classes = _class_dirs(root)
        if not classes:
            raise DatasetError(f"no class folders in {root} (expected PATH/<class>/*.png or PATH/train/<class>/...)")
        all_files, all_labels = _list_files(root, classes, strict=True)
        layout = "flat (80/20 split)"
        test_dir = None
    if test_dir is None:
        tr, te = stratified_split(torch.as_tensor(all_labels, dtype=torch.int64))
        train_files = [all_files[i] for i in tr.tolist()]
        train_labels = [all_labels[i] for i in tr.tolist()]
        test_files = [all_files[i] for i in te.tolist()]
        test_labels = [all_labels[i] for i in te.tolist()]

    everything = train_files + test_files
    grey = all_grey(lambda i: _read_head(everything[i]), len(everything),
                    lambda i: _decoded_channels(everything[i]))
    channels = 1 if grey else 3

    if image_size is None:
        first = decode_bytes(train_files[0].read_bytes(), channels, what=str(train_files[0]))
        h, w = first.shape[-2:]
        image_size = int(h) if h == w else DEFAULT_SIZE
    if image_size < 1:
        raise DatasetError(f"image_size must be positive, got {image_size}")

    train = file_split(root, train_files, train_labels, channels, image_size)
    test = file_split(root, test_files, test_labels, channels, image_size)
    mean, std, used = sample_stats(train)
    return ImageDataset(name=f"imagefolder:{root.resolve().name}", class_names=classes, image_size=image_size,
                        channels=channels, mean=mean, std=std, train=train, test=test, hflip=True,
                        info={"source": "imagefolder", "path": str(root.resolve()), "layout": layout,
                              "stats_images": used})
