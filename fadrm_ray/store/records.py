"""What one stored image is, and how a part file holds it.

A part file is one Parquet table with the columns ``image`` (the Hugging Face ``datasets``
Image layout: a struct of PNG ``bytes`` and a ``path``), ``label``, ``ipc_index``, ``ce_loss``
and ``bn_loss``. Its schema metadata carries the class names as a ``ClassLabel`` under the
``huggingface`` key, so ``datasets.load_dataset("parquet", data_files=...)`` reads it with
names, and the provenance the writer was given under the ``fadrm`` key.

Images go through `fadrm_ray.codec` (PNG, lossless): 1-channel images stay grey PNGs.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fadrm_ray import codec
from pydantic import BaseModel

from fadrm_ray.errors import InputError
from fadrm_ray.store.run_files import RunProvenance

COLUMNS = ("image", "label", "ipc_index", "ce_loss", "bn_loss")


class StoreError(InputError):
    """A run directory could not be written, read or understood."""


class IntegrityError(StoreError):
    """Stored data that is not what the run recorded: a changed, damaged or missing file."""


class RunIncomplete(StoreError):
    """A run without its manifest (`open_run` without `incomplete=True`). `writer` names the live
    process holding the run's writer lock ({pid, host, since}): a distill or a repair under way,
    whose run is not absent, only not finished yet; None when no one writes it."""

    def __init__(self, message: str, writer: dict | None = None):
        super().__init__(message)
        self.writer = writer


@dataclass
class ImageRecord:
    label: int  # global class index
    ipc_index: int
    image: torch.Tensor  # uint8 (C, H, W), C in {1, 3}
    ce_loss: float | None = None
    bn_loss: float | None = None


# ----------------------------------------------------------------------------------------------
# plain values for JSON and YAML


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


def json_dumps(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(to_plain(obj), indent=indent, sort_keys=False)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------------------------
# images


def check_image(image: Any, where: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor):
        raise StoreError(f"{where}: image must be a torch.Tensor, got {type(image).__name__}")
    if image.dtype != torch.uint8:
        raise StoreError(f"{where}: image must be uint8, got {image.dtype}")
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise StoreError(f"{where}: image must be (C, H, W) with C in {{1, 3}}, got {tuple(image.shape)}")
    return image.detach().cpu().contiguous()


def encode_image(image: torch.Tensor) -> bytes:
    """PNG bytes of a uint8 (C, H, W) image; 1-channel images stay grey PNGs."""
    return codec.encode_png(check_image(image, "encode_image"))


def decode_image(data: bytes, where: str = "") -> torch.Tensor:
    """uint8 (C, H, W) image from PNG bytes, keeping the stored channel count; `where` names the
    file and row in the error."""
    try:
        return codec.decode(data)
    except codec.CodecError as exc:
        raise IntegrityError(f"cannot decode the stored image{' at ' + where if where else ''}: {exc}") from None


# ----------------------------------------------------------------------------------------------
# part files


def hf_features(class_names: Sequence[str]) -> dict:
    """The ``datasets`` features of a part file, in column order."""
    return {
        "image": {"_type": "Image"},
        "label": {"names": list(class_names), "_type": "ClassLabel"},
        "ipc_index": {"dtype": "int64", "_type": "Value"},
        "ce_loss": {"dtype": "float64", "_type": "Value"},
        "bn_loss": {"dtype": "float64", "_type": "Value"},
    }


def part_schema(class_names: Sequence[str], provenance: BaseModel | dict | None = None) -> pa.Schema:
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
        b"fadrm": (provenance.model_dump_json() if isinstance(provenance, BaseModel)
                   else json_dumps(provenance or {}, indent=None)).encode(),
    }
    return pa.schema(fields, metadata=metadata)


def _opt_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)


def encode_part(records: list[ImageRecord], class_names: list[str], provenance: RunProvenance) -> bytes:
    """The bytes of one part file holding `records` (already checked and sorted by the caller)."""
    images = []
    for r in records:
        png = encode_image(r.image)
        images.append({"bytes": png, "path": f"{class_names[int(r.label)]}/ipc{int(r.ipc_index):05d}.png"})
    table = pa.Table.from_pydict(
        {
            "image": images,
            "label": [int(r.label) for r in records],
            "ipc_index": [int(r.ipc_index) for r in records],
            "ce_loss": [_opt_float(r.ce_loss) for r in records],
            "bn_loss": [_opt_float(r.bn_loss) for r in records],
        },
        schema=part_schema(class_names, provenance),
    )
    sink = pa.BufferOutputStream()
    # PNG bytes are already compressed; compressing them again only costs time.
    pq.write_table(table, sink, compression="none")
    return sink.getvalue().to_pybytes()


def _schema_metadata(path: Path) -> dict[bytes, bytes]:
    # Only the footer is read, however large the part.
    try:
        return pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"cannot read part file {path}: {e}") from e


def part_class_names(path: Path) -> list[str] | None:
    """The class names a part file records, or None if it records none."""
    raw = _schema_metadata(path).get(b"huggingface")
    if raw is None:
        return None
    try:
        names = json.loads(raw)["info"]["features"]["label"]["names"]
    except (ValueError, KeyError, TypeError):
        return None
    return [str(n) for n in names]


def part_provenance(path: Path) -> RunProvenance | None:
    """The provenance a part file records (None if none or unreadable)."""
    raw = _schema_metadata(path).get(b"fadrm")
    return None if raw is None else RunProvenance.from_json(raw)


def first_image_shape(path: Path) -> list[int] | None:
    """(C, H, W) of the first image of a part; only that image is decoded."""
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1, columns=["image"])
        batch = next(batches, None)
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"cannot read part file {path}: {e}") from e
    if batch is None or batch.num_rows == 0:
        return None
    return list(decode_image(batch.column(0)[0].as_py()["bytes"], f"{path} row 0").shape)
