"""The Parquet store of distilled images.

Layout of one run (``run_dir = <root>/<run_id>``)::

    config.yaml                                   the run's configuration
    label=<c>/part-ipc<start>-<end>.parquet       images of class c, ipc_index in [start, end)
    units/<unit_id>.json                          one manifest per finished unit (files + sha256)
    manifest.json                                 the run manifest, written when the run completes

Finished work is never lost and never half-written: every file is written to a temporary name
in its final directory, fsynced, then renamed over the final name. A unit counts as done only
when its manifest exists and every file it lists still has the recorded sha256, so a crash at
any point leaves either the old state or the new one, and a restarted coordinator can rebuild
its ledger from disk with :meth:`RunStore.finished_units`.

Part files use the Hugging Face ``datasets`` Image layout for the ``image`` column and carry
the class names as a ``ClassLabel`` in the ``huggingface`` schema metadata, so
``datasets.load_dataset("parquet", data_files=...)`` reads them with names; the ``fadrm``
metadata key holds the provenance the writer was given.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

import yaml

from fadrm_ray import codec
from fadrm_ray.fileio import _fsync_dir, atomic_write_bytes, atomic_write_text, sha256_file

__all__ = [
    "ImageRecord",
    "StoreError",
    "RunStore",
    "RunReader",
    "open_run",
    "export_imagefolder",
    "export_tensors",
    "part_name",
    "sha256_file",
]

CONFIG_NAME = "config.yaml"
MANIFEST_NAME = "manifest.json"
UNITS_DIR = "units"
PART_GLOB = "label=*/part-ipc*-*.parquet"
_PART_RE = re.compile(r"^part-ipc(\d+)-(\d+)\.parquet$")
_LABEL_DIR_RE = re.compile(r"^label=(\d+)$")
_UNIT_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_COLUMNS = ("image", "label", "ipc_index", "ce_loss", "bn_loss")


class StoreError(ValueError):
    """A run directory could not be written, read or understood."""


@dataclass
class ImageRecord:
    label: int  # global class index
    ipc_index: int
    image: torch.Tensor  # uint8 (C, H, W), C in {1, 3}
    ce_loss: float | None = None
    bn_loss: float | None = None


# ----------------------------------------------------------------------------------------------
# small helpers


def part_name(ipc_start: int, ipc_end: int) -> str:
    """File name of the part holding ipc indices [ipc_start, ipc_end)."""
    return f"part-ipc{ipc_start:05d}-{ipc_end:05d}.parquet"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def to_plain(obj: Any) -> Any:
    """Turn config/provenance/stats values into JSON- and safe-YAML-friendly built-ins.

    Callers pass dataclasses, Paths, tuples and tensors; recording them as plain values keeps
    the files readable without this package. Anything unknown is recorded by its ``str``
    rather than failing a unit that already did its expensive work.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value)
    if isinstance(obj, dict):
        return {str(k) if not isinstance(k, (int, float, bool)) else k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((to_plain(v) for v in obj), key=repr)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_plain(dataclasses.asdict(obj))
    if isinstance(obj, torch.Tensor):
        return to_plain(obj.detach().cpu().tolist())
    if isinstance(obj, bytes):
        return obj.hex()
    tolist = getattr(obj, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        try:
            return to_plain(tolist())
        except Exception:
            pass
    return str(obj)


def _json_dumps(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(to_plain(obj), indent=indent, sort_keys=False)


def hf_features(class_names: Sequence[str]) -> dict:
    """The ``datasets`` features of a part file, in column order."""
    return {
        "image": {"_type": "Image"},
        "label": {"names": list(class_names), "_type": "ClassLabel"},
        "ipc_index": {"dtype": "int64", "_type": "Value"},
        "ce_loss": {"dtype": "float64", "_type": "Value"},
        "bn_loss": {"dtype": "float64", "_type": "Value"},
    }


def part_schema(class_names: Sequence[str], provenance: dict | None = None) -> pa.Schema:
    # Every field stays nullable: `datasets` only trusts the metadata features for a column
    # when its field equals the one it would build, and it builds nullable fields.
    fields = [
        pa.field("image", pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])),
        pa.field("label", pa.int64()),
        pa.field("ipc_index", pa.int64()),
        pa.field("ce_loss", pa.float64()),
        pa.field("bn_loss", pa.float64()),
    ]
    metadata = {
        b"huggingface": json.dumps({"info": {"features": hf_features(class_names)}}).encode(),
        b"fadrm": _json_dumps(provenance or {}, indent=None).encode(),
    }
    return pa.schema(fields, metadata=metadata)


def _check_image(image: Any, where: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor):
        raise StoreError(f"{where}: image must be a torch.Tensor, got {type(image).__name__}")
    if image.dtype != torch.uint8:
        raise StoreError(f"{where}: image must be uint8, got {image.dtype}")
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise StoreError(f"{where}: image must be (C, H, W) with C in {{1, 3}}, got {tuple(image.shape)}")
    return image.detach().cpu().contiguous()


def encode_image(image: torch.Tensor) -> bytes:
    """PNG bytes of a uint8 (C, H, W) image; 1-channel images stay grey PNGs."""
    return codec.encode_png(_check_image(image, "encode_image"))


def decode_image(data: bytes) -> torch.Tensor:
    """uint8 (C, H, W) image from PNG bytes, keeping the stored channel count."""
    try:
        return codec.decode(data)
    except codec.CodecError as exc:
        raise StoreError(f"cannot decode a stored image: {exc}") from None


def _opt_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)


