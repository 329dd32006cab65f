"""The content digest of a run: what it holds, not how its files were written.

Two stores of the same run differ byte for byte: each part file records where and when it was
written (its provenance: the store's path, the time), and the runs' units may be cut otherwise.
The digest is over what a run holds: each image's class, IPC index and pixels (their shape and
bytes as decoded), in (class, IPC index) order. Equal runs have equal digests wherever they are
stored and however their units were cut; one pixel, label or IPC index that differs gives another.
`fadrm info` and `fadrm verify` print it (`--json` too), so that two runs are compared by one line.
"""
from __future__ import annotations

import hashlib

import torch

VERSION = "fadrm-content-1"


class ContentDigest:
    """A content digest built image by image, in any order (`add`), read with `hexdigest`."""

    def __init__(self):
        self.entries: list[tuple[int, int, str]] = []

    def add(self, label: int, ipc_index: int, image: torch.Tensor) -> None:
        """One image (uint8 (C, H, W)) of class `label` at `ipc_index`."""
        pixels = hashlib.sha256(("x".join(str(d) for d in image.shape) + "\n").encode())
        pixels.update(image.contiguous().numpy().tobytes())
        self.entries.append((int(label), int(ipc_index), pixels.hexdigest()))

    def hexdigest(self) -> str:
        """`sha256:` and the digest of every image added, in (class, IPC index) order."""
        h = hashlib.sha256(f"{VERSION}\n".encode())
        for label, ipc_index, pixels in sorted(self.entries):
            h.update(f"{label} {ipc_index} {pixels}\n".encode())
        return f"sha256:{h.hexdigest()}"


def content_digest(images: torch.Tensor, labels: torch.Tensor, ipc_index: torch.Tensor) -> str:
    """The content digest of uint8 images (N, C, H, W) with their labels and IPC indices (what
    `RunReader.read` gives)."""
    digest = ContentDigest()
    for image, label, ipc in zip(images, labels.tolist(), ipc_index.tolist()):
        digest.add(label, ipc, image)
    return digest.hexdigest()
