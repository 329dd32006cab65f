"""clipart10: ten categories of Openclipart's public-domain clip art as 32 x 32 colour images.

A colour benchmark that installs offline: Debian's `openclipart-png` puts about 6,900 drawings
in category folders under /usr/share/openclipart/png. Ten of those categories (`CLASSES`: the
folders each takes, and the subfolders it leaves out) become ten classes. The folder is found,
in this order, in

1. `<root>/openclipart/`, `root` being `--data-root`, else env FADRM_DATA, else
   ~/.cache/fadrm/data (a copy of the package's png/ folder, on any system);
2. the folder the Debian package's file list names (/var/lib/dpkg/info);
3. /usr/share/openclipart/png, where the package puts it.

Every drawing is composited on a white background (alpha flattened), cropped to its drawn
part, padded to a square with the background and resized to 32 x 32 RGB. Drawings above
`MAX_PIXELS` are left out (a few posters of 10,000 x 16,000 pixels), as are blank ones.

Duplicates. One file is read once, whatever links point to it; a link's class is the class of
the folder the file itself lies in. Files with the same bytes are kept once (the first by
path). The rest are grouped as near-duplicates: the same name stem (the name without trailing
numbers and size words, and without variant words such as `bw`: `dog_01.png`, `dog-02.png`,
`dog_bw_small.png`) or nearly the same 16 x 16 thumbnail (the same drawing at another size,
recoloured slightly, or mirrored). A group goes whole to one side of the split, chosen
deterministically per class by a hash of its first path, filling each class's test side up to
`TEST_FRACTION` of its images.

The images are built once per package content and kept in `FADRM_CACHE/datasets/` (default
~/.cache/fadrm), keyed by the list of files with their sizes and modification times; the
files are read and decoded on the shared decode threads (parallel.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import struct
from pathlib import Path

import numpy as np
import torch

from ..fileio import atomic_write_bytes, cache_root
from .base import DatasetError, ImageDataset, Split, channel_stats
from .common import package_path
from .parallel import parallel_map

NAME = "clipart10"
PACKAGE = "openclipart-png"
DPKG_LIST = Path(f"/var/lib/dpkg/info/{PACKAGE}.list")
PACKAGE_DIR = Path("/usr/share/openclipart/png")
FOLDER = "openclipart"
SIZE = 32
BACKGROUND = (255, 255, 255)
TEST_FRACTION = 0.25
MAX_PIXELS = 16_000_000
VERSION = 3

# (class name, folders it takes with their subfolders, subfolders left out), by class index.
CLASSES: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("animal", ("animals",), ()),
    ("flag", ("signs_and_symbols/flags",), ("signs_and_symbols/flags/semaphore",)),
    ("food", ("food",), ()),
    ("geography", ("geography",), ()),
    ("map_symbol", ("signs_and_symbols/map_symbols",), ()),
    ("office", ("office",), ()),
    ("person", ("people",), ("people/clothing",)),
    ("playing_card", ("recreation/games/cards",), ()),
    ("tool", ("tools",), ()),
    ("transport", ("transportation",), ("transportation/roadsigns",)),
]
CLASS_NAMES = [name for name, _, _ in CLASSES]
_PNG = b"\x89PNG\r\n\x1a\n"
# Near-duplicates: THUMB x THUMB thumbnails whose absolute difference is at most NEAR of what both
# draw (their absolute difference from the background, summed), as drawn or one mirrored.
THUMB = 16
NEAR = 0.1
# Name tokens that mark a variant of the same drawing: anywhere, and (_SIZE_WORDS) at the end.
_VARIANT_WORDS = {"bw", "color", "colour", "colored", "coloured", "grey", "gray", "greyscale", "grayscale", "mono",
                  "outline"}
_SIZE_WORDS = {"small", "medium", "large", "big", "tiny", "thumb", "thumbnail", "md", "sm", "lg", "xl", "px"}


def _package_dir() -> Path | None:
    """The png/ folder the Debian package's file list names, if the package is installed."""
    return package_path(DPKG_LIST, "/openclipart/png")


