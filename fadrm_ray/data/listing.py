"""The listing of an image folder, made once per folder and kept in a small cache file.

Listing ImageNet means walking 1.28 million files and reading the size of each (the
fingerprint holds them); on network storage that takes minutes, and every process that opened
the folder did it again. The listing (files and labels of both splits, their fingerprints, the
channels, the first image's shape, channel statistics per image size) is kept in
``FADRM_CACHE/listings/<sha256 of the folder's absolute path>.json.gz`` (default
``~/.cache/fadrm``) and reused while every folder it lists, and the label file, has the
modification time and size it had: adding, removing or renaming a file changes its folder's.

A file rewritten in place under its own name leaves its folder's time alone, so a listing is
only kept once the tree has been still for `SETTLE_SECONDS` (nothing in it newer): a tree still
being written or edited is listed afresh at every open. To make a later in-place edit seen,
touch its folder or delete the cache file. An unwritable or unreadable cache is no error: the
folder is then listed every time, as without a cache.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..fileio import atomic_write_bytes
from .parallel import parallel_map

CACHE_ENV = "FADRM_CACHE"
VERSION = 1
SETTLE_SECONDS = 300


@dataclass
class SplitListing:
    files: list[str]  # relative to the folder, '/'-separated, in the split's order
    labels: list[int]
    fingerprint: str  # Split.fingerprint_source


@dataclass
class FolderListing:
    layout: str
    classes: list[str]
    train: SplitListing
    test: SplitListing
    channels: int
    first_shape: tuple[int, int]  # (H, W) of the first training image as stored
    watched: dict[str, tuple[int, int]]  # relative path ('.' the folder itself) -> (mtime_ns, size)
    stats: dict[str, list] = field(default_factory=dict)  # str(image size) -> [mean, std, images used]
    source: str = "walked"  # "cache" when read from the cache file

    def to_dict(self, root: Path) -> dict:
        return {"version": VERSION, "root": str(root.resolve()), "layout": self.layout, "classes": self.classes,
                "train": _split_dict(self.train), "test": _split_dict(self.test), "channels": self.channels,
                "first_shape": list(self.first_shape), "watched": {k: list(v) for k, v in self.watched.items()},
                "stats": self.stats}

    @classmethod
    def from_dict(cls, d: dict) -> "FolderListing":
        return cls(layout=str(d["layout"]), classes=[str(c) for c in d["classes"]], train=_split_from(d["train"]),
                   test=_split_from(d["test"]), channels=int(d["channels"]),
                   first_shape=(int(d["first_shape"][0]), int(d["first_shape"][1])),
                   watched={str(k): (int(v[0]), int(v[1])) for k, v in d["watched"].items()},
                   stats={str(k): list(v) for k, v in d["stats"].items()}, source="cache")


def _split_dict(split: SplitListing) -> dict:
    """Files as runs of one folder ([folder, [names]]) and labels as runs ([label, count]): a
    third of the size of plain lists for ImageNet."""
    runs: list[list] = []
    for rel in split.files:
        folder, _, name = rel.rpartition("/")
        if runs and runs[-1][0] == folder:
            runs[-1][1].append(name)
        else:
            runs.append([folder, [name]])
    labels: list[list[int]] = []
    for y in split.labels:
        if labels and labels[-1][0] == y:
            labels[-1][1] += 1
        else:
            labels.append([y, 1])
    return {"files": runs, "labels": labels, "fingerprint": split.fingerprint}


def _split_from(d: dict) -> SplitListing:
    files = [f"{folder}/{name}" if folder else name for folder, names in d["files"] for name in names]
    labels = [int(y) for y, count in d["labels"] for _ in range(int(count))]
    if len(files) != len(labels):
        raise ValueError("files and labels differ in length")
    return SplitListing(files, labels, str(d["fingerprint"]))


def cache_file(root: Path) -> Path:
    base = Path(os.environ.get(CACHE_ENV) or "~/.cache/fadrm").expanduser()
    return base / "listings" / f"{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]}.json.gz"


def stat_key(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def settled(newest_mtime_ns: int, listed_at_ns: int) -> bool:
    """Whether a tree whose newest file or folder changed at `newest_mtime_ns` has been still long
    enough before the listing began (`listed_at_ns`) to be kept."""
    return newest_mtime_ns < listed_at_ns - SETTLE_SECONDS * 1_000_000_000


def _unchanged(root: Path, watched: dict[str, tuple[int, int]]) -> bool:
    def same(item) -> bool:
        rel, key = item
        try:
            return stat_key(os.path.join(root, rel)) == key
        except OSError:
            return False

    return all(parallel_map(same, list(watched.items())))


def load_listing(root: Path) -> FolderListing | None:
    """The cached listing of `root` if there is one and the folders it lists are unchanged."""
    try:
        data = json.loads(gzip.decompress(cache_file(root).read_bytes()))
        if data.get("version") != VERSION or data.get("root") != str(root.resolve()):
            return None
        listing = FolderListing.from_dict(data)
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    return listing if _unchanged(root, listing.watched) else None


def save_listing(root: Path, listing: FolderListing) -> bool:
    """Write the listing to the cache (atomically); False when the cache cannot be written."""
    target = cache_file(root)
    payload = gzip.compress(json.dumps(listing.to_dict(root), separators=(",", ":")).encode(), compresslevel=6)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, payload)
        return True
    except OSError:
        return False
