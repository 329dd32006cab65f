"""The read side of a run, complete or still being written: `open_run(run_dir)`.

The reader goes by the manifests: a complete run's manifest.json names its files, a run still
being written contributes the units whose manifests and files are all there, and only a bare
copy of part files with no manifest at all falls back to listing the label folders. Leftovers
of crashed attempts are therefore never read. Row counts come from the manifests too, so
describing a run (`info`) does not read its images.

A run holds every IPC it was asked for (the IPC is not part of its identity), so a request's
images are read as a view: `open_run(run_dir, ipc=5)` serves IPC indices 0-4 of every class,
reading only those rows of a part that holds more; `ipc=None` serves everything in the run.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from fadrm_ray.layout import RunLayout
from fadrm_ray.store import manifests
from fadrm_ray.store.records import (
    COLUMNS,
    StoreError,
    decode_image,
    first_image_shape,
    part_class_names,
    part_provenance,
    read_part,
)


@dataclass(frozen=True)
class _Part:
    path: Path
    label: int | None  # from the manifest, else from the label=<c> folder
    rows: int | None   # from the manifest; None for a part no manifest describes

    @property
    def ipc_range(self) -> tuple[int, int] | None:
        return RunLayout.ipc_range_of(self.path)


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


def open_run(run_dir: str | os.PathLike, ipc: int | None = None) -> "RunReader":
    """Open a run directory for reading, all of it or (`ipc`) IPC indices 0..ipc-1 of every class;
    StoreError if it holds neither a config nor part files."""
    if ipc is not None and (isinstance(ipc, bool) or not isinstance(ipc, int) or ipc < 1):
        raise StoreError(f"ipc must be an integer >= 1 or None, got {ipc!r}")
    layout = RunLayout(run_dir)
    if not layout.run_dir.is_dir():
        raise StoreError(f"not a FADRM run directory: {layout.run_dir} does not exist or is not a directory")
    if not layout.config.is_file() and not layout.parts_on_disk():
        raise StoreError(f"not a FADRM run directory: {layout.run_dir} has no {layout.config.name} and no part files")
    return RunReader(layout, manifests.read_config(layout), manifests.run_manifest(layout), ipc)


class RunReader:
    """What `open_run` returns: the config, manifest, class names and images of one run."""

    def __init__(self, layout: RunLayout, config: dict, manifest: dict | None, ipc: int | None = None):
        self.layout = layout
        self.run_dir = layout.run_dir
        self.config = config
        self.manifest = manifest  # only a manifest that marks the run complete
        self.ipc = ipc            # the view: IPC indices below it; None = every image of the run
        self._parts = [p for p in self._discover_parts() if self._in_view(p.ipc_range)]
        self.class_names: list[str] = self._find_class_names()
        self.provenance: dict = part_provenance(self._parts[0].path) if self._parts else {}

    def __repr__(self) -> str:
        return f"RunReader({str(self.run_dir)!r})"

    @property
    def run_id(self) -> str:
        return self.manifest.get("run_id", self.run_dir.name) if self.manifest else self.run_dir.name

    @property
    def complete(self) -> bool:
        return self.manifest is not None

    def _discover_parts(self) -> list[_Part]:
        # Manifests name the files that belong to the run; a glob would also pick up leftovers
        # of crashed attempts. The glob is only the fallback for a bare copy of the part files.
        if self.manifest is not None:
            entries = [f for u in self.manifest.get("units", []) for f in u.get("files", [])]
        else:
            units = manifests.unit_manifests(self.layout)
            if not units:
                return [_Part(p, RunLayout.label_of(p), None) for p in self.layout.parts_on_disk()]
            entries = []
            for m in units.values():
                paths = [self.layout.resolve(str(f.get("path", ""))) for f in m["files"]]
                if all(p is not None and p.is_file() for p in paths):
                    entries.extend(m["files"])
        parts: dict[Path, _Part] = {}
        for e in entries:
            path = self.layout.resolve(str(e.get("path", "")))
            if path is None or path in parts:
                continue
            label, rows = e.get("label"), e.get("rows")
            parts[path] = _Part(path, int(label) if isinstance(label, int) else RunLayout.label_of(path),
                                int(rows) if isinstance(rows, int) else None)
        return [parts[p] for p in sorted(parts, key=RunLayout.part_sort_key)]

    def _in_view(self, ipc_range: tuple[int, int] | None) -> bool:
        return self.ipc is None or ipc_range is None or ipc_range[0] < self.ipc

    def _find_class_names(self) -> list[str]:
        if self._parts:
            names = part_class_names(self._parts[0].path)
            if names is not None:
                return names
        if self.manifest and self.manifest.get("class_names"):
            return [str(n) for n in self.manifest["class_names"]]
        names = self.config.get("class_names")
        return [str(n) for n in names] if isinstance(names, list) else []

    def unit_manifests(self) -> dict[str, dict]:
        """Every readable unit manifest (files, rows, stats), verified or not."""
        return manifests.unit_manifests(self.layout)

    def content_hash(self) -> str:
        """A hash of the images the run holds, from the sha256 its unit manifests record for every
        part: it changes when a unit is rewritten, so results computed from the images (an
        evaluation) can be keyed by it."""
        entries = sorted((str(f.get("path")), str(f.get("sha256")))
                         for m in self.unit_manifests().values() for f in m.get("files", [])
                         if isinstance(f, dict) and self._in_view(RunLayout.ipc_range_of(Path(str(f.get("path"))))))
        view = [] if self.ipc is None else [["ipc", self.ipc]]  # a view's images are a subset of its parts'
        return hashlib.sha256(json.dumps(entries + view).encode()).hexdigest()

    def part_files(self, classes: Iterable[int] | None = None) -> list[Path]:
        if classes is None:
            return [p.path for p in self._parts]
        wanted = {int(c) for c in classes}
        return [p.path for p in self._parts if RunLayout.label_of(p.path) in wanted]

    def _rows(self, classes, with_images: bool) -> list[dict]:
        columns = list(COLUMNS) if with_images else [c for c in COLUMNS if c != "image"]
        wanted = None if classes is None else {int(c) for c in classes}
        rows = []
        for path in self.part_files(classes):
            table = read_part(path, columns)
            rel = self.layout.relative(path)
            for row in table.to_pylist():
                if wanted is not None and int(row["label"]) not in wanted:
                    continue
                if self.ipc is not None and int(row["ipc_index"]) >= self.ipc:
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

    def encoded(self, classes: Iterable[int] | None = None) -> list[tuple[int, int, bytes]]:
        """(label, ipc_index, PNG bytes) of every image, sorted by (label, ipc_index), not decoded."""
        return [(int(r["label"]), int(r["ipc_index"]), r["image"]["bytes"]) for r in self._rows(classes, with_images=True)]

    def read(self, classes: Iterable[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """images uint8 (N, C, H, W), labels int64 (N,), ipc_index int64 (N,), by (label, ipc)."""
        rows = self.encoded(classes)
        if not rows:
            empty = torch.empty(0, dtype=torch.int64)
            return torch.empty((0, 0, 0, 0), dtype=torch.uint8), empty, empty.clone()
        images = [decode_image(png) for _, _, png in rows]
        shapes = {tuple(im.shape) for im in images}
        if len(shapes) > 1:
            raise StoreError(
                f"{self.run_dir}: images have different shapes {sorted(shapes)}; read fewer classes or use as_dataset()"
            )
        labels = torch.tensor([label for label, _, _ in rows], dtype=torch.int64)
        ipcs = torch.tensor([ipc for _, ipc, _ in rows], dtype=torch.int64)
        return torch.stack(images), labels, ipcs

    def as_dataset(self, classes: Iterable[int] | None = None, transform: Callable | None = None):
        rows = self.encoded(classes)
        return _StoreDataset([png for _, _, png in rows], [label for label, _, _ in rows], transform)

    def _images_per_class(self) -> dict[int, int]:
        counts: dict[int, int] = defaultdict(int)
        for part in self._parts:
            rng = part.ipc_range
            whole = self.ipc is None or (rng is not None and rng[1] <= self.ipc)
            if part.rows is not None and part.label is not None and whole:
                counts[part.label] += part.rows
            else:  # a bare copy without manifests, or a part the view cuts: only the file itself knows
                table = read_part(part.path, ["label", "ipc_index"])
                for label, index in zip(table.column("label").to_pylist(), table.column("ipc_index").to_pylist()):
                    if self.ipc is None or int(index) < self.ipc:
                        counts[int(label)] += 1
        return {c: counts[c] for c in sorted(counts)}

    def info(self) -> dict:
        """A description of the run for `fadrm info`; reads one image (for its shape) at most."""
        per_class = self._images_per_class()
        image_shape = first_image_shape(self._parts[0].path) if self._parts else None
        summary = (self.manifest or {}).get("summary", {})
        units = (self.manifest or {}).get("units", [])
        written = sorted(u.get("written_at") for u in units if u.get("written_at"))
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "ipc": self.ipc,
            "complete": self.complete,
            "rows": sum(per_class.values()),
            "classes": sorted(per_class),
            "num_classes": len(self.class_names),
            "class_names": list(self.class_names),
            "images_per_class": per_class,
            "image_shape": image_shape,
            "parts": len(self._parts),
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
