"""The run's own records, as the writer and the reader both see them: config, unit manifests,
run manifest, and which unit's files are still intact.

A unit counts as done only when its manifest exists and every file it lists still has the
recorded sha256, so a crash at any point leaves either the old state or the new one, and a
restarted coordinator can rebuild its ledger from disk. Nothing here writes; `writer.py`
writes, `reader.py` reads, and both go through these functions so that they agree on what a
finished unit and a complete run are.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml

from fadrm_ray.fileio import read_json_object, sha256_bytes, sha256_file
from fadrm_ray.layout import RunLayout
from fadrm_ray.store.records import IntegrityError, StoreError


def read_config(layout: RunLayout) -> dict:
    """config.yaml as a dict ({} when there is none)."""
    if not layout.config.is_file():
        return {}
    try:
        with open(layout.config, "r", encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise StoreError(f"cannot parse {layout.config}: {e}") from e
    return loaded if isinstance(loaded, dict) else {}


def run_manifest(layout: RunLayout) -> dict | None:
    """manifest.json if it marks the run complete, else None."""
    m = read_json_object(layout.manifest)
    return m if m and m.get("complete") is True else None


def unit_manifest(layout: RunLayout, unit_id: str) -> dict | None:
    """The manifest of one unit if it is readable and well formed (not verified)."""
    data = read_json_object(layout.unit(unit_id))
    if data is None or data.get("unit_id") != unit_id or not isinstance(data.get("files"), list):
        return None
    return data


def unit_manifests(layout: RunLayout) -> dict[str, dict]:
    """Every readable unit manifest, verified or not (cheap: no hashing)."""
    out = {}
    for uid in layout.unit_ids():
        m = unit_manifest(layout, uid)
        if m is not None:
            out[uid] = m
    return out


def verify(layout: RunLayout, manifest: dict) -> bool:
    """True if every file a unit manifest lists exists inside the run with its recorded sha256."""
    for entry in manifest["files"]:
        if not isinstance(entry, dict):
            return False
        path = layout.resolve(str(entry.get("path", "")))
        if path is None or not path.is_file():
            return False
        try:
            if sha256_file(path) != entry.get("sha256"):
                return False
        except OSError:
            return False
    return True


def content_hash(layout: RunLayout, units=None) -> str:
    """A hash of the images the run holds, from the sha256 its unit manifests (or `units`, the
    ones a reader went by) record for every part: it changes when a unit is rewritten, so
    results computed from the images (an evaluation, a report) can be keyed by it."""
    units = unit_manifests(layout).values() if units is None else units
    entries = sorted((str(f.get("path")), str(f.get("sha256")))
                     for m in units for f in m.get("files", []) if isinstance(f, dict))
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def repair_hint(layout: RunLayout) -> str:
    return f"`fadrm verify --run {layout.run_dir} --repair` recomputes it"


def check_part_bytes(layout: RunLayout, path: Path, data: bytes, sha256: str | None, unit_id: str | None) -> None:
    """Raise IntegrityError unless `data`, read from `path`, has the sha256 its unit recorded."""
    if sha256 is not None and sha256_bytes(data) != sha256:
        raise IntegrityError(f"{path} is not the file unit {unit_id} recorded (its sha256 differs: changed or "
                             f"damaged since it was written); {repair_hint(layout)}")


def _files_key(manifest: dict) -> list:
    return sorted((str(f.get("path")), str(f.get("sha256")), f.get("rows"))
                  for f in manifest.get("files", []) if isinstance(f, dict))


def run_manifest_problems(layout: RunLayout, manifest: dict, units: dict[str, dict]) -> dict[str, str]:
    """unit_id -> what is wrong, for every unit the run manifest lists whose own manifest is
    missing or records other files: the two must agree for the run's files to be checked."""
    problems = {}
    for entry in manifest.get("units", []):
        uid = str(entry.get("unit_id")) if isinstance(entry, dict) else "?"
        if uid not in units:
            problems[uid] = (f"{layout.unit(uid)} is missing or unreadable, but {layout.manifest.name} lists "
                             f"unit {uid}")
        elif _files_key(units[uid]) != _files_key(entry):
            problems[uid] = f"{layout.unit(uid)} records other files than {layout.manifest.name} does for unit {uid}"
    return problems
