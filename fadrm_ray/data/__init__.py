"""Dataset sources behind one interface (see base.py): ``get_dataset(spec)``."""
from __future__ import annotations

from .base import DatasetError, ImageDataset, Split, channel_stats

DATASET_NAMES = ["digits", "mnist-sample", "fashion-mnist", "clipart10", "cifar10", "cifar100", "imagefolder:PATH",
                 "parquet:PATH"]

__all__ = ["DATASET_NAMES", "DatasetError", "ImageDataset", "Split", "channel_stats", "get_dataset"]


def get_dataset(spec: str, root: str | None = None, image_size: int | None = None,
                download: bool | None = None) -> ImageDataset:
    """Open a dataset by spec.

    ``root`` is where CIFAR and Fashion-MNIST live (default: env FADRM_DATA or ~/.cache/fadrm/data;
    Fashion-MNIST and clipart10 are also found where the Debian packages dataset-fashion-mnist and
    openclipart-png put them).
    ``image_size`` resizes (shorter side + center crop) to that size; None keeps the native size.
    ``download`` (CIFAR only): None tries a download unless env FADRM_OFFLINE is set.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DatasetError(f"unknown dataset {spec!r}; choose one of: {', '.join(DATASET_NAMES)}")
    spec = spec.strip()
    kind, sep, arg = spec.partition(":")
    key = kind.lower()
    if sep and key in ("imagefolder", "folder"):
        from .folder import load_image_folder

        return load_image_folder(arg, image_size=image_size)
    if sep and key == "parquet":
        from .parquet import load_parquet

        return load_parquet(arg, image_size=image_size)
    if not sep:
        if key == "digits":
            from .builtin import load_digits_dataset

            return load_digits_dataset(image_size=image_size)
        if key in ("mnist-sample", "mnist_sample"):
            from .builtin import load_mnist_sample

            return load_mnist_sample(image_size=image_size)
        if key in ("fashion-mnist", "fashion_mnist", "fashionmnist"):
            from .fashion_mnist import load_fashion_mnist

            return load_fashion_mnist(root=root, image_size=image_size)
        if key == "clipart10":
            from .clipart10 import load_clipart10

            return load_clipart10(root=root, image_size=image_size)
        if key in ("cifar10", "cifar100", "cifar-10", "cifar-100"):
            from .builtin import load_cifar

            return load_cifar(key.replace("-", ""), root=root, image_size=image_size, download=download)
    raise DatasetError(f"unknown dataset '{spec}'; choose one of: {', '.join(DATASET_NAMES)}")