def _safe_relpath(run_dir: Path, rel: str) -> Path | None:
    """``run_dir / rel`` if ``rel`` stays inside the run; manifests are data, not trusted paths."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts:
        return None
    return run_dir / p


def _read_json(path: Path) -> dict | None:
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _label_of_part(path: Path) -> int | None:
    m = _LABEL_DIR_RE.match(path.parent.name)
    return int(m.group(1)) if m else None


def _range_of_part(path: Path) -> tuple[int, int] | None:
    m = _PART_RE.match(path.name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _part_sort_key(path: Path) -> tuple:
    label = _label_of_part(path)
    rng = _range_of_part(path)
    return (label if label is not None else -1, rng or (-1, -1), str(path))


# ----------------------------------------------------------------------------------------------
# writing


class RunStore:
    """Writer side of one run directory. Safe to use from several processes on disjoint units."""

    def __init__(self, root: str | os.PathLike, run_id: str):
        if not run_id or "/" in run_id or run_id in (".", ".."):
            raise StoreError(f"invalid run_id {run_id!r}")
        self.root = Path(root)
        self.run_id = run_id
        self.run_dir = self.root / run_id

    def __repr__(self) -> str:
        return f"RunStore({str(self.run_dir)!r})"

    # -- paths
    @property
    def units_dir(self) -> Path:
        return self.run_dir / UNITS_DIR

    @property
    def config_path(self) -> Path:
        return self.run_dir / CONFIG_NAME

    @property
    def manifest_path(self) -> Path:
        return self.run_dir / MANIFEST_NAME

    def unit_path(self, unit_id: str) -> Path:
        _check_unit_id(unit_id)
        return self.units_dir / f"{unit_id}.json"

    def part_path(self, label: int, ipc_start: int, ipc_end: int) -> Path:
        return self.run_dir / f"label={int(label)}" / part_name(ipc_start, ipc_end)

    # -- config
    def write_config(self, config: dict) -> Path:
        text = yaml.safe_dump(to_plain(config), sort_keys=False)
        return atomic_write_text(self.config_path, text)

    def read_config(self) -> dict:
        if not self.config_path.exists():
            return {}
        with open(self.config_path, "r", encoding="utf-8") as f:
            return yaml.safe_load(f) or {}

    # -- unit ledger
    def _load_unit_manifest(self, unit_id: str) -> dict | None:
        data = _read_json(self.unit_path(unit_id))
        if data is None or data.get("unit_id") != unit_id or not isinstance(data.get("files"), list):
            return None
        return data

    def _verify(self, manifest: dict) -> bool:
        for entry in manifest["files"]:
            if not isinstance(entry, dict):
                return False
            path = _safe_relpath(self.run_dir, str(entry.get("path", "")))
            if path is None or not path.is_file():
                return False
            try:
                if sha256_file(path) != entry.get("sha256"):
                    return False
            except OSError:
                return False
        return True

    def unit_done(self, unit_id: str) -> bool:
        """True only if the unit's manifest exists and every file it lists has its sha256."""
        manifest = self._load_unit_manifest(unit_id)
        return manifest is not None and self._verify(manifest)

    def _unit_ids(self) -> list[str]:
        if not self.units_dir.is_dir():
            return []
        ids = []
        for p in self.units_dir.iterdir():
            if p.suffix == ".json" and not p.name.startswith(".") and _UNIT_ID_RE.match(p.stem):
                ids.append(p.stem)
        return sorted(ids)

    def unit_manifests(self) -> dict[str, dict]:
        """Every readable unit manifest, verified or not (cheap: no hashing)."""
        out = {}
        for uid in self._unit_ids():
            m = self._load_unit_manifest(uid)
            if m is not None:
                out[uid] = m
        return out

    def finished_units(self) -> dict[str, dict]:
        """unit_id -> unit manifest for every unit whose files all verify."""
        return {uid: m for uid, m in self.unit_manifests().items() if self._verify(m)}

    # -- writing a unit
    def write_unit(
        self,
        unit_id: str,
        records: list[ImageRecord],
        class_names: list[str],
        provenance: dict,
        stats: dict | None = None,
    ) -> dict:
        """Write one unit's images (one part file per label) and then its manifest.

        The manifest is written last, so a crash before it leaves the unit not done and a retry
        simply rewrites the same deterministic file names. A retry only ever replaces files of
        this unit: a part that another unit's manifest lists, or whose ipc range overlaps one,
        is refused.
        """
        _check_unit_id(unit_id)
        class_names = [str(c) for c in class_names]
        if not class_names:
            raise StoreError(f"unit {unit_id}: class_names is empty")
        if not records:
            raise StoreError(f"unit {unit_id}: no records to write")

        by_label: dict[int, list[ImageRecord]] = defaultdict(list)
        for i, rec in enumerate(records):
            label = int(rec.label)
            if not 0 <= label < len(class_names):
                raise StoreError(
                    f"unit {unit_id}: record {i} has label {label}, outside 0..{len(class_names) - 1}"
                )
            if int(rec.ipc_index) < 0:
                raise StoreError(f"unit {unit_id}: record {i} has negative ipc_index {rec.ipc_index}")
            _check_image(rec.image, f"unit {unit_id}, record {i}")
            by_label[label].append(rec)

        plan: list[tuple[int, int, int, list[ImageRecord], Path]] = []
        for label in sorted(by_label):
            recs = sorted(by_label[label], key=lambda r: int(r.ipc_index))
            ipcs = [int(r.ipc_index) for r in recs]
            if len(set(ipcs)) != len(ipcs):
                raise StoreError(f"unit {unit_id}: duplicate ipc_index for label {label}")
            start, end = ipcs[0], ipcs[-1] + 1
            plan.append((label, start, end, recs, self.part_path(label, start, end)))

        old = self._load_unit_manifest(unit_id)
        own_old = {str(e.get("path")) for e in old["files"]} if old else set()
        self._check_no_foreign_overlap(unit_id, plan, own_old)

        files = []
        for label, start, end, recs, path in plan:
            data = self._encode_part(recs, class_names, provenance)
            atomic_write_bytes(path, data)
            files.append(
                {
                    "path": path.relative_to(self.run_dir).as_posix(),
                    "rows": len(recs),
                    "sha256": sha256_bytes(data),
                    "label": label,
                    "ipc_start": start,
                    "ipc_end": end,
                }
            )

        manifest = {
            "unit_id": unit_id,
            "files": files,
            "rows": sum(f["rows"] for f in files),
            "stats": to_plain(stats or {}),
            "written_at": _utc_now(),
        }
        atomic_write_text(self.unit_path(unit_id), _json_dumps(manifest))

        # Files of an earlier attempt of this unit that the new attempt no longer produces.
        new_paths = {f["path"] for f in files}
        for rel in own_old - new_paths:
            stale = _safe_relpath(self.run_dir, rel)
            if stale is not None:
                try:
                    stale.unlink()
                except FileNotFoundError:
                    pass
        return manifest

    def _check_no_foreign_overlap(self, unit_id: str, plan, own_old: set[str]) -> None:
        # Listing the label directories is cheap; unit manifests are read only when some file
        # there could clash, which in a healthy run happens only on a retry after a crash.
        suspects: list[tuple[str, int, int, int]] = []
        for label, start, end, _, path in plan:
            if not path.parent.is_dir():
                continue
            for existing in path.parent.iterdir():
                rng = _range_of_part(existing)
                if rng is None:
                    continue
                rel = existing.relative_to(self.run_dir).as_posix()
                if rel in own_old:
                    continue
                if rng[0] < end and start < rng[1]:
                    suspects.append((rel, label, start, end))
        if not suspects:
            return
        owners: dict[str, str] = {}
        for other_id, m in self.unit_manifests().items():
            if other_id == unit_id:
                continue
            for e in m["files"]:
                owners[str(e.get("path"))] = other_id
        for rel, label, start, end in suspects:
            if rel in owners:
                raise StoreError(
                    f"unit {unit_id}: label {label} ipc [{start}, {end}) clashes with {rel}, "
                    f"which belongs to unit {owners[rel]}"
                )
        # Files nobody lists are leftovers of a crashed attempt; readers go by the manifests.

    @staticmethod
    def _encode_part(recs: list[ImageRecord], class_names: list[str], provenance: dict) -> bytes:
        images = []
        for r in recs:
            png = encode_image(r.image)
            images.append({"bytes": png, "path": f"{class_names[int(r.label)]}/ipc{int(r.ipc_index):05d}.png"})
        schema = part_schema(class_names, provenance)
        table = pa.Table.from_pydict(
            {
                "image": images,
                "label": [int(r.label) for r in recs],
                "ipc_index": [int(r.ipc_index) for r in recs],
                "ce_loss": [_opt_float(r.ce_loss) for r in recs],
                "bn_loss": [_opt_float(r.bn_loss) for r in recs],
            },
            schema=schema,
        )
        sink = pa.BufferOutputStream()
        # PNG bytes are already compressed; compressing them again only costs time.
        pq.write_table(table, sink, compression="none")
        return sink.getvalue().to_pybytes()

    # -- completing the run
    def finalize(self, summary: dict) -> dict:
        """Write manifest.json marking the run complete; refuses if any unit fails to verify."""
        manifests = self.unit_manifests()
        bad = sorted(uid for uid, m in manifests.items() if not self._verify(m))
        if bad:
            shown = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise StoreError(
                f"cannot finalize {self.run_dir}: {len(bad)} unit(s) have missing or corrupted files: {shown}"
            )
        units = [manifests[uid] for uid in sorted(manifests)]
        files = [f for m in units for f in m["files"]]
        classes = sorted({int(f["label"]) for f in files})
        class_names: list[str] = []
        if files:
            class_names = _class_names_of(self.run_dir / files[0]["path"]) or []
        manifest = {
            "run_id": self.run_id,
            "complete": True,
            "finalized_at": _utc_now(),
            "rows": sum(int(f["rows"]) for f in files),
            "classes": classes,
            "class_names": class_names,
            "units": units,
            "summary": to_plain(summary or {}),
        }
        atomic_write_text(self.manifest_path, _json_dumps(manifest))
        return manifest

    def is_complete(self) -> bool:
        m = _read_json(self.manifest_path)
        return bool(m and m.get("complete") is True)


