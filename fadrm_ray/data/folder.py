"""torchvision ImageFolder layout, decoded on demand.

``PATH/train/<class>/*`` with ``PATH/test/<class>/*`` (or ``PATH/val/<class>/*``); ImageNet's
flat ``PATH/val/*`` with its labels in ``LOC_val_solution.csv`` (imagenet_val.py); without a
test folder, ``PATH/train/<class>/*`` or ``PATH/<class>/*`` gets a deterministic stratified 80/20
split. Class index = position of the folder name in sorted order, the torchvision convention
(for ImageNet: sorted wnids, torchvision's ImageNet order).

The listing (files, labels, fingerprints) is made once per folder and reused from a cache file
while the folders are unchanged (listing.py); images are read and decoded on several threads
(parallel.py).

Listing checks every image file (its header and its end, `codec.check_file`). A folder with files
that cannot be read is refused, naming them, unless they are skipped (`skip_bad_images`, the
spec `imagefolder+skip-bad-images:PATH`): then they are left out of both splits and the
fingerprint, which covers the files kept, and the dataset says which (`info["skipped"]`, and
`describe()` for the run's record). Grey, RGBA and paletted images converted to the dataset's
channels, and files in class folders that are not images, are counted in one note
(`info["notes"]`).
"""
from __future__ import annotations

import os
import stat
import time
from collections import Counter
from pathlib import Path

import torch

from .. import codec
from .base import DatasetError, ImageDataset, Split
from .spec import SKIP_BAD_IMAGES
from .common import SPLIT_LAYOUT, decode_bytes, hash_parts, made_split, resize_uint8, sample_stats, \
    stratified_split
from .imagenet_val import SOLUTION_CSV, find_solution, label_flat_files
from .listing import (FolderListing, SplitListing, check_files, conversion_note, load_listing, refusal, save_listing,
                      settled, skipped_note, stat_key)
from .parallel import parallel_map

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".avif")
DEFAULT_SIZE = 224
SKIP_FLAG = f"--{SKIP_BAD_IMAGES}"
# The skipped files a run's record names (it counts all of them).
RECORDED_SKIPPED = 100


class FolderDataset(ImageDataset):
    """An image folder's dataset: its description (what a run records) counts and names the files
    it left out as unreadable, where it skipped any."""

    def describe(self) -> dict:
        described = super().describe()
        skipped = self.info.get("skipped") or []
        if skipped:
            described["skipped_images"] = len(skipped)
            described["skipped_files"] = skipped[:RECORDED_SKIPPED]
        return described


def _class_dirs(root: Path) -> list[str]:
    """The class folders of `root`, sorted by name (linked folders count; hidden ones, such as
    .git or .ipynb_checkpoints, do not: a dataset never has them)."""
    try:
        with os.scandir(root) as entries:
            return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []


