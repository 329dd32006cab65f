"""Parquet image datasets in the Hugging Face ``datasets`` Image layout.

Column ``image`` = struct{bytes: binary, path: string} (a plain binary column is accepted too),
column ``label`` = int64. Class names come from the ``huggingface`` schema metadata
(``info.features.label.names`` of a ClassLabel) when present. A directory is read recursively,
so a distilled store (``<run>/label=<c>/part-*.parquet``) loads like any other Parquet dataset.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .. import codec
from .base import DatasetError, ImageDataset, Split
from .common import SPLIT_LAYOUT, all_grey, decode_bytes, hash_parts, made_split, resize_uint8, sample_stats, stratified_split
from .parallel import parallel_map

DEFAULT_SIZE = 224
_HIVE_LABEL = re.compile(r"^label=(-?\d+)$")


def _split_role(rel: Path) -> str:
    """'train', 'test', 'validation' or '' from the file name, else from its folders (nearest first)."""
    for token in [rel.name] + [p for p in reversed(rel.parent.parts)]:
        t = token.lower()
        if "train" in t:
            return "train"
        if "test" in t:
            return "test"
        if "validation" in t or "valid" in t or t == "val" or t.startswith("val-") or t.startswith("val_"):
            return "validation"
    return ""


def label_names(metadata: dict | None) -> list[str] | None:
    """The class names of a ClassLabel `label` in a file's `huggingface` schema metadata, if any."""
    if not metadata or b"huggingface" not in metadata:
        return None
    try:
        hf = json.loads(metadata[b"huggingface"])
        feature = hf["info"]["features"]["label"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(feature, dict) or "names" not in feature:
        return None
    return [str(n) for n in feature["names"]]


def fadrm_hflip(metadata: dict | None) -> bool | None:
    """Whether a flip keeps the label, as a file's `fadrm` metadata says (None: it does not)."""
    if not metadata or b"fadrm" not in metadata:
        return None
    try:
        meta = json.loads(metadata[b"fadrm"])
    except ValueError:
        return None
    for holder in (meta, meta.get("dataset") if isinstance(meta, dict) else None):
        if isinstance(holder, dict) and isinstance(holder.get("hflip"), bool):
            return holder["hflip"]
    return None


class _Rows:
    """Encoded images (bytes, or a file path to read on demand) and labels of one role."""

    def __init__(self):
        self.items: list[bytes | Path] = []
        self.labels: list[int] = []

    def extend(self, items, labels):
        self.items.extend(items)
        self.labels.extend(labels)

    def take(self, indices) -> "_Rows":
        out = _Rows()
        out.items = [self.items[i] for i in indices]
        out.labels = [self.labels[i] for i in indices]
        return out


def _read_item(item: bytes | Path) -> bytes:
    if isinstance(item, Path):
        try:
            return item.read_bytes()
        except OSError as exc:
            raise DatasetError(f"cannot read image file {item}: {exc}") from None
    return item


def _read_file(path: Path) -> tuple[list, list[int], dict | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
        schema = pf.schema_arrow
    except Exception as exc:
        raise DatasetError(f"cannot read Parquet file {path}: {exc}") from None
    names = schema.names
    if "image" not in names:
        raise DatasetError(f"{path} has no 'image' column (columns: {', '.join(names)})")
    columns = ["image"] + (["label"] if "label" in names else [])
    table = pf.read(columns=columns)
    col = table.column("image").combine_chunks()
    if pa.types.is_struct(col.type):
        fields = [col.type.field(i).name for i in range(col.type.num_fields)]
        data = col.field("bytes").to_pylist() if "bytes" in fields else [None] * len(col)
        paths = col.field("path").to_pylist() if "path" in fields else [None] * len(col)
    elif pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
        data, paths = col.to_pylist(), [None] * len(col)
    else:
        raise DatasetError(f"{path}: column 'image' has type {col.type}, expected struct{{bytes, path}} or binary")
    items = []
    for i, (b, p) in enumerate(zip(data, paths)):
        if b is not None:
            items.append(b)
        elif p:
            pp = Path(p)
            items.append(pp if pp.is_absolute() else path.parent / pp)
        else:
            raise DatasetError(f"{path}: row {i} has neither image bytes nor a path")
    if "label" in columns:
        labels = table.column("label").to_pylist()
    else:
        m = _HIVE_LABEL.match(path.parent.name)
        if not m:
            raise DatasetError(f"{path} has no 'label' column and is not under a label=<index> folder")
        labels = [int(m.group(1))] * len(items)
    labels = [-1 if v is None else int(v) for v in labels]
    return items, labels, schema.metadata


def _labelled(rows: _Rows) -> _Rows:
    return rows.take([i for i, y in enumerate(rows.labels) if y >= 0])


def _decoded_channels(item) -> int:
    try:
        return codec.stored_channels(_read_item(item))
    except codec.CodecError as exc:
        raise DatasetError(f"cannot decode image: {exc}") from None


def _fingerprint(rows: _Rows) -> str:
    parts = []
    for item, y in zip(rows.items, rows.labels):
        if isinstance(item, Path):
            size = item.stat().st_size if item.exists() else -1
            parts.append(f"path:{item.name}:{size}:{y}")
        else:
            parts.append(hash_parts([item, str(y)]))
    return hash_parts(parts)


def rows_split(rows: _Rows, channels: int, size: int, what: str) -> Split:
    """A split whose loader decodes the requested rows on the shared decode threads (parallel.py)."""
    items = rows.items

    def read(i: int) -> torch.Tensor:
        return resize_uint8(decode_bytes(_read_item(items[i]), channels, what=f"{what} row {i}"), size)

    def load(indices):
        idx = torch.as_tensor(indices, dtype=torch.long).flatten().tolist()
        if not idx:
            return torch.empty((0, channels, size, size), dtype=torch.uint8)
        return torch.stack(parallel_map(read, idx))

    return Split(labels=torch.as_tensor(rows.labels, dtype=torch.int64), load=load,
                 fingerprint_source=_fingerprint(rows))


def _is_store_run(root: Path) -> bool:
    from fadrm_ray.layout import RunLayout

    layout = RunLayout(root)
    return layout.config.is_file() or layout.units_dir.is_dir()


def load_parquet(path: str, image_size: int | None = None) -> ImageDataset:
    if not path:
        raise DatasetError("parquet needs a path: parquet:PATH")
    root = Path(path).expanduser()
    if not root.exists():
        raise DatasetError(f"Parquet path not found: {root}")
    if root.is_dir() and _is_store_run(root):
        # A run of this project's store: its manifests say which files belong to it (not the
        # leftovers of crashed attempts), and nothing is trained on until they match them. The
        # store's reader is a floor below the data sources (tests/test_layering.py).
        from fadrm_ray.store import open_run

        reader = open_run(root)
        reader.verify()
        files = sorted(reader.part_files(), key=lambda p: p.relative_to(root).as_posix())  # the order of the glob
        base = root
    elif root.is_dir():
        files = sorted((p for p in root.rglob("*.parquet") if p.is_file() and not p.name.startswith(".")),
                       key=lambda p: p.relative_to(root).as_posix())
        if not files:
            raise DatasetError(f"no .parquet files under {root}")
        base = root
    else:
        files, base = [root], root.parent

    roles: dict[str, _Rows] = {r: _Rows() for r in ("train", "test", "validation", "")}
    class_names = None
    hflip = None
    for f in files:
        items, labels, metadata = _read_file(f)
        names = label_names(metadata)
        if names is not None:
            if class_names is not None and names != class_names:
                raise DatasetError(f"{f}: class names differ from those of the other files")
            class_names = names
        flip = fadrm_hflip(metadata)
        hflip = flip if flip is not None else hflip
        roles[_split_role(f.relative_to(base))].extend(items, labels)

    train_rows = _labelled(roles["train"])
    test_rows = _labelled(roles["test"])
    if not len(test_rows.labels):
        test_rows = _labelled(roles["validation"])
    if train_rows.labels and test_rows.labels:
        layout = "files (train/test)"
    else:
        pool = train_rows
        if not pool.labels:
            pool = _Rows()
            for r in ("", "train", "test", "validation"):
                lab = _labelled(roles[r])
                pool.extend(lab.items, lab.labels)
        if not pool.labels:
            raise DatasetError(f"no labelled images in {root}")
        tr, te = stratified_split(torch.as_tensor(pool.labels, dtype=torch.int64))
        train_rows, test_rows = pool.take(tr.tolist()), pool.take(te.tolist())
        layout = SPLIT_LAYOUT
    if not train_rows.labels:
        raise DatasetError(f"no training images in {root}")

    top = max(max(train_rows.labels), max(test_rows.labels, default=-1))
    if class_names is None:
        class_names = [str(i) for i in range(top + 1)]
    elif top >= len(class_names):
        raise DatasetError(f"{root}: label {top} but only {len(class_names)} class names in the metadata")

    everything = train_rows.items + test_rows.items
    grey = all_grey(lambda i: _read_item(everything[i])[:65536], len(everything),
                    lambda i: _decoded_channels(everything[i]))
    channels = 1 if grey else 3
    if image_size is None:
        first = decode_bytes(_read_item(train_rows.items[0]), channels, what=f"{root} first image")
        h, w = first.shape[-2:]
        image_size = int(h) if h == w else DEFAULT_SIZE
    if image_size < 1:
        raise DatasetError(f"image_size must be positive, got {image_size}")

    train = rows_split(train_rows, channels, image_size, f"{root} train")
    test = rows_split(test_rows, channels, image_size, f"{root} test")
    mean, std, used = sample_stats(train)
    name = root.resolve().stem if root.is_file() else root.resolve().name
    return ImageDataset(name=f"parquet:{name}", class_names=class_names, image_size=image_size,
                        channels=channels, mean=mean, std=std, train=train, test=test,
                        hflip=True if hflip is None else hflip,
                        info={"source": "parquet", "path": str(root.resolve()), "files": len(files),
                              "layout": layout, "stats_images": used,
                              "test_split": made_split(layout)})
