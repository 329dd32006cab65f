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

The listing checks every image file once, on the decode threads (`check_files`, through
`codec.check_file`: its header and its end), and keeps what it found: the files that cannot be
read (`bad`, left out of both splits and their fingerprints), the modes of the others (`modes`:
grey, RGBA or paletted images converted to the dataset's channels) and the files in class folders
that are not images (`strays`). `conversion_note`, `refusal` and `skipped_note` say them.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import codec
from ..fileio import atomic_write_bytes, cache_root
from .parallel import parallel_map

VERSION = 3  # 2: every file checked (bad files, modes, strays); 3: a bad file's reason is the decoder's
SETTLE_SECONDS = 300
# Bad files a refusal names in its line (all of them are in the file `bad_list_file` names),
# and those a note names in its line before it points to that file instead.
NAMED_IN_REFUSAL = 5
NAMED_IN_NOTE = 10


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
    bad: list[tuple[str, str]] = field(default_factory=list)  # (relative path, codec.FileCheck.problem), in path order
    modes: dict[str, int] = field(default_factory=dict)  # Pillow mode as stored -> readable images of it
    strays: int = 0  # files in class folders that are not images (by name)
    source: str = "walked"  # "cache" when read from the cache file

    @property
    def images(self) -> int:
        """The image files found (by name), readable or not."""
        return len(self.train.files) + len(self.test.files) + len(self.bad)

    def to_dict(self, root: Path) -> dict:
        return {"version": VERSION, "root": str(root.resolve()), "layout": self.layout, "classes": self.classes,
                "train": _split_dict(self.train), "test": _split_dict(self.test), "channels": self.channels,
                "first_shape": list(self.first_shape), "watched": {k: list(v) for k, v in self.watched.items()},
                "stats": self.stats, "bad": [list(b) for b in self.bad], "modes": self.modes, "strays": self.strays}

    @classmethod
    def from_dict(cls, d: dict) -> "FolderListing":
        return cls(layout=str(d["layout"]), classes=[str(c) for c in d["classes"]], train=_split_from(d["train"]),
                   test=_split_from(d["test"]), channels=int(d["channels"]),
                   first_shape=(int(d["first_shape"][0]), int(d["first_shape"][1])),
                   watched={str(k): (int(v[0]), int(v[1])) for k, v in d["watched"].items()},
                   stats={str(k): list(v) for k, v in d["stats"].items()},
                   bad=[(str(rel), str(why)) for rel, why in d["bad"]],
                   modes={str(k): int(v) for k, v in d["modes"].items()}, strays=int(d["strays"]), source="cache")


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
    base = cache_root()
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


def bad_list_file(root: Path) -> Path:
    """Where every unreadable file of `root` is listed, beside its cached listing."""
    listing = cache_file(root)
    return listing.with_name(listing.name.replace(".json.gz", ".unreadable.txt"))


def check_files(paths: list[str]) -> list[codec.FileCheck]:
    """`codec.check_file` of every path, on the decode threads, in order: every file is looked
    at (a bad one does not stop the others)."""
    return parallel_map(codec.check_file, paths)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _colour_group(mode: str) -> str | None:
    """What an image of `mode` is called where it is converted to RGB; None for RGB itself."""
    if codec.is_grey_mode(mode):
        return "grey"
    return {"RGB": None, "RGBA": "RGBA", "RGBa": "RGBA", "P": "paletted", "PA": "paletted"}.get(mode, mode)


def _grey_group(mode: str) -> str | None:
    """What a grey image of `mode` is called where it is converted to 8-bit grey; None for L."""
    if mode == "L":
        return None
    if mode.startswith("I;16"):
        return "16-bit"
    return {"LA": "grey+alpha", "La": "grey+alpha", "1": "1-bit", "I": "32-bit", "F": "float"}.get(mode, mode)


def conversion_note(name: str, listing: FolderListing) -> str | None:
    """One line counting the images converted to the dataset's channels (grey, RGBA, paletted
    ... to RGB; anything but plain grey to grey) and the files in class folders that are not
    images, which are ignored; None where there are neither."""
    grey = listing.channels == 1
    groups: Counter = Counter()
    for mode, count in listing.modes.items():
        group = _grey_group(mode) if grey else _colour_group(mode)
        if group is not None:
            groups[group] += count
    order = {"grey": 0, "RGBA": 1, "paletted": 2}
    named = sorted(groups, key=lambda g: (order.get(g, 3), g))
    parts = []
    if named:
        total = sum(groups.values())
        counts = _and([f"{groups[g]} {g}" for g in named])
        parts.append(f"{counts} {'image' if total == 1 else 'images'} converted to {'grey' if grey else 'RGB'}")
    if listing.strays:
        parts.append(f"{_count(listing.strays, 'file that is not an image', 'files that are not images')} ignored")
    return f"{name}: {', '.join(parts)}" if parts else None


def _named(bad: list[tuple[str, str]]) -> str:
    return ", ".join(f"{rel} ({why})" for rel, why in bad)


def write_bad_list(root: Path, bad: list[tuple[str, str]]) -> Path | None:
    """Every bad file of `root` (its absolute path, a tab, its reason; one a line) in
    `bad_list_file`; None when the cache cannot be written."""
    target = bad_list_file(root)
    base = root.resolve()
    text = "".join(f"{base / rel}\t{why}\n" for rel, why in bad)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, text.encode())
        return target
    except OSError:
        return None


def refusal(name: str, root: Path, listing: FolderListing, flag: str) -> str:
    """The one line that refuses a folder with files that cannot be read: how many, the first
    few with their reasons (and where all of them are listed), and how to skip them."""
    bad = listing.bad
    shown = _named(bad[:NAMED_IN_REFUSAL])
    if len(bad) > NAMED_IN_REFUSAL:
        where = write_bad_list(root, bad)
        shown += f" and {len(bad) - NAMED_IN_REFUSAL} more" + (f" (all listed in {where})" if where else "")
    return (f"{name}: {len(bad)} of its {listing.images} image files cannot be read: {shown}; {flag} leaves "
            f"them out of the dataset, or remove them")


def skipped_note(name: str, root: Path, listing: FolderListing, flag: str) -> list[str]:
    """Notes saying that the unreadable files were left out, each named once: in the line where
    they are few, else in the file the line names (or one line each where it cannot be written)."""
    bad = listing.bad
    head = f"{name}: {len(bad)} of its {listing.images} image files cannot be read and are left out ({flag})"
    if len(bad) <= NAMED_IN_NOTE:
        return [f"{head}: {_named(bad)}"]
    where = write_bad_list(root, bad)
    if where is not None:
        return [f"{head}, each listed in {where}"]
    return [f"{head}:"] + [f"  {rel} ({why})" for rel, why in bad]