def _check_unit_id(unit_id: str) -> None:
    if not isinstance(unit_id, str) or not _UNIT_ID_RE.match(unit_id):
        raise StoreError(f"invalid unit_id {unit_id!r}: use letters, digits, '.', '_' and '-' only")


def _schema_metadata(path: Path) -> dict[bytes, bytes]:
    try:
        return pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"cannot read part file {path}: {e}") from e


def _class_names_of(path: Path) -> list[str] | None:
    raw = _schema_metadata(path).get(b"huggingface")
    if raw is None:
        return None
    try:
        names = json.loads(raw)["info"]["features"]["label"]["names"]
    except (ValueError, KeyError, TypeError):
        return None
    return [str(n) for n in names]


# ----------------------------------------------------------------------------------------------
# reading


class _StoreDataset(torch.utils.data.Dataset):
    """Keeps the PNG bytes and decodes on access, so large runs fit in memory compressed."""

    def __init__(self, pngs: list[bytes], labels: list[int], transform: Callable | None = None):
        self.pngs = pngs
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.pngs)

    def __getitem__(self, i: int):
        image = decode_image(self.pngs[i])
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[i]


class RunReader:
    """Read side of a run directory, complete or still being written."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise StoreError(f"not a FADRM run directory: {self.run_dir} does not exist or is not a directory")
        config_path = self.run_dir / CONFIG_NAME
        has_parts = next(iter(self.run_dir.glob(PART_GLOB)), None) is not None
        if not config_path.is_file() and not has_parts:
            raise StoreError(
                f"not a FADRM run directory: {self.run_dir} has no {CONFIG_NAME} and no label=*/part-*.parquet files"
            )
        self.config: dict = {}
        if config_path.is_file():
            try:
                with open(config_path, "r", encoding="utf-8") as f:
                    loaded = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise StoreError(f"cannot parse {config_path}: {e}") from e
            self.config = loaded if isinstance(loaded, dict) else {}
        m = _read_json(self.run_dir / MANIFEST_NAME)
        self.manifest: dict | None = m if m and m.get("complete") is True else None
        self._all_parts = self._discover_parts()
        self.class_names: list[str] = self._find_class_names()
        self.provenance: dict = self._find_provenance()

    def __repr__(self) -> str:
        return f"RunReader({str(self.run_dir)!r})"

    @property
    def run_id(self) -> str:
        return self.manifest.get("run_id", self.run_dir.name) if self.manifest else self.run_dir.name

    @property
    def complete(self) -> bool:
        return self.manifest is not None

    def _discover_parts(self) -> list[Path]:
        # Manifests name the files that belong to the run; a glob would also pick up leftovers
        # of crashed attempts. The glob is only the fallback for a bare copy of the part files.
        if self.manifest is not None:
            entries = [f for u in self.manifest.get("units", []) for f in u.get("files", [])]
        else:
            store = RunStore(self.run_dir.parent, self.run_dir.name)
            units = store.unit_manifests()
            entries = []
            for m in units.values():
                paths = [_safe_relpath(self.run_dir, str(f.get("path", ""))) for f in m["files"]]
                if all(p is not None and p.is_file() for p in paths):
                    entries.extend(m["files"])
            if not units:
                return sorted(self.run_dir.glob(PART_GLOB), key=_part_sort_key)
        parts = []
        for e in entries:
            p = _safe_relpath(self.run_dir, str(e.get("path", "")))
            if p is not None:
                parts.append(p)
        return sorted(set(parts), key=_part_sort_key)

    def _find_class_names(self) -> list[str]:
        for p in self._all_parts[:1]:
            names = _class_names_of(p)
            if names is not None:
                return names
        if self.manifest and self.manifest.get("class_names"):
            return [str(n) for n in self.manifest["class_names"]]
        names = self.config.get("class_names")
        return [str(n) for n in names] if isinstance(names, list) else []

    def _find_provenance(self) -> dict:
        for p in self._all_parts[:1]:
            raw = _schema_metadata(p).get(b"fadrm")
            if raw is not None:
                try:
                    data = json.loads(raw)
                except ValueError:
                    return {}
                return data if isinstance(data, dict) else {}
        return {}

    def part_files(self, classes: Iterable[int] | None = None) -> list[Path]:
        if classes is None:
            return list(self._all_parts)
        wanted = {int(c) for c in classes}
        return [p for p in self._all_parts if _label_of_part(p) in wanted]

    def _rows(self, classes, with_images: bool) -> list[dict]:
        columns = list(_COLUMNS) if with_images else [c for c in _COLUMNS if c != "image"]
        wanted = None if classes is None else {int(c) for c in classes}
        rows = []
        for path in self.part_files(classes):
            try:
                table = pq.read_table(path, columns=columns)
            except (OSError, pa.ArrowException) as e:
                raise StoreError(f"cannot read part file {path}: {e}") from e
            rel = path.relative_to(self.run_dir).as_posix()
            for row in table.to_pylist():
                if wanted is not None and int(row["label"]) not in wanted:
                    continue
                row["file"] = rel
                rows.append(row)
        rows.sort(key=lambda r: (r["label"], r["ipc_index"]))
        seen = set()
        for r in rows:
            key = (r["label"], r["ipc_index"])
            if key in seen:
                raise StoreError(f"{self.run_dir}: label {key[0]} ipc_index {key[1]} is stored twice")
            seen.add(key)
        return rows

    def records(self, classes: Iterable[int] | None = None) -> list[dict]:
        """Per-row fields without image bytes, sorted by (label, ipc_index)."""
        return [
            {
                "label": int(r["label"]),
                "ipc_index": int(r["ipc_index"]),
                "ce_loss": r["ce_loss"],
                "bn_loss": r["bn_loss"],
                "file": r["file"],
            }
            for r in self._rows(classes, with_images=False)
        ]

    def read(self, classes: Iterable[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """images uint8 (N, C, H, W), labels int64 (N,), ipc_index int64 (N,), by (label, ipc)."""
        rows = self._rows(classes, with_images=True)
        if not rows:
            empty = torch.empty(0, dtype=torch.int64)
            return torch.empty((0, 0, 0, 0), dtype=torch.uint8), empty, empty.clone()
        images = [decode_image(r["image"]["bytes"]) for r in rows]
        shapes = {tuple(im.shape) for im in images}
        if len(shapes) > 1:
            raise StoreError(
                f"{self.run_dir}: images have different shapes {sorted(shapes)}; read fewer classes or use as_dataset()"
            )
        labels = torch.tensor([r["label"] for r in rows], dtype=torch.int64)
        ipcs = torch.tensor([r["ipc_index"] for r in rows], dtype=torch.int64)
        return torch.stack(images), labels, ipcs

    def as_dataset(self, classes: Iterable[int] | None = None, transform: Callable | None = None):
        rows = self._rows(classes, with_images=True)
        return _StoreDataset(
            [r["image"]["bytes"] for r in rows], [int(r["label"]) for r in rows], transform
        )

    def info(self) -> dict:
        counts: dict[int, int] = defaultdict(int)
        for path in self._all_parts:
            labels = pq.read_table(path, columns=["label"]).column("label").to_pylist()
            for label in labels:
                counts[int(label)] += 1
        image_shape = None
        if self._all_parts:
            first = pq.read_table(self._all_parts[0], columns=["image"]).column("image")
            if len(first):
                image_shape = list(decode_image(first[0].as_py()["bytes"]).shape)
        summary = (self.manifest or {}).get("summary", {})
        units = (self.manifest or {}).get("units", [])
        written = sorted(u.get("written_at") for u in units if u.get("written_at"))
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "complete": self.complete,
            "rows": sum(counts.values()),
            "classes": sorted(counts),
            "num_classes": len(self.class_names),
            "class_names": list(self.class_names),
            "images_per_class": {c: counts[c] for c in sorted(counts)},
            "image_shape": image_shape,
            "parts": len(self._all_parts),
            "config": _config_summary(self.config),
            "timings": {
                **(summary.get("timings", {}) if isinstance(summary.get("timings"), dict) else {}),
                "first_unit_written_at": written[0] if written else None,
                "last_unit_written_at": written[-1] if written else None,
                "finalized_at": (self.manifest or {}).get("finalized_at"),
            },
            "summary": summary,
        }


def _config_summary(config: dict) -> dict:
    """Scalar settings, one level of nesting flattened as ``section.key``; lists and deeper
    structures are left to config.yaml itself."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                if v2 is None or isinstance(v2, (bool, int, float, str)):
                    out[f"{k}.{k2}"] = v2
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[str(k)] = v
    return out


