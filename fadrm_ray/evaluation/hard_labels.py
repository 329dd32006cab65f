"""Hard-label students' batches: the images as they are, with their own classes (DD-Ranking's
HLR, ranking.py), from a distilled set held in memory or from a whole training split.

Both give the batches of `relabel.epoch_batches` in its order per (seed, epoch), so a split read
batch by batch trains the same student as the same images loaded at once. Where the student runs
on an accelerator the images and labels are there too: a set (or a split that lives in memory
and fits `on_device.TEST_IMAGES_ON_DEVICE_BYTES`) is copied once and indexed on the device; a
split decoded from files is read by torch's DataLoader, its workers decoding the next batches
into pinned memory while the student trains, each batch sent over without waiting.
"""
from __future__ import annotations

import multiprocessing
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fadrm_ray.evaluation.on_device import TEST_IMAGES_ON_DEVICE_BYTES
from fadrm_ray.evaluation.relabel import epoch_batches, epoch_generator
from fadrm_ray.runtime import to_device


class HardBatch(NamedTuple):
    view01: torch.Tensor   # (B, C, H, W) in [0, 1], as the images are, where the student trains
    labels: torch.Tensor   # (B,) their classes, there too
    indices: torch.Tensor  # (B,) which images, on the host (the plan of the batch)


class ImageBatches:
    """Images held whole (on the student's device), in a shuffled order per (seed, epoch)."""

    def __init__(self, images_uint8: torch.Tensor, labels: torch.Tensor, batch_size: int, seed: int,
                 device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.images, self.labels = images_uint8.to(self.device), labels.to(self.device)
        self.batch_size, self.seed = int(batch_size), int(seed)

    def epoch(self, epoch: int):
        gen = epoch_generator(self.seed, epoch)
        for idx in epoch_batches(self.images.shape[0], self.batch_size, gen):
            there = to_device(idx, self.device)
            yield HardBatch(self.images.index_select(0, there).float().div_(255.0), self.labels.index_select(0, there),
                            idx)


class _Order:
    """The DataLoader's sampler: the index batches of the epoch it is set to."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed, self.batches = n, batch_size, seed, []

    def set_epoch(self, epoch: int) -> None:
        self.batches = epoch_batches(self.n, self.batch_size, epoch_generator(self.seed, epoch))

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _SplitReader(torch.utils.data.Dataset):
    """Item `idx` (a tensor of indices): those images of the split (uint8) and their labels."""

    def __init__(self, split):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, idx: torch.Tensor):
        return self.split.load(idx), self.split.labels[idx], idx


def loader_workers() -> int:
    """DataLoader workers for decoding a split: the CPUs this process may decode on, one left to
    the training loop; none where worker processes cannot inherit the split (no fork)."""
    from fadrm_ray.data.parallel import decode_workers

    if "fork" not in multiprocessing.get_all_start_methods():
        return 0
    return max(1, decode_workers() - 1)


class SplitBatches:
    """A whole split in a shuffled order per (seed, epoch): never held whole unless it lives in
    memory and the student is on an accelerator where it fits (then as `ImageBatches`); otherwise
    read batch by batch by a DataLoader with `loader_workers()` workers."""

    def __init__(self, split, batch_size: int, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.held = None
        if split.resident and self.device.type != "cpu" and \
                len(split) * split.load(torch.arange(min(1, len(split)))).numel() <= TEST_IMAGES_ON_DEVICE_BYTES:
            self.held = ImageBatches(split.load(torch.arange(len(split))), split.labels, batch_size, seed, self.device)
            return
        self.order = _Order(len(split), int(batch_size), int(seed))
        workers = 0 if split.resident else loader_workers()
        self.loader = torch.utils.data.DataLoader(
            _SplitReader(split), batch_size=None, sampler=self.order, num_workers=workers,
            pin_memory=self.device.type == "cuda", persistent_workers=workers > 0,
            multiprocessing_context="fork" if workers else None)

    def epoch(self, epoch: int):
        if self.held is not None:
            yield from self.held.epoch(epoch)
            return
        self.order.set_epoch(epoch)
        for images, labels, idx in self.loader:
            yield HardBatch(to_device(images, self.device).float().div_(255.0), to_device(labels, self.device), idx)


class SplitCount:
    """What `train_student` needs of a streamed split in place of its images: how many."""

    def __init__(self, n: int):
        self.shape = (n,)


class HardLabels:
    """`training.Targets` for hard-label students: cross-entropy on each image's class, images
    unaugmented (DD-Ranking's default for hard labels)."""

    teacher_ids: list[str] = []

    def __init__(self, labels: torch.Tensor):
        self.labels = torch.as_tensor(labels, dtype=torch.long)

    def source(self, images_uint8: torch.Tensor, batch_size: int, seed: int,
               device: torch.device | str = "cpu") -> ImageBatches:
        if images_uint8.shape[0] != self.labels.numel():
            raise ValueError(f"{images_uint8.shape[0]} images but {self.labels.numel()} labels")
        return ImageBatches(images_uint8, self.labels, batch_size, seed, device)

    def loss(self, logits: torch.Tensor, step: HardBatch) -> torch.Tensor:
        return F.cross_entropy(logits, step.labels)


class StreamedHardLabels(HardLabels):
    """`HardLabels` of a whole split, its images read batch by batch (`SplitBatches`) in the
    order and batches `HardLabels` gives loaded images: the same student, in bounded memory."""

    def __init__(self, split):
        super().__init__(split.labels)
        self.split = split

    def source(self, images_uint8, batch_size: int, seed: int, device: torch.device | str = "cpu") -> SplitBatches:
        return SplitBatches(self.split, batch_size, seed, device)
