"""The Parquet store of distilled images.

A run lives in ``<root>/<run_id>/``; `fadrm_ray.layout.RunLayout` names every path in it.
Finished work is never lost and never half-written: files are written under a temporary name,
fsynced and renamed, and a unit counts as done only when its manifest exists and every file it
lists still has the recorded sha256.

Part files use the Hugging Face ``datasets`` Image layout for the ``image`` column and carry the
class names as a ``ClassLabel`` in the ``huggingface`` schema metadata, so
``datasets.load_dataset("parquet", data_files=...)`` reads them with names; the ``fadrm``
metadata key holds the provenance the writer was given.

The pieces:

- `records`: ImageRecord, the part schema and its metadata, PNG encode/decode, `to_plain`;
- `manifests`: config, unit manifests, run manifest and their verification, shared by both sides;
- `writer`: `RunStore`, the writer of one run (config, units, finalize, the writing session);
- `lock`: the writer lock of a run (one writing command at a time, stale locks broken);
- `reader`: `open_run`, the reader of a run, every part checked against its manifest as it is read;
- `verify`: the whole-run check of `fadrm verify`;
- `export`: ImageFolder and tensor-file exports.
"""
from fadrm_ray.store.export import export_imagefolder, export_parquet, export_tensors, imagefolder_names
from fadrm_ray.store.reader import open_run
from fadrm_ray.store.records import ImageRecord, IntegrityError, StoreError, to_plain
from fadrm_ray.store.writer import RunStore

__all__ = [
    "ImageRecord",
    "IntegrityError",
    "RunStore",
    "StoreError",
    "export_imagefolder",
    "export_parquet",
    "export_tensors",
    "imagefolder_names",
    "open_run",
    "to_plain",
]
