"""The run's own records, as the writer and the reader both see them: config, unit manifests,
run manifest, and which unit's files are still intact.

A unit counts as done only when its manifest exists and every file it lists still has the
recorded sha256, so a crash at any point leaves either the old state or the new one, and a
restarted coordinator can rebuild its ledger from disk. Nothing here writes; `writer.py`
writes, `reader.py` reads, and both go through these functions so that they agree on what a
finished unit and a complete run are.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from fadrm_ray.fileio import sha256_file
from fadrm_ray.layout import RunLayout
from fadrm_ray.store.records import StoreError


def _read_json(path: Path) -> dict | None:
    """A JSON object from `path`; None if it is missing, unreadable or not an object."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
    m = _read_json(layout.manifest)
    return m if m and m.get("complete") is True else None


def unit_manifest(layout: RunLayout, unit_id: str) -> dict | None:
    """The manifest of one unit if it is readable and well formed (not verified)."""
    data = _read_json(layout.unit(unit_id))
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
