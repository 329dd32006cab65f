"""The run's own records, as the writer and the reader both see them: config, unit manifests,
run manifest, and which unit's files are still intact.

A unit counts as done only when its manifest exists and every file it lists still has the
recorded sha256, so a crash at any point leaves either the old state or the new one, and a
restarted driver finds from disk what is done. Nothing here writes; `writer.py`
writes, `reader.py` reads, and both go through these functions so that they agree on what a
finished unit and a complete run are.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

import yaml

from fadrm_ray.config import DistillConfig
from fadrm_ray.fileio import sha256_bytes, sha256_file
from fadrm_ray.layout import RunLayout
from fadrm_ray.store.records import IntegrityError, StoreError
from fadrm_ray.store.run_files import PartFile, RunManifest, UnitManifest


def read_config(layout: RunLayout) -> DistillConfig | None:
    """config.yaml as the run's `DistillConfig` (None when there is none); StoreError when it
    cannot be parsed or is not a config."""
    if not layout.config.is_file():
        return None
    try:
        with open(layout.config, "r", encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise StoreError(f"cannot parse {layout.config}: {e}") from e
    if not isinstance(loaded, dict):
        return None
    try:
        return DistillConfig.from_dict(migrate_config(loaded))
    except ValueError as e:
        raise StoreError(f"{layout.config} is not a config this version reads: {e}") from None


def migrate_config(raw: dict) -> dict:
    """A saved config of an earlier version in today's shape: keys no setting has any more are
    dropped (they changed nothing a reader uses)."""
    known = set(DistillConfig.model_fields)
    return {k: v for k, v in raw.items() if k in known}


def _read(model, path: Path):
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return model.from_json(data)


def run_manifest(layout: RunLayout) -> RunManifest | None:
    """manifest.json if it marks the run complete, else None."""
    m = _read(RunManifest, layout.manifest)
    return m if m is not None and m.complete else None


def unit_manifest(layout: RunLayout, unit_id: str) -> UnitManifest | None:
    """The manifest of one unit if it is readable and well formed (not verified)."""
    m = _read(UnitManifest, layout.unit(unit_id))
    return m if m is not None and m.unit_id == unit_id else None


def unit_manifests(layout: RunLayout) -> dict[str, UnitManifest]:
    """Every readable unit manifest, verified or not (cheap: no hashing)."""
    out = {}
    for uid in layout.unit_ids():
        m = unit_manifest(layout, uid)
        if m is not None:
            out[uid] = m
    return out


def verify(layout: RunLayout, manifest: UnitManifest) -> bool:
    """True if every file a unit manifest lists exists inside the run with its recorded sha256."""
    for entry in manifest.files:
        path = layout.resolve(entry.path)
        if path is None or not path.is_file():
            return False
        try:
            if sha256_file(path) != entry.sha256:
                return False
        except OSError:
            return False
    return True


def content_hash(layout: RunLayout, files: Iterable[PartFile] | None = None, view: int | None = None) -> str:
    """A hash of the images the run holds, from the sha256 its unit manifests record for every
    part (or for `files`, the ones a reader went by, read at IPC `view`): it changes when a unit
    is rewritten, so results computed from the images (an evaluation, a report) can be keyed by it."""
    if files is None:
        files = [f for m in unit_manifests(layout).values() for f in m.files]
    entries = [(f.path, f.sha256) for f in files] + ([("ipc", str(view))] if view is not None else [])
    return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()


def repair_hint(layout: RunLayout) -> str:
    return f"`fadrm verify --run {layout.run_dir} --repair` recomputes it"


def check_part_bytes(layout: RunLayout, path: Path, data: bytes, sha256: str | None, unit_id: str | None) -> None:
    """Raise IntegrityError unless `data`, read from `path`, has the sha256 its unit recorded."""
    if sha256 is not None and sha256_bytes(data) != sha256:
        raise IntegrityError(f"{path} is not the file unit {unit_id} recorded (its sha256 differs: changed or "
                             f"damaged since it was written); {repair_hint(layout)}")


def _files_key(manifest: UnitManifest) -> list:
    return sorted((f.path, f.sha256, f.rows) for f in manifest.files)


def run_manifest_problems(layout: RunLayout, manifest: RunManifest,
                          units: dict[str, UnitManifest]) -> dict[str, str]:
    """unit_id -> what is wrong, for every unit the run manifest lists whose own manifest is
    missing or records other files: the two must agree for the run's files to be checked."""
    problems = {}
    for entry in manifest.units:
        uid = entry.unit_id
        if uid not in units:
            problems[uid] = (f"{layout.unit(uid)} is missing or unreadable, but {layout.manifest.name} lists "
                             f"unit {uid}")
        elif _files_key(units[uid]) != _files_key(entry):
            problems[uid] = f"{layout.unit(uid)} records other files than {layout.manifest.name} does for unit {uid}"
    return problems
