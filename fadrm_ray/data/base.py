"""The one dataset interface every phase reads through.

A dataset is two splits of labelled uint8 images at one native resolution, plus what a
model needs to read them (class names in class-index order, per-channel mean/std). Class
order is explicit: ``class_names[i]`` is the name of label ``i``, and it is recorded in
every teacher checkpoint and every store file (docs/method.md section 1: mismatched class orders
are the most common cause of broken reproductions).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from fadrm_ray.errors import InputError


class DatasetError(InputError):
    """A dataset could not be found, read or understood."""


# What a dataset's record says of a test split it brings itself (describe()['test_split']).
OWN_SPLIT = "the data's own"


@dataclass
class Split:
    """One split: labels for every image, and a loader that returns images by index.

    ``load(indices)`` returns a uint8 tensor (n, C, H, W) at the dataset's image size, so
    small datasets can live in memory and large folders can be decoded on demand through
    the same interface.
    """

    labels: torch.Tensor  # int64, shape (N,)
    load: Callable[[Sequence[int] | torch.Tensor], torch.Tensor]
    fingerprint_source: str = ""  # what identifies the content (hash of bytes or file list)
    resident: bool = False        # held in memory: `load` only indexes (nothing to decode)

    def __len__(self) -> int:
        return int(self.labels.numel())

    def indices_of_class(self, label: int) -> torch.Tensor:
        return torch.nonzero(self.labels == label, as_tuple=False).flatten()

    def of_classes(self, classes: Sequence[int] | None) -> "Split":
        """The images of `classes` only, in their order here (the whole split for None)."""
        if classes is None:
            return self
        keep = torch.nonzero(torch.isin(self.labels, torch.as_tensor(list(classes), dtype=torch.int64)),
                             as_tuple=False).flatten()
        return self.subset(keep, f"classes={sorted(int(c) for c in classes)}")

    def subset(self, keep: torch.Tensor, what: str) -> "Split":
        """The images `keep` (indices into this split), in that order; `what` names the choice in
        the fingerprint."""
        parent = self.load

        def load(indices):
            return parent(keep[torch.as_tensor(indices, dtype=torch.long)])

        return Split(labels=self.labels[keep], load=load, fingerprint_source=f"{self.fingerprint_source}:{what}",
                     resident=self.resident)

    @staticmethod
    def in_memory(images: torch.Tensor, labels: torch.Tensor) -> "Split":
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise DatasetError(f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if labels.numel() != images.shape[0]:
            raise DatasetError(f"{images.shape[0]} images but {labels.numel()} labels")
        images = images.contiguous()
        labels = labels.to(torch.int64).contiguous()
        digest = hashlib.sha256(images.numpy().tobytes())
        digest.update(labels.numpy().tobytes())

        def load(indices):
            return images[torch.as_tensor(indices, dtype=torch.long)]

        return Split(labels=labels, load=load, fingerprint_source=digest.hexdigest(), resident=True)


@dataclass
class ImageDataset:
    name: str
    class_names: list[str]
    image_size: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train: Split
    test: Split
    hflip: bool = True  # is a horizontal flip label-preserving (False for digits)
    info: dict = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def fingerprint(self) -> str:
        """A short content hash: the kind of source (a built-in dataset's name; `imagefolder`,
        `parquet`), the class names in their order, the image size and channels, and the content
        of both splits (their files' paths relative to the folder, sizes and labels, or the bytes).
        Not where the data lives nor what its folder is called: a renamed or moved copy of the same
        files is the same data."""
        return self._hash(self.name.partition(":")[0])

    def matches(self, fingerprint: str) -> bool:
        """Whether `fingerprint` is this data's: today's, or the one recorded before the folder's
        name was left out of it (`imagefolder:NAME` hashed NAME too), which older runs and teachers
        carry."""
        return fingerprint in (self.fingerprint(), self._hash(self.name))

    def _hash(self, source: str) -> str:
        h = hashlib.sha256()
        for part in (source, "|".join(self.class_names), str(self.image_size), str(self.channels),
                     self.train.fingerprint_source, self.test.fingerprint_source):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:16]

    def split_note(self, imported_teachers: bool = False) -> str | None:
        """One line where this project made the test split (the data brings none): how, and how
        large, and who never trains on it; None where the data has a test split of its own. A
        teacher imported from weights trained elsewhere (`imported_teachers`) may have seen these
        images: fadrm cannot know, and says so."""
        made = self.info.get("test_split")
        if not made:
            return None
        head = (f"{self.name} has no test split of its own: its test images are {len(self.test)} of its "
                f"{len(self.train) + len(self.test)} images, {made}; ")
        if imported_teachers:
            return head + ("the students never train on them, but the teacher's weights were trained elsewhere and "
                           "fadrm cannot know whether they saw these images (a teacher that did scores too high on "
                           "them, and so may its students)")
        return head + "the teacher and the students never train on them"

    def normalize(self, images_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 (n, C, H, W) -> float32 normalized with the dataset mean/std."""
        x = images_uint8.float().div_(255.0)
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        return (x - mean) / std

    def describe(self) -> dict:
        return {
            "name": self.name,
            "num_classes": self.num_classes,
            "class_names": list(self.class_names),
            "image_size": self.image_size,
            "channels": self.channels,
            "mean": list(self.mean),
            "std": list(self.std),
            "train_size": len(self.train),
            "test_size": len(self.test),
            "hflip": self.hflip,
            "fingerprint": self.fingerprint(),
            "test_split": self.info.get("test_split") or OWN_SPLIT,
        }


def channel_stats(images_uint8: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images, in [0, 1] units."""
    x = images_uint8.float().div(255.0)
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return tuple(round(float(v), 4) for v in mean), tuple(round(float(v), 4) for v in std)
