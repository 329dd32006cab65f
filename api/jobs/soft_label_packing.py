"""The stored soft labels of a job packed into one file as they are read: memory bounded by a
batch, whatever the file's size.

`fadrm_ray.evaluation.soft_labels.pack_soft_labels` builds the whole packed file in memory (every
epoch's table, their concatenation, the Parquet bytes), about four times the file's size; at the
service's 2 GiB cap (FADRM_MAX_SOFT_LABEL_BYTES) that is more than a server can spare for one
download. `pack_to_file` writes the same file (the same rows in the same order, the same column
types, the same `fadrm_soft_labels` metadata: `StoredSoftLabels` and `fadrm train-student` read it
alike) with a Parquet writer fed one batch at a time, to a temporary name that is renamed into
place once whole (mode 0600): the memory it holds is a batch and a row group's buffer. The time
it takes is linear in the epochs (the buffer's size is kept as it grows, never summed again).

Each epoch file is checked before it is packed (`fadrm_ray.evaluation.verify_files.check_epochs`:
the sha256 its folder recorded as it was written, or read whole where none was), and a file that
fails, or fails to read while it is packed, is `SoftLabelDamaged` naming it: the service answers
409 with the repair (api.contract.service_errors), never a file of labels that are not the ones
stored.
"""
from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fadrm_ray.evaluation.soft_labels import (PACK_KEY, PACK_ROW_GROUP, PackPart, SoftLabelError, SoftLabelPack,
                                              stored_folder)
from fadrm_ray.evaluation.verify_files import SoftLabelDamaged, check_epochs

from api.jobs.private_files import private_output

BATCH_BYTES = 1 << 20     # of one batch read from an epoch file
BUFFER_BYTES = 2 << 20    # of the rows gathered into one row group (at most PACK_ROW_GROUP rows)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` in `schema`'s columns and types (a column it lacks as nulls), as a permissive
    concatenation of the epoch tables would have it."""
    if table.schema.equals(schema):  # the common case: the epochs of a folder share one schema
        return table
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
               for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


@contextlib.contextmanager
def _reading(path: Path):
    """A stored epoch file that fails to read (changed since it was checked) as SoftLabelDamaged;
    only its reads are inside (what this module does with the rows, the cast and the write, is not
    the file's damage), and running out of memory is not damage either."""
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        if isinstance(exc, pa.ArrowMemoryError) or (isinstance(exc, OSError) and exc.errno not in (None, errno.ENOENT)):
            raise  # the disk's or the memory's (api.contract.service_errors: a 503 while it is mended)
        raise SoftLabelDamaged(f"{path.parent.parent.name}/{path.parent.name}/{path.name}",
                               f"does not read ({type(exc).__name__})") from exc


def _epoch_tables(path: Path, seed: int, epoch: int):
    """The rows of one stored epoch file in batches of about BATCH_BYTES, each with its `seed` and
    `epoch`; its reads inside `_reading` (an exception of the consumer is not thrown in here)."""
    with _reading(path):
        yield from _epoch_batches(path, seed, epoch)


def _epoch_batches(path: Path, seed: int, epoch: int):
    stored_file = pq.ParquetFile(path, pre_buffer=False)
    rows = max(1, stored_file.metadata.num_rows)
    size = sum(stored_file.metadata.row_group(i).total_byte_size for i in range(stored_file.metadata.num_row_groups))
    batch_rows = max(256, min(65536, BATCH_BYTES * rows // max(1, size)))
    for batch in stored_file.iter_batches(batch_size=batch_rows, use_threads=False):
        n = batch.num_rows
        table = pa.Table.from_batches([batch])
        table = table.add_column(0, "epoch", pa.array(np.full(n, epoch, dtype=np.uint32)))
        yield table.add_column(0, "seed", pa.array(np.full(n, seed, dtype=np.int64)))


def pack_to_file(folders: list[Path], out: Path) -> Path:
    """The soft-label folders of one or more seeds as one packed Parquet file at `out` (module
    docstring): their rows with `seed` and `epoch` columns first, seed by seed, epoch by epoch."""
    parts, sources = [], []
    for folder in folders:  # read as fadrm_ray.evaluation.soft_labels stores them
        meta, files = stored_folder(folder)
        check_epochs(folder, files, folder.parent.name)
        parts.append(PackPart(meta=meta.model_copy(update={"epochs": len(files)})))
        sources += [(meta.seed, epoch, path) for epoch, path in enumerate(files)]
    if not sources:
        raise SoftLabelError("no stored soft labels to pack")
    stored = None  # the epochs' schemas unified, one file's read at a time (they are the same, but for widths)
    for _, _, path in sources:
        with _reading(path):
            schema = pq.read_schema(path).remove_metadata()
        if stored is None or not schema.equals(stored):
            stored = schema if stored is None else pa.unify_schemas([stored, schema], promote_options="permissive")
    schema = pa.schema([pa.field("seed", pa.int64()), pa.field("epoch", pa.uint32()), *stored],
                       metadata={PACK_KEY: SoftLabelPack(parts=parts).model_dump_json().encode()})
    plain = schema.remove_metadata()
    with private_output(out) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        buffered: list[pa.Table] = []
        size = rows = 0  # of what is buffered, kept as it grows: the pack is linear in the epochs

        def flush():
            nonlocal size, rows
            if buffered:
                writer.write_table(pa.concat_tables(buffered), row_group_size=PACK_ROW_GROUP)
                buffered.clear()
            size = rows = 0

        for seed, epoch, path in sources:
            for table in _epoch_tables(path, seed, epoch):
                table = _conform(table, plain)
                buffered.append(table)
                size, rows = size + table.nbytes, rows + table.num_rows
                if size >= BUFFER_BYTES or rows >= PACK_ROW_GROUP:
                    flush()
        flush()
    return out