def _complete(folder: Path) -> bool:
    return all((folder / folders[0]).is_dir() for _, folders, _ in CLASSES)


def find_root(root: str | os.PathLike | None = None) -> Path:
    """The first folder (module docstring) that holds every class's first category folder."""
    from .builtin import default_data_root

    base = Path(root).expanduser() if root else default_data_root()
    candidates = [c for c in (base / FOLDER, _package_dir(), PACKAGE_DIR) if c is not None]
    for folder in candidates:
        if _complete(folder):
            return folder
    looked = ", ".join(str(c) for c in dict.fromkeys(candidates))
    raise DatasetError(f"{NAME} needs Openclipart's PNG clip art, not found (looked in {looked}); install it with "
                       f"`apt-get install {PACKAGE}`, or copy its png/ folder (animals/, food/, ...) to "
                       f"{base / FOLDER} (FADRM_DATA or --data-root sets the folder above it)")


def _within(rel: str, folder: str) -> bool:
    return rel == folder or rel.startswith(folder + "/")


def _home_class(rel: str) -> int | None:
    """The class whose folders hold the path `rel` (relative to the root), if any."""
    for label, (_, folders, skipped) in enumerate(CLASSES):
        if any(_within(rel, f) for f in folders) and not any(_within(rel, s) for s in skipped):
            return label
    return None


def list_files(root: Path) -> list[tuple[str, int, str]]:
    """(path relative to `root`, label, the file itself) of every PNG of every class, one entry per
    file itself: a file reached through links counts once, by its own path in the class of the
    folder it lies in (else by the first link, in the first class that links to it). Sorted by path."""
    real_root = os.path.realpath(root)
    found: dict[str, tuple[str, int]] = {}
    for label, (_, folders, skipped) in enumerate(CLASSES):
        for top in folders:
            seen_dirs: set[str] = set()
            for dirpath, dirnames, names in os.walk(root / top, followlinks=True):
                rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
                real_dir = os.path.realpath(dirpath)
                if real_dir in seen_dirs or any(_within(rel_dir, s) for s in skipped):
                    dirnames[:] = []
                    continue
                seen_dirs.add(real_dir)
                dirnames.sort()
                for name in sorted(names):
                    if name.startswith(".") or not name.lower().endswith(".png"):
                        continue
                    path = os.path.join(dirpath, name)
                    real = os.path.realpath(path)
                    if not os.path.isfile(real):
                        continue
                    if real not in found:
                        real_rel = os.path.relpath(real, real_root).replace(os.sep, "/")
                        home = _home_class(real_rel)
                        found[real] = (real_rel, home) if home is not None else (f"{rel_dir}/{name}", label)
    return sorted(((rel, label, real) for real, (rel, label) in found.items()), key=lambda e: e[0])