def open_run(run_dir: str | os.PathLike) -> RunReader:
    return RunReader(run_dir)


# ----------------------------------------------------------------------------------------------
# exports

_UNSAFE_DIR_CHARS = re.compile(r"[/\\\x00]")


def imagefolder_names(class_names: Sequence[str]) -> tuple[list[str], bool]:
    """Folder name per class index, and whether an index prefix was needed.

    torchvision's ImageFolder numbers classes by the sorted folder names, so the plain names are
    kept only when they already sort in class-index order (and are unique and usable as folder
    names); otherwise every folder gets a zero-padded index prefix, e.g. ``003_cat``.
    """
    cleaned = [_UNSAFE_DIR_CHARS.sub("_", str(n)).strip() for n in class_names]
    usable = all(c and c not in (".", "..") for c in cleaned) and len(set(cleaned)) == len(cleaned)
    if usable and cleaned == sorted(cleaned):
        return cleaned, False
    width = max(3, len(str(max(len(class_names) - 1, 0))))
    return [f"{i:0{width}d}_{c}" if c not in ("", ".", "..") else f"{i:0{width}d}" for i, c in enumerate(cleaned)], True


def export_imagefolder(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, classes: Iterable[int] | None = None
) -> int:
    """Write ``out_dir/<class folder>/ipc<k>.png`` plus ``classes.json``; returns the image count.

    The export is built in a sibling temporary directory and renamed into place, so ``out_dir``
    is either absent or complete. ``out_dir`` must not exist or be empty. With ``classes`` given,
    ImageFolder numbers only the exported folders; ``classes.json`` maps them to global indices.
    """
    reader = RunReader(run_dir)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise StoreError(f"export target {out_dir} exists and is not an empty directory")
    if not reader.class_names:
        raise StoreError(f"{reader.run_dir}: no class names recorded; cannot name class folders")
    folders, prefixed = imagefolder_names(reader.class_names)
    rows = reader._rows(classes, with_images=True)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for r in rows:
            label = int(r["label"])
            if label >= len(folders):
                raise StoreError(f"{reader.run_dir}: label {label} has no class name")
            target = tmp / folders[label] / f"ipc{int(r['ipc_index']):05d}.png"
            target.parent.mkdir(exist_ok=True)
            with open(target, "wb") as f:
                f.write(r["image"]["bytes"])
        present = sorted({int(r["label"]) for r in rows})
        mapping = {
            "prefixed": prefixed,
            "classes": [
                {"index": i, "name": reader.class_names[i], "folder": folders[i], "exported": i in present}
                for i in range(len(folders))
            ],
            "imagefolder_index": {folders[c]: k for k, c in enumerate(present)},
        }
        (tmp / "classes.json").write_text(_json_dumps(mapping), encoding="utf-8")
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(out_dir.parent)
    return len(rows)


def export_tensors(
    run_dir: str | os.PathLike, out_file: str | os.PathLike, classes: Iterable[int] | None = None
) -> int:
    """``torch.save`` of {images uint8, labels int64, ipc_index int64, class_names}; returns N."""
    reader = RunReader(run_dir)
    images, labels, ipcs = reader.read(classes)
    buf = io.BytesIO()
    torch.save(
        {
            "images": images,
            "labels": labels,
            "ipc_index": ipcs,
            "class_names": list(reader.class_names),
            "run_id": reader.run_id,
        },
        buf,
    )
    atomic_write_bytes(out_file, buf.getvalue())
    return int(labels.numel())
