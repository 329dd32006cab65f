"""Dataset sources behind one interface (see base.py): ``get_dataset(spec)``."""
from __future__ import annotations

from .base import DatasetError, ImageDataset, Split, channel_stats
from .common import SKIP_BAD_IMAGES

DATASET_NAMES = ["digits", "mnist-sample", "fashion-mnist", "clipart10", "cifar10", "cifar100", "imagefolder:PATH",
                 "parquet:PATH"]
_FOLDER_KINDS = ("imagefolder", "folder")

__all__ = ["DATASET_NAMES", "SKIP_BAD_IMAGES", "DatasetError", "ImageDataset", "Split", "channel_stats",
           "dataset_notes", "get_dataset", "skipping_bad_images"]


def _kind_and_options(kind: str) -> tuple[str, list[str]]:
    """`imagefolder+skip-bad-images` -> ("imagefolder", ["skip-bad-images"])."""
    base, *options = kind.split("+")
    return base.lower(), [o.strip().lower() for o in options]


def skipping_bad_images(spec: str) -> str:
    """`spec` with files that cannot be read left out (`imagefolder:PATH` ->
    `imagefolder+skip-bad-images:PATH`); refused for a dataset that is not an image folder."""
    kind, sep, arg = spec.strip().partition(":")
    base, options = _kind_and_options(kind)
    if not sep or base not in _FOLDER_KINDS:
        raise DatasetError(f"--{SKIP_BAD_IMAGES} is for image folders (imagefolder:PATH), not {spec!r}")
    return spec if SKIP_BAD_IMAGES in options else f"{kind}+{SKIP_BAD_IMAGES}:{arg}"


def dataset_notes(dataset: ImageDataset) -> list[str]:
    """What a command that opened `dataset` says once, as notes: the images converted to its
    channels and the files ignored, the unreadable files it left out (image folders)."""
    return list(dataset.info.get("notes") or ())


def get_dataset(spec: str, root: str | None = None, image_size: int | None = None,
                download: bool | None = None, skip_bad_images: bool = False) -> ImageDataset:
    """Open a dataset by spec.

    ``root`` is where CIFAR and Fashion-MNIST live (default: env FADRM_DATA or ~/.cache/fadrm/data;
    Fashion-MNIST and clipart10 are also found where the Debian packages dataset-fashion-mnist and
    openclipart-png put them).
    ``image_size`` resizes (shorter side + center crop) to that size; None keeps the native size.
    ``download`` (CIFAR only): None tries a download unless env FADRM_OFFLINE is set.
    ``skip_bad_images`` (image folders only; the spec `imagefolder+skip-bad-images:PATH` says the
    same): files that cannot be read are left out instead of refused.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DatasetError(f"unknown dataset {spec!r}; choose one of: {', '.join(DATASET_NAMES)}")
    spec = spec.strip()
    kind, sep, arg = spec.partition(":")
    key, options = _kind_and_options(kind)
    if options and not (sep and key in _FOLDER_KINDS and set(options) <= {SKIP_BAD_IMAGES}):
        raise DatasetError(f"unknown dataset '{spec}': only image folders take an option, "
                           f"imagefolder+{SKIP_BAD_IMAGES}:PATH")
    if skip_bad_images and not (sep and key in _FOLDER_KINDS):
        raise DatasetError(f"--{SKIP_BAD_IMAGES} is for image folders (imagefolder:PATH), not {spec!r}")
    if sep and key in _FOLDER_KINDS:
        from .folder import load_image_folder

        return load_image_folder(arg, image_size=image_size,
                                 skip_bad_images=skip_bad_images or SKIP_BAD_IMAGES in options)
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