def render(data: bytes) -> np.ndarray | None:
    """uint8 (SIZE, SIZE, 3) of one encoded drawing: flattened on the background, cropped to what is
    drawn, padded square, resized. None for a drawing too large to decode, blank or unreadable."""
    from PIL import Image, ImageChops

    if data[:8] == _PNG and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        if width * height > MAX_PIXELS:
            return None
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_PIXELS:
            return None
        image = image.convert("RGBA")
    except Exception:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError...
        return None
    flat = Image.new("RGBA", image.size, BACKGROUND + (255,))
    flat.alpha_composite(image)
    flat = flat.convert("RGB")
    drawn = ImageChops.difference(flat, Image.new("RGB", flat.size, BACKGROUND)).convert("L")
    box = drawn.point(lambda v: 255 if v > 8 else 0).getbbox()
    if box is None:
        return None
    flat = flat.crop(box)
    side = max(flat.size)
    square = Image.new("RGB", (side, side), BACKGROUND)
    square.paste(flat, ((side - flat.width) // 2, (side - flat.height) // 2))
    return np.asarray(square.resize((SIZE, SIZE), Image.LANCZOS, reducing_gap=3.0), dtype=np.uint8)


def name_stem(path: str) -> str:
    """The name without trailing numbers (with a letter after them: `01b`), sizes and size words, and
    without variant words ('' when nothing is left): `bus1_bw_jarno_01.png`, `bus1_jarno-2b.png` and
    `Bus1 Jarno small.png` share one."""
    name = path.rsplit("/", 1)[-1].rsplit(".", 1)[0].lower()
    tokens = [t for t in re.split(r"[^0-9a-z]+", name) if t and t not in _VARIANT_WORDS]
    while tokens:
        last = re.sub(r"\d+[a-z]?$", "", tokens[-1])
        if not last or last in _SIZE_WORDS or re.fullmatch(r"\d+x\d+|\d+px", tokens[-1]):
            tokens.pop()
            continue
        tokens[-1] = last
        break
    return "_".join(tokens)


def group_near_duplicates(paths: list[str], images: np.ndarray) -> np.ndarray:
    """A group id per image (the smallest index in its group): images joined by a shared name stem
    or by thumbnails within NEAR of each other (one of them mirrored or not), transitively."""
    n = len(paths)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(i: int, j: int) -> None:
        a, b = find(i), find(j)
        if a != b:
            parent[max(a, b)] = min(a, b)

    first: dict[str, int] = {}
    for i, path in enumerate(paths):
        stem = name_stem(path)
        if stem:
            join(first.setdefault(stem, i), i)
    x = torch.from_numpy(images).float()
    thumbs = torch.nn.functional.avg_pool2d(x, SIZE // THUMB).flatten(1)
    mirrored = torch.nn.functional.avg_pool2d(x.flip(-1), SIZE // THUMB).flatten(1)
    ink = (thumbs - torch.tensor(BACKGROUND, dtype=torch.float32).repeat_interleave(THUMB * THUMB)).abs().sum(1)
    for start in range(0, n, 1024):
        block = thumbs[start:start + 1024]
        dist = torch.minimum(torch.cdist(block, thumbs, p=1), torch.cdist(block, mirrored, p=1))
        dist /= (ink[start:start + 1024, None] + ink[None, :]).clamp_min(1.0)
        for i, j in torch.nonzero(dist <= NEAR).tolist():
            join(start + i, j)
    return np.array([find(i) for i in range(n)], dtype=np.int64)


def split_groups(paths: list[str], labels: np.ndarray, groups: np.ndarray, fraction: float) -> np.ndarray:
    """True for the test images. Whole groups go to one side: in the order of a hash of each group's
    first path, a group joins the test side while its class (the class most of it has) has room
    up to round(fraction x the class's images); a class with two groups or more and none on the
    test side then gets its smallest group there."""
    classes = len(CLASSES)
    counts = np.bincount(labels, minlength=classes)
    target = np.where(counts < 2, 0, np.maximum(1, np.rint(counts * fraction))).astype(np.int64)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(i)
    home = {g: int(np.bincount(labels[idx], minlength=classes).argmax()) for g, idx in members.items()}
    key = {g: hashlib.sha256(paths[idx[0]].encode()).hexdigest() for g, idx in members.items()}
    test = np.zeros(len(paths), dtype=bool)
    taken = np.zeros(classes, dtype=np.int64)
    for g in sorted(members, key=key.__getitem__):
        idx = members[g]
        if int((labels[idx] == home[g]).sum()) <= target[home[g]] - taken[home[g]]:
            test[idx] = True
            taken += np.bincount(labels[idx], minlength=classes)
    for c in range(classes):
        own = sorted((len(idx), key[g], g) for g, idx in members.items() if home[g] == c)
        if target[c] and not taken[c] and len(own) >= 2:
            idx = members[own[0][2]]
            test[idx] = True
            taken += np.bincount(labels[idx], minlength=classes)
    return test


def _read(path: str) -> tuple[str, np.ndarray | None]:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    return hashlib.sha256(data).hexdigest(), render(data)


def _cache_key(root: Path, files: list[tuple[str, int, str]]) -> str:
    settings = (NAME, VERSION, SIZE, BACKGROUND, TEST_FRACTION, MAX_PIXELS, THUMB, NEAR, CLASSES)
    h = hashlib.sha256(repr(settings).encode())
    h.update(str(root.resolve()).encode())
    for rel, label, real in files:
        st = os.stat(real)
        h.update(f"\0{rel}:{label}:{os.path.relpath(real, root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def cache_path(key: str) -> Path:
    base = cache_root()
    return base / "datasets" / f"{NAME}-{key}.npz"


def build(root: Path, files: list[tuple[str, int, str]]) -> dict[str, np.ndarray]:
    """The images, labels, sides (0 train, 1 test), paths and groups of the dataset, from the files."""
    decoded = parallel_map(lambda entry: _read(entry[2]), files)
    kept, digests, skipped, copies = [], set(), 0, 0
    for (rel, label, _), (digest, image) in zip(files, decoded):
        if image is None:
            skipped += 1
        elif digest in digests:
            copies += 1
        else:
            digests.add(digest)
            kept.append((rel, label, image))
    if not kept:
        raise DatasetError(f"{root}: none of the {len(files)} clip-art files of the {NAME} classes could be read")
    paths = [rel for rel, _, _ in kept]
    labels = np.array([label for _, label, _ in kept], dtype=np.int64)
    images = np.stack([image for _, _, image in kept]).transpose(0, 3, 1, 2).copy()
    groups = group_near_duplicates(paths, images)
    test = split_groups(paths, labels, groups, TEST_FRACTION)
    return {"images": images, "labels": labels, "test": test.astype(np.uint8), "groups": groups,
            "paths": np.array(paths), "counts": np.array([len(files), skipped, copies], dtype=np.int64)}


def _load_cached(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in ("images", "labels", "test", "groups", "paths", "counts")}
    except (OSError, ValueError, KeyError, EOFError):
        return None


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write the cache file atomically; an unwritable cache is no error (the set is built again)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buffer.getvalue())


def load_clipart10(root: str | os.PathLike | None = None, image_size: int | None = None) -> ImageDataset:
    from .builtin import at_size

    folder = find_root(root)
    files = list_files(folder)
    cache = cache_path(_cache_key(folder, files))
    arrays = _load_cached(cache)
    source = "cache"
    if arrays is None:
        arrays, source = build(folder, files), "built"
        _save(cache, arrays)
    images, labels = torch.from_numpy(arrays["images"]), torch.from_numpy(arrays["labels"])
    test = torch.from_numpy(arrays["test"].astype(bool))
    empty = [CLASS_NAMES[c] for c in range(len(CLASSES)) if not bool(((labels == c) & ~test).any())]
    if empty:
        raise DatasetError(f"{folder}: no training images for class {', '.join(empty)}")
    train_split = Split.in_memory(images[~test], labels[~test])
    test_split = Split.in_memory(images[test], labels[test])
    mean, std = channel_stats(images[~test])
    listed, skipped, copies = (int(v) for v in arrays["counts"])
    info = {"source": str(folder), "package": PACKAGE, "cache": str(cache), "build": source, "files": listed,
            "left_out": skipped, "same_bytes": copies, "groups": int(np.unique(arrays["groups"]).size)}
    # A mirrored drawing is the same object.
    return at_size(ImageDataset(name=NAME, class_names=CLASS_NAMES, image_size=SIZE, channels=3, mean=mean, std=std,
                                train=train_split, test=test_split, hflip=True, info=info), image_size)