def _image_name(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class _Tree:
    """What a listing of one folder saw: the (mtime, size) of every folder it listed (and of the
    label file), and the newest modification time of anything in it."""

    def __init__(self, root: Path):
        self.root = root
        self.watched: dict[str, tuple[int, int]] = {}
        self.newest = 0
        self.strays = 0  # files in class folders that are not images

    def watch(self, rel: str) -> None:
        try:
            key = stat_key(os.path.join(self.root, rel or "."))
        except OSError as exc:
            raise DatasetError(f"cannot read {self.root / rel}: {exc}") from None
        self.add(rel or ".", key)

    def add(self, rel: str, key: tuple[int, int]) -> None:
        self.watched[rel] = key
        self.newest = max(self.newest, key[0])


def _walk_class(root: Path, rel_dir: str) -> tuple[list[tuple[str, int]], dict[str, tuple[int, int]], int, int]:
    """The image files under one class folder, subfolders included, in path order (by
    components), each (path relative to `root`, size); the (mtime, size) of every folder walked;
    the newest mtime seen; how many other files (not hidden) it holds. Linked subfolders are
    followed, as torchvision's ImageFolder does; a link back up the tree lists the same files
    again, until the system's link limit stops it."""
    top = os.path.join(root, rel_dir)
    files: list[tuple[str, int]] = []
    folders: dict[str, tuple[int, int]] = {}
    newest = strays = 0
    for dirpath, _, names in os.walk(top, followlinks=True):
        rel = rel_dir + dirpath[len(top):].replace(os.sep, "/")
        try:
            folders[rel] = key = stat_key(dirpath)
        except OSError:
            continue
        newest = max(newest, key[0])
        for name in names:
            if not _image_name(name):
                strays += not name.startswith(".")
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:  # a broken link is listed by the walk but is no image
                continue
            if stat.S_ISREG(st.st_mode):
                files.append((f"{rel}/{name}", st.st_size))
                newest = max(newest, st.st_mtime_ns)
    files.sort(key=lambda f: f[0].split("/"))
    return files, folders, newest, strays


def _walk_split(tree: _Tree, split_rel: str, classes: list[str],
                strict: bool) -> tuple[list[str], list[int], list[int]]:
    """(files, sizes, labels) under `split_rel/<class>/` for every class (one thread per class
    folder), a class's files in path order. `strict`: every class folder must hold an image."""
    tree.watch(split_rel)
    present = [(label, name) for label, name in enumerate(classes)
               if os.path.isdir(os.path.join(tree.root, split_rel or ".", name))]
    walks = parallel_map(lambda item: _walk_class(tree.root, _join(split_rel, item[1])), present)
    files, sizes, labels = [], [], []
    for (label, name), (found, folders, newest, strays) in zip(present, walks):
        if strict and not found:
            raise DatasetError(f"class folder {tree.root / split_rel / name} has no images ({', '.join(IMAGE_EXTENSIONS)})")
        for rel, key in folders.items():
            tree.add(rel, key)
        tree.newest = max(tree.newest, newest)
        tree.strays += strays
        files.extend(rel for rel, _ in found)
        sizes.extend(size for _, size in found)
        labels.extend([label] * len(found))
    return files, sizes, labels


def _holds_images(folder: Path) -> bool:
    """Whether image files lie directly in `folder` (by name)."""
    with os.scandir(folder) as entries:
        return any(_image_name(entry.name) and not entry.is_dir() for entry in entries)


def _direct_images(folder: Path) -> list[tuple[str, int, int]]:
    """The image files directly in `folder`: (name, size, mtime_ns), by name."""
    out = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if _image_name(entry.name):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append((entry.name, st.st_size, st.st_mtime_ns))
    return sorted(out)


def _flat_val(tree: _Tree, val_dir: Path, classes: list[str],
              train_dir: Path) -> tuple[list[str], list[int], list[int]]:
    """(files, sizes, labels) of ImageNet's flat validation folder, labelled by its solution CSV;
    ordered by label, then name (the order of the same images in class folders)."""
    solution = find_solution(tree.root, val_dir) if val_dir.name == "val" else None
    if solution is None:
        raise DatasetError(f"{val_dir} holds images but no class folders, and no {SOLUTION_CSV} "
                           f"(in {tree.root} or {val_dir}) gives their labels")
    tree.watch(val_dir.name)
    tree.watch(solution.relative_to(tree.root).as_posix())
    found = _direct_images(val_dir)
    for _, _, mtime in found:
        tree.newest = max(tree.newest, mtime)
    labels = label_flat_files([name for name, _, _ in found], solution, classes, train_dir)
    order = sorted(range(len(found)), key=lambda i: (labels[i], found[i][0]))
    return ([f"{val_dir.name}/{found[i][0]}" for i in order], [found[i][1] for i in order],
            [labels[i] for i in order])


def _test_dir(root: Path) -> Path | None:
    """The held-out folder: the first of test/ and val/ that has labels (class folders, or for
    val/ a solution CSV), else the first that exists."""
    found = [root / name for name in ("test", "val") if (root / name).is_dir()]
    for folder in found:
        if _class_dirs(folder) or (folder.name == "val" and find_solution(root, folder) is not None):
            return folder
    return found[0] if found else None


def _fingerprint(files: list[str], sizes: list[int], labels: list[int]) -> str:
    return hash_parts(sorted(f"{rel}:{size}:{y}" for rel, size, y in zip(files, sizes, labels)))


def _split_listing(files: list[str], sizes: list[int], labels: list[int], keep=None) -> SplitListing:
    if keep is not None:
        files, sizes, labels = ([v[i] for i in keep] for v in (files, sizes, labels))
    return SplitListing(list(files), list(labels), _fingerprint(files, sizes, labels))


def _paths(root: Path, files: list[str]) -> list[str]:
    base = str(root)
    if base == ".":
        return list(files)
    prefix = base if base.endswith(os.sep) else base + os.sep
    return [prefix + rel for rel in files]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise DatasetError(f"cannot read image file {path}: {exc}") from None


def _layout(tree: _Tree) -> tuple[str, list[str], tuple, tuple | None]:
    """(layout, classes, train, test): `train` and `test` as (files, sizes, labels); `test` None
    when the held-out images are to be split off `train` (80/20)."""
    root = tree.root
    train_dir = root / "train"
    if not train_dir.is_dir():
        classes = _class_dirs(root)
        if not classes:
            raise DatasetError(f"no class folders in {root} (expected PATH/<class>/*.png or PATH/train/<class>/...)")
        return f"flat ({SPLIT_LAYOUT})", classes, _walk_split(tree, "", classes, strict=True), None
    classes = _class_dirs(train_dir)
    if not classes:
        raise DatasetError(f"no class folders in {train_dir}")
    train = _walk_split(tree, "train", classes, strict=True)
    test_dir = _test_dir(root)
    if test_dir is None:
        return f"train ({SPLIT_LAYOUT})", classes, train, None
    held_out = _class_dirs(test_dir)
    extra = sorted(set(held_out) - set(classes))
    if extra:
        raise DatasetError(f"{test_dir} has class folders missing from {train_dir}: {', '.join(extra)}")
    if held_out or not _holds_images(test_dir):
        return f"train/{test_dir.name}", classes, train, _walk_split(tree, test_dir.name, classes, strict=False)
    return (f"train/{test_dir.name} (flat, {SOLUTION_CSV})", classes, train,
            _flat_val(tree, test_dir, classes, train_dir))


def _readable(walked: tuple, checks: list) -> tuple[tuple, list]:
    """(files, sizes, labels) of `walked` and their checks, less the files that cannot be read."""
    keep = [i for i, c in enumerate(checks) if c.problem is None]
    if len(keep) == len(checks):
        return walked, checks
    return tuple([v[i] for i in keep] for v in walked), [checks[i] for i in keep]


def _check_every_class_readable(root: Path, classes: list[str], walked: tuple, kept: tuple,
                                checks: list) -> None:
    """A class whose training files all cannot be read is no class: refused, whatever is skipped."""
    empty = sorted(set(walked[2]) - set(kept[2]))
    if not empty:
        return
    label = empty[0]
    bad = [(rel, c.problem) for rel, y, c in zip(walked[0], walked[2], checks) if y == label]
    shown = ", ".join(f"{rel} ({why})" for rel, why in bad[:3])
    raise DatasetError(f"class {classes[label]!r} of {root} has no readable training image: its {len(bad)} image "
                       f"files cannot be read ({shown}{', ...' if len(bad) > 3 else ''})")


def list_folder(root: Path) -> tuple[FolderListing, bool]:
    """Walk the folder and check every image file once: its listing (the files that cannot be
    read left out of both splits), and whether the tree has been still long enough to keep it."""
    listed_at = time.time_ns()
    tree = _Tree(root)
    tree.watch("")
    layout, classes, train, test = _layout(tree)
    walked = train[0] + (test[0] if test is not None else [])
    checks = check_files(_paths(root, walked))
    bad = [(rel, c.problem) for rel, c in zip(walked, checks) if c.problem is not None]
    kept_train, train_checks = _readable(train, checks[:len(train[0])])
    _check_every_class_readable(root, classes, train, kept_train, checks[:len(train[0])])
    kept_checks = list(train_checks)
    if test is None:
        tr, te = stratified_split(torch.as_tensor(kept_train[2], dtype=torch.int64))
        train_listing = _split_listing(*kept_train, keep=tr.tolist())
        test_listing = _split_listing(*kept_train, keep=te.tolist())
        first = train_checks[int(tr[0])]
    else:
        kept_test, test_checks = _readable(test, checks[len(train[0]):])
        kept_checks += test_checks
        train_listing, test_listing = _split_listing(*kept_train), _split_listing(*kept_test)
        first = train_checks[0]
    modes = Counter(c.mode for c in kept_checks)
    channels = 1 if modes and all(codec.is_grey_mode(m) for m in modes) else 3
    listing = FolderListing(layout=layout, classes=classes, train=train_listing, test=test_listing, channels=channels,
                            first_shape=(first.height, first.width), watched=tree.watched, bad=bad,
                            modes=dict(sorted(modes.items())), strays=tree.strays)
    return listing, settled(tree.newest, listed_at)


def file_split(root: Path, split: SplitListing, channels: int, size: int) -> Split:
    """A split whose loader reads and decodes only the requested files, on the shared decode
    threads (parallel.py)."""
    paths = _paths(root, split.files)

    def read(i: int) -> torch.Tensor:
        return resize_uint8(decode_bytes(_read(paths[i]), channels, what=paths[i]), size)

    def load(indices):
        idx = torch.as_tensor(indices, dtype=torch.long).flatten().tolist()
        if not idx:
            return torch.empty((0, channels, size, size), dtype=torch.uint8)
        return torch.stack(parallel_map(read, idx))

    return Split(labels=torch.as_tensor(split.labels, dtype=torch.int64), load=load,
                 fingerprint_source=split.fingerprint)


def load_image_folder(path: str, image_size: int | None = None, skip_bad_images: bool = False) -> ImageDataset:
    """The image folder at `path`; refused where files in it cannot be read, unless
    `skip_bad_images` leaves them out."""
    if not path:
        raise DatasetError("imagefolder needs a path: imagefolder:PATH")
    root = Path(path).expanduser()
    if not root.exists():
        raise DatasetError(f"image folder not found: {root}")
    if not root.is_dir():
        raise DatasetError(f"image folder is not a directory: {root}")
    _refuse_a_split_folder(root)

    listing = load_listing(root)
    keep = listing is not None
    if listing is None:
        listing, keep = list_folder(root)
    name = f"imagefolder:{root.resolve().name}"
    if listing.bad and not skip_bad_images:
        if keep and listing.source == "walked":
            save_listing(root, listing)  # a second try, with the flag, is not checked again
        raise DatasetError(refusal(name, root, listing, SKIP_FLAG))
    if image_size is None:
        h, w = listing.first_shape
        image_size = h if h == w else DEFAULT_SIZE
    if image_size < 1:
        raise DatasetError(f"image_size must be positive, got {image_size}")

    train = file_split(root, listing.train, listing.channels, image_size)
    test = file_split(root, listing.test, listing.channels, image_size)
    stats = listing.stats.get(str(image_size))
    if stats is None:
        mean, std, used = sample_stats(train)
        listing.stats[str(image_size)] = [list(mean), list(std), used]
    else:
        mean, std, used = tuple(float(v) for v in stats[0]), tuple(float(v) for v in stats[1]), int(stats[2])
    if keep and (stats is None or listing.source == "walked"):
        save_listing(root, listing)
    notes = [line for line in [conversion_note(name, listing)] if line is not None]
    if listing.bad:
        notes += skipped_note(name, root, listing, SKIP_FLAG)
    return FolderDataset(name=name, class_names=listing.classes, image_size=image_size,
                         channels=listing.channels, mean=mean, std=std, train=train, test=test, hflip=True,
                         info={"source": "imagefolder", "path": str(root.resolve()), "layout": listing.layout,
                               "stats_images": used, "listing": listing.source,
                               "test_split": made_split(listing.layout), "notes": notes,
                               "skipped": [f"{rel} ({why})" for rel, why in listing.bad]})


def _refuse_a_split_folder(root: Path) -> None:
    """`imagefolder:X/train` beside `X/val` or `X/test` (the torchvision habit of naming the
    training folder) would be split again here and its test images never used: name X instead."""
    if root.name.lower() not in ("train", "training"):
        return
    siblings = [p.name for p in sorted(root.parent.iterdir()) if p.is_dir() and p.name.lower() in ("val", "test",
                                                                                                     "validation")]
    if siblings:
        raise DatasetError(f"{root} is the training folder of {root.parent}, which holds {'/ and '.join(siblings)}/ "
                           f"too: name the parent, imagefolder:{root.parent}, and its {siblings[0]}/ is the test split")
