"""Fashion-MNIST (Zalando's 28 x 28 grey clothing photos, ten classes), read from its IDX files.

The dataset as published: 60,000 training and 10,000 test images in four gzip'd IDX files, the
split the field's tables use. Debian ships them (`apt-get install dataset-fashion-mnist`); they
are found, in this order, in

1. `<root>/fashion-mnist/`, `root` being `--data-root`, else env FADRM_DATA, else
   ~/.cache/fadrm/data (where the four files can be put by hand on any system);
2. the folder the Debian package's file list names for them (/var/lib/dpkg/info);
3. /usr/share/datasets/fashion-mnist, where the package puts them.

IDX (the MNIST format): a big-endian header of two zero bytes, a type byte (0x08: unsigned
bytes), the number of dimensions, one 4-byte size per dimension, then the values in C order.
"""
from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch

from .base import DatasetError, ImageDataset, Split
from .common import package_path

CLASS_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
               "Ankle boot"]
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
PACKAGE = "dataset-fashion-mnist"
DPKG_LIST = Path(f"/var/lib/dpkg/info/{PACKAGE}.list")
PACKAGE_DIR = Path("/usr/share/datasets/fashion-mnist")
_UNSIGNED_BYTE = 0x08


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """The uint8 array of one gzip'd IDX file, checked against its header."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DatasetError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != _UNSIGNED_BYTE:
        raise DatasetError(f"{path} is not an IDX file of unsigned bytes")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    if len(data) != header + int(np.prod(shape, dtype=np.int64)):
        raise DatasetError(f"{path}: {len(data) - header} values after the header, but its header says {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _package_dir() -> Path | None:
    """The folder the Debian package's file list names for the training images, if it is installed."""
    images = package_path(DPKG_LIST, "/" + FILES["train"][0])
    return None if images is None else images.parent


def find_files(root: str | os.PathLike | None = None) -> Path:
    """The first folder (module docstring) that holds all four files; one error line otherwise."""
    from .builtin import default_data_root

    base = Path(root).expanduser() if root else default_data_root()
    candidates = [base / "fashion-mnist", _package_dir(), PACKAGE_DIR]
    names = [name for pair in FILES.values() for name in pair]
    for folder in (c for c in candidates if c is not None):
        if all((folder / name).is_file() for name in names):
            return folder
    looked = ", ".join(str(c) for c in dict.fromkeys(c for c in candidates if c is not None))
    raise DatasetError(f"Fashion-MNIST not found (looked in {looked}); install it with "
                       f"`apt-get install {PACKAGE}`, or put its four IDX files ({', '.join(names)}) in "
                       f"{base / 'fashion-mnist'} (FADRM_DATA or --data-root sets the folder above it)")


def _split(folder: Path, part: str) -> Split:
    images_file, labels_file = FILES[part]
    images, labels = read_idx(folder / images_file), read_idx(folder / labels_file)
    if images.ndim != 3 or images.shape[1] != images.shape[2] or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise DatasetError(f"{folder}: {part} images {images.shape} do not fit labels {labels.shape}")
    if labels.size and int(labels.max()) >= len(CLASS_NAMES):
        raise DatasetError(f"{folder / labels_file}: label {int(labels.max())} is not a Fashion-MNIST class")
    return Split.in_memory(torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64)))


def pixel_stats(split: Split) -> tuple[tuple[float], tuple[float]]:
    """Mean and (population) std of every training pixel in [0, 1] units, exactly: from the
    count of each of the 256 values, so 47 million pixels need no float copy."""
    counts = torch.bincount(split.load(torch.arange(len(split))).flatten(), minlength=256).double()
    values = torch.arange(256, dtype=torch.float64) / 255.0
    total = counts.sum()
    mean = float((counts * values).sum() / total)
    std = float(((counts * (values - mean) ** 2).sum() / total).sqrt())
    return (round(mean, 4),), (round(max(std, 1e-3), 4),)


def load_fashion_mnist(root: str | os.PathLike | None = None, image_size: int | None = None) -> ImageDataset:
    from .builtin import at_size

    folder = find_files(root)
    train, test = _split(folder, "train"), _split(folder, "test")
    native = int(train.load([0]).shape[-1]) if len(train) else 28
    mean, std = pixel_stats(train)
    # A horizontal flip keeps a garment's class.
    return at_size(ImageDataset(name="fashion-mnist", class_names=CLASS_NAMES, image_size=native, channels=1,
                                mean=mean, std=std, train=train, test=test, hflip=True,
                                info={"source": str(folder)}), image_size)
