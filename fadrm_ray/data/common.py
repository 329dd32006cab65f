"""Helpers shared by the dataset sources: splitting, resizing, decoding, header sniffing, and
where a Debian package put its files."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .. import codec
from .base import DatasetError, Split
from .parallel import prefetch

SPLIT_SEED = 0
TEST_FRACTION = 0.2
# A layout whose test split is made here says SPLIT_LAYOUT; the dataset then records MADE_SPLIT
# (`ImageDataset.info["test_split"]`, through `made_split`).
SPLIT_LAYOUT = "80/20 split"
MADE_SPLIT = f"held out per class by a fixed stratified split ({TEST_FRACTION:.0%} of each class)"


def made_split(layout: str) -> str | None:
    """What a dataset of `layout` records of its test split: MADE_SPLIT where it was made here."""
    return MADE_SPLIT if SPLIT_LAYOUT in layout else None


def stratified_split(labels: torch.Tensor, test_fraction: float = TEST_FRACTION,
                     seed: int = SPLIT_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-class split: (train_indices, test_indices), both sorted.

    Each class with at least two members puts round(n * test_fraction) (at least one) of them
    in the test split, so every class is present in both splits whenever it can be.
    """
    labels = torch.as_tensor(labels, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    train_parts, test_parts = [], []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c, as_tuple=False).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        n = idx.numel()
        n_test = 0 if n < 2 else min(n - 1, max(1, int(round(n * test_fraction))))
        test_parts.append(idx[:n_test])
        train_parts.append(idx[n_test:])
    empty = torch.empty(0, dtype=torch.int64)
    train = torch.sort(torch.cat(train_parts) if train_parts else empty).values
    test = torch.sort(torch.cat(test_parts) if test_parts else empty).values
    return train, test


def resize_uint8(images: torch.Tensor, size: int) -> torch.Tensor:
    """Resize uint8 (n, C, H, W): shorter side to ``size`` (antialiased bilinear), center crop."""
    if images.dim() == 3:
        return resize_uint8(images.unsqueeze(0), size)[0]
    h, w = images.shape[-2:]
    if h == size and w == size:
        return images
    if min(h, w) != size:
        scale = size / min(h, w)
        nh, nw = max(size, int(round(h * scale))), max(size, int(round(w * scale)))
        x = F.interpolate(images.float(), size=(nh, nw), mode="bilinear", antialias=True,
                          align_corners=False)
        images = x.round_().clamp_(0, 255).to(torch.uint8)
        h, w = nh, nw
    top, left = (h - size) // 2, (w - size) // 2
    return images[..., top:top + size, left:left + size].contiguous()


def resized_split(split: Split, size: int) -> Split:
    """A split whose loader resizes on the fly (keeps large in-memory sets at native size)."""
    inner = split.load

    def load(indices):
        return resize_uint8(inner(indices), size)

    return Split(labels=split.labels, load=load, fingerprint_source=f"{split.fingerprint_source}|resize{size}")


def subset_split(images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor) -> Split:
    return Split.in_memory(images[indices], labels[indices])


def sniff_is_grey(head: bytes) -> bool | None:
    """From the first bytes of an encoded image: True grey, False colour, None unknown."""
    channels = codec.header_channels(head)
    return None if channels is None else channels in (1, 2)


def decode_bytes(data: bytes | bytearray | memoryview, channels: int, what: str = "image") -> torch.Tensor:
    """Decode PNG/JPEG/... bytes to uint8 (C, H, W) with exactly ``channels`` channels."""
    try:
        return codec.decode(data, channels=1 if channels == 1 else 3)
    except codec.CodecError as exc:
        raise DatasetError(f"cannot decode {what}: {exc}") from None


def all_grey(heads: Callable[[int], bytes], count: int, decode_channels: Callable[[int], int]) -> bool:
    """True only if every image is grey; stops at the first colour image.

    The mode is read from each image's header where Pillow can read it from the first bytes;
    otherwise the image is decoded.
    """
    for i in range(count):
        grey = sniff_is_grey(heads(i))
        if grey is None:
            grey = decode_channels(i) in (1, 2)
        if not grey:
            return False
    return count > 0


def sample_stats(split: Split, max_images: int = 1000, batch: int = 256):
    """Per-channel mean/std over a deterministic, evenly spread sample of a split."""
    n = len(split)
    if n == 0:
        raise DatasetError("cannot compute channel statistics of an empty split")
    count = min(n, max_images)
    idx = torch.linspace(0, n - 1, count).round().long().unique()
    total = None
    sq = None
    pixels = 0
    for _, images in prefetch(split.load, idx.split(batch)):  # the next batch decodes while this one is summed
        x = images.double().div_(255.0)
        s = x.sum(dim=(0, 2, 3))
        q = (x * x).sum(dim=(0, 2, 3))
        total = s if total is None else total + s
        sq = q if sq is None else sq + q
        pixels += x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / pixels
    var = (sq / pixels - mean * mean).clamp_min(0) * pixels / max(1, pixels - 1)
    std = var.sqrt().clamp_min(1e-3)
    return tuple(round(float(v), 4) for v in mean), tuple(round(float(v), 4) for v in std), int(idx.numel())


def hash_parts(parts: Sequence[bytes | str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def package_path(dpkg_list: Path, ends_with: str) -> Path | None:
    """The first path that a Debian package's file list (`/var/lib/dpkg/info/PACKAGE.list`)
    names ending with `ends_with`, or None when the package is not installed."""
    try:
        lines = dpkg_list.read_text().splitlines()
    except OSError:
        return None
    return next((Path(line.rstrip("/")) for line in lines if line.rstrip("/").endswith(ends_with)), None)
