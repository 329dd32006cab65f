"""Faults to inject into a store run, for bench/faults.py and the tests of what readers do.

Each function damages one run in place the way storage, a copy or a person might, and keeps
the part file's modification time, as bit rot does, so that no check can lean on it.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fadrm_ray.layout import RunLayout


def _keep_mtime(path: Path):
    st = path.stat()
    return lambda: os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def first_part(run_dir, label: int | None = None) -> Path:
    parts = RunLayout(run_dir).parts_on_disk()
    return next(p for p in parts if label is None or RunLayout.label_of(p) == label)


def _rewrite_table(path: Path, change) -> None:
    restore = _keep_mtime(path)
    table = pq.read_table(path)
    rows = table.to_pylist()
    change(rows)
    new = pa.Table.from_pylist(rows, schema=table.schema)
    sink = io.BytesIO()
    pq.write_table(new, sink, compression="none")
    path.write_bytes(sink.getvalue())
    restore()


def replace_png(run_dir, label: int | None = None, row: int = 0) -> Path:
    """Put another valid PNG (the next row's, or any other part's) into one row of a part."""
    path = first_part(run_dir, label)
    others = [p for p in RunLayout(run_dir).parts_on_disk() if p != path]
    donor = pq.read_table(others[0] if others else path).to_pylist()[-1]["image"]["bytes"]

    def change(rows):
        rows[row]["image"] = {**rows[row]["image"], "bytes": donor}
    _rewrite_table(path, change)
    return path


def swap_rows(run_dir, label: int | None = None) -> Path:
    """Swap the images of the first two rows of a part (labels and indices stay)."""
    path = next(p for p in RunLayout(run_dir).parts_on_disk()
                if (label is None or RunLayout.label_of(p) == label) and pq.ParquetFile(p).metadata.num_rows > 1)

    def change(rows):
        rows[0]["image"], rows[1]["image"] = rows[1]["image"], rows[0]["image"]
    _rewrite_table(path, change)
    return path


def flip_png_bit(run_dir, label: int | None = None) -> Path:
    """Flip one bit inside the first stored PNG of a part (the file still parses as Parquet)."""
    path = first_part(run_dir, label)
    restore = _keep_mtime(path)
    data = bytearray(path.read_bytes())
    png = pq.read_table(path).to_pylist()[0]["image"]["bytes"]
    at = data.find(png) + len(png) // 2
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    restore()
    return path


def flip_footer_bit(run_dir) -> Path:
    """Flip one bit in the Parquet footer (the schema and metadata) of a part."""
    path = first_part(run_dir)
    restore = _keep_mtime(path)
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01
    path.write_bytes(bytes(data))
    restore()
    return path


def truncate_part(run_dir, keep: float = 0.5) -> Path:
    path = first_part(run_dir)
    restore = _keep_mtime(path)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    restore()
    return path


def delete_part(run_dir) -> Path:
    path = first_part(run_dir)
    path.unlink()
    return path


def zero_unit_sha(run_dir) -> Path:
    """Set the sha256 a unit manifest records for its first file to zeros."""
    layout = RunLayout(run_dir)
    path = layout.unit(layout.unit_ids()[0])
    manifest = json.loads(path.read_text())
    manifest["files"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    return path


def delete_unit_manifest(run_dir, index: int = 0) -> Path:
    layout = RunLayout(run_dir)
    path = layout.unit(layout.unit_ids()[index])
    path.unlink()
    return path


def delete_run_manifest(run_dir) -> Path:
    path = RunLayout(run_dir).manifest
    path.unlink()
    return path


def garble_run_manifest(run_dir) -> Path:
    path = RunLayout(run_dir).manifest
    path.write_text(path.read_text()[:-20])
    return path
