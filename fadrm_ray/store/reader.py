"""The read side of a run: `open_run(run_dir)`.

The reader goes by the manifests: a complete run's manifest.json names its files (and must
agree with the unit manifests), a run still being written contributes the units whose manifests
are there, and only a bare copy of part files with no manifest at all falls back to listing the
label folders. Leftovers of crashed attempts are therefore never read. A run without
manifest.json is read only when asked for (`incomplete=True`): a reader that expects the whole
run must not get part of it without a word.

What is read is verified: every part file is read whole, hashed and compared with the sha256
its unit manifest records before a row of it is used, and its rows must be the labels, IPC
range and count the manifest records. So a changed or damaged file fails the read, naming the
file, instead of reaching an export or a student. Hashing costs far less than decoding the
images, and it is done on the bytes that are then parsed, so nothing changes in between. Parts
of a bare copy have nothing to be checked against; their images are decoded once to check
them, and a failure names the file and row.

A run holds every IPC it was asked for (the IPC is not part of its identity), so a request's
images are read as a view: `open_run(run_dir, ipc=5)` serves IPC indices 0-4 of every class,
using only those rows of a part that holds more; `ipc=None` serves everything in the run.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fadrm_ray.config import DistillConfig
from fadrm_ray.layout import RunLayout
from fadrm_ray.store import lock, manifests
from fadrm_ray.store.run_files import RunManifest, RunProvenance, RunSummary, UnitManifest
from fadrm_ray.store.records import (
    COLUMNS,
    IntegrityError,
    RunIncomplete,
    StoreError,
    decode_image,
    first_image_shape,
    part_class_names,
    part_provenance,
)


@dataclass(frozen=True)
class Part:
    """One part file as the run records it."""
    path: Path
    label: int | None  # from the manifest, else from the label=<c> folder
    rows: int | None   # from the manifest; None for a part no manifest describes
    sha256: str | None = None  # what the unit recorded; None for a bare copy (nothing to check)
    unit_id: str | None = None
    ipc_range: tuple[int, int] | None = None


def unit_parts(layout: RunLayout, unit: UnitManifest) -> list[Part]:
    """The parts a unit manifest lists; IntegrityError for an entry that points outside the run."""
    parts = []
    for e in unit.files:
        path = layout.resolve(e.path)
        if path is None:
            raise IntegrityError(f"unit {unit.unit_id} of {layout.run_dir} lists a file outside the run: {e.path}")
        parts.append(Part(path, e.label, e.rows, e.sha256, unit.unit_id, (e.ipc_start, e.ipc_end)))
    return parts


def part_bytes(layout: RunLayout, part: Part) -> bytes:
    """The bytes of one part, checked against the sha256 its unit manifest records."""
    try:
        data = part.path.read_bytes()
    except OSError as exc:
        if part.sha256 is not None and not part.path.exists():
            raise IntegrityError(f"{part.path} is missing, but unit {part.unit_id} lists it; "
                                 f"{manifests.repair_hint(layout)}") from None
        raise StoreError(f"cannot read part file {part.path}: {exc}") from None
    manifests.check_part_bytes(layout, part.path, data, part.sha256, part.unit_id)
    return data


def load_part(layout: RunLayout, part: Part, columns: Sequence[str]) -> pa.Table:
    """The columns of one part, parsed from the bytes `part_bytes` checked (so nothing can change
    between the check and the use), and its rows checked against the manifest."""
    data = part_bytes(layout, part)
    try:
        table = pq.read_table(pa.BufferReader(data), columns=list(columns))
    except (OSError, pa.ArrowException) as exc:
        raise IntegrityError(f"cannot read part file {part.path}: {exc}") from None
    if part.sha256 is not None:
        _check_rows(part, table)
    return table


def _check_rows(part: Part, table: pa.Table) -> None:
    # A file can only match its hash and hold other rows if the manifest itself was edited.
    if part.rows is not None and table.num_rows != part.rows:
        raise IntegrityError(f"{part.path} holds {table.num_rows} rows, unit {part.unit_id} recorded {part.rows}")
    labels = table.column("label").to_pylist() if "label" in table.column_names else []
    ipcs = table.column("ipc_index").to_pylist() if "ipc_index" in table.column_names else []
    for row, (label, ipc) in enumerate(zip(labels, ipcs)):
        if part.label is not None and label != part.label:
            raise IntegrityError(f"{part.path} row {row} has label {label}, but the part holds class {part.label}")
        if part.ipc_range is not None and not part.ipc_range[0] <= ipc < part.ipc_range[1]:
            raise IntegrityError(f"{part.path} row {row} has ipc_index {ipc}, outside the part's range "
                                 f"[{part.ipc_range[0]}, {part.ipc_range[1]})")


class _StoreDataset(torch.utils.data.Dataset):
    """Keeps the PNG bytes and decodes on access, so large runs fit in memory compressed."""

    def __init__(self, pngs: list[bytes], labels: list[int], transform: Callable | None = None,
                 where: list[str] | None = None):
        self.pngs = pngs
        self.labels = labels
        self.transform = transform
        self.where = where

    def __len__(self) -> int:
        return len(self.pngs)

    def __getitem__(self, i: int):
        image = decode_image(self.pngs[i], self.where[i] if self.where else f"image {i}")
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[i]


def open_run(run_dir: str | os.PathLike, *, incomplete: bool = False, ipc: int | None = None) -> "RunReader":
    """Open a run directory for reading, all of it or (`ipc`) IPC indices 0..ipc-1 of every class;
    StoreError if it holds neither a config nor part files, or if it is not complete (no
    manifest.json) and `incomplete` is False."""
    if ipc is not None and (isinstance(ipc, bool) or not isinstance(ipc, int) or ipc < 1):
        raise StoreError(f"ipc must be an integer >= 1 or None, got {ipc!r}")
    layout = RunLayout(run_dir)
    if not layout.run_dir.is_dir():
        raise StoreError(f"not a FADRM run directory: {layout.run_dir} does not exist or is not a directory")
    if not layout.config.is_file() and not layout.parts_on_disk():
        raise StoreError(f"not a FADRM run directory: {layout.run_dir} has no {layout.config.name} and no part files")
    manifest = manifests.run_manifest(layout)
    if manifest is None and not incomplete:
        units = len(layout.unit_ids())
        raise RunIncomplete(f"{layout.run_dir} is incomplete (no {layout.manifest.name}; {units} unit(s) written): "
                         f"rerun its distill command to finish it, or read what is there with incomplete=True "
                         f"(`fadrm export --incomplete`, `fadrm evaluate --incomplete`)", lock.live_owner(layout))
    return RunReader(layout, manifests.read_config(layout), manifest, ipc)


class RunReader:
    """What `open_run` returns: the config, manifest, class names and images of one run."""

    def __init__(self, layout: RunLayout, config: DistillConfig | None, manifest: RunManifest | None,
                 ipc: int | None = None):
        self.layout = layout
        self.run_dir = layout.run_dir
        self.config = config      # config.yaml; None for a bare copy of part files
        self.manifest = manifest  # only a manifest that marks the run complete
        self.ipc = ipc            # the view: IPC indices below it; None = every image of the run
        self._parts = [p for p in self._discover_parts() if self._in_view(p)]
        self.class_names: list[str] = self._find_class_names()
        self.provenance: RunProvenance = self._find_provenance()

    def __repr__(self) -> str:
        return f"RunReader({str(self.run_dir)!r})"

    @property
    def run_id(self) -> str:
        return self.manifest.run_id if self.manifest else self.run_dir.name

    @property
    def complete(self) -> bool:
        return self.manifest is not None

    def _discover_parts(self) -> list[Part]:
        # Manifests name the files that belong to the run; a glob would also pick up leftovers
        # of crashed attempts. The glob is only the fallback for a bare copy of the part files.
        units = self._unit_manifests = manifests.unit_manifests(self.layout)
        if self.manifest is not None:
            problems = manifests.run_manifest_problems(self.layout, self.manifest, units)
            if problems:
                raise IntegrityError(f"{next(iter(problems.values()))}; {manifests.repair_hint(self.layout)}")
            listed = list(self.manifest.units)
        elif units:
            listed = list(units.values())
        else:
            self._units = []
            return [Part(p, RunLayout.label_of(p), None) for p in self.layout.parts_on_disk()]
        self._units = listed  # what every read is checked against
        parts: dict[Path, Part] = {}
        for unit in listed:
            for part in unit_parts(self.layout, unit):
                parts.setdefault(part.path, part)
        return [parts[p] for p in sorted(parts, key=RunLayout.part_sort_key)]

    def _in_view(self, part: Part) -> bool:
        rng = part.ipc_range or RunLayout.ipc_range_of(part.path)
        return self.ipc is None or rng is None or rng[0] < self.ipc

    def _find_class_names(self) -> list[str]:
        if self.manifest and self.manifest.class_names:
            return list(self.manifest.class_names)
        for part in self._parts[:1]:
            if part.path.is_file():
                names = part_class_names(part.path)
                if names is not None:
                    return names
        return []

    def _find_provenance(self) -> RunProvenance:
        # Any part that can still be read will do: they all record the same provenance.
        for part in self._parts:
            try:
                found = part_provenance(part.path)
            except StoreError:
                continue
            if found is not None:
                return found
        return RunProvenance(format_version=1)

    @property
    def classes(self) -> list[int]:
        """The classes the run holds images of."""
        return sorted({p.label for p in self._parts if p.label is not None})

    def _check_classes(self, classes: Iterable[int] | None) -> set[int] | None:
        """The wanted classes as a set; StoreError for a class the run does not hold (an export
        of nothing must not pass for one of something) or one asked for twice."""
        if classes is None:
            return None
        wanted = [int(c) for c in classes]
        if len(set(wanted)) != len(wanted):
            raise StoreError(f"classes {wanted} name a class more than once")
        held = self.classes
        missing = [c for c in wanted if c not in held]
        if missing:
            shown = f"{held[0]}..{held[-1]}" if held and held == list(range(held[0], held[-1] + 1)) else str(held)
            raise StoreError(f"{self.run_dir} holds no images of class {missing[0]} (it holds classes {shown})")
        return set(wanted)

    def _load(self, part: Part, columns: Sequence[str]) -> pa.Table:
        return load_part(self.layout, part, columns)

    def verify(self, classes: Iterable[int] | None = None) -> None:
        """Check every part (of `classes`) against the sha256 its manifest records, without parsing
        it; IntegrityError names the first file that fails. Reads do this themselves."""
        wanted = self._check_classes(classes)
        for part in self._parts:
            if wanted is None or part.label in wanted:
                part_bytes(self.layout, part)

    def unit_manifests(self) -> dict[str, UnitManifest]:
        """Every readable unit manifest (files, rows, stats), verified or not, as the reader found
        them when it opened the run."""
        return dict(self._unit_manifests)

    def content_hash(self) -> str:
        """`manifests.content_hash`: since every read is checked against the same sha256 values,
        it names the images a reader of this run actually gets."""
        files = [f for u in self._units for f in u.files]
        if self.ipc is None:
            return manifests.content_hash(self.layout, files)
        # A view: the parts it reads from, and the IPC that cuts them.
        paths = {self.layout.relative(p.path) for p in self._parts}
        return manifests.content_hash(self.layout, [f for f in files if f.path in paths], view=self.ipc)

    def part_files(self, classes: Iterable[int] | None = None) -> list[Path]:
        if classes is None:
            return [p.path for p in self._parts]
        wanted = {int(c) for c in classes}
        return [p.path for p in self._parts if RunLayout.label_of(p.path) in wanted]

    def _rows(self, classes, with_images: bool) -> list[dict]:
        columns = list(COLUMNS) if with_images else [c for c in COLUMNS if c != "image"]
        wanted = self._check_classes(classes)
        rows = []
        for part in self._parts:
            if wanted is not None and part.label is not None and part.label not in wanted:
                continue
            table = self._load(part, columns)
            rel = self.layout.relative(part.path)
            for i, row in enumerate(table.to_pylist()):
                if wanted is not None and int(row["label"]) not in wanted:
                    continue
                if self.ipc is not None and int(row["ipc_index"]) >= self.ipc:
                    continue
                row["file"] = rel
                row["where"] = f"{part.path} row {i}"
                if with_images and part.sha256 is None:
                    decode_image(row["image"]["bytes"], row["where"])  # nothing else vouches for it
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
        """images uint8 (N, C, H, W), labels int64 (N,), ipc_index int64 (N,), by (label, ipc).

        One part at a time is read and decoded into one tensor sized from the manifests: the
        memory a read takes is the set's own bytes, never a second copy of it nor every part's
        encoded bytes at once (a student holds the set as it is: evaluation/relabel.py)."""
        wanted = self._check_classes(classes)
        parts = [p for p in self._parts if wanted is None or p.label is None or p.label in wanted]
        capacity = sum(self._rows_in_view(p) for p in parts)
        images, keys = None, []
        for part in parts:
            table = self._load(part, ["image", "label", "ipc_index"])
            blobs = table.column("image").combine_chunks().field("bytes")
            labels, indices = table.column("label").to_pylist(), table.column("ipc_index").to_pylist()
            for i, (label, index) in enumerate(zip(labels, indices)):
                if (wanted is not None and int(label) not in wanted) or (self.ipc is not None and int(index) >= self.ipc):
                    continue
                image = decode_image(blobs[i].as_py(), f"{part.path} row {i}")
                if images is None:
                    images = torch.empty((max(capacity, 1), *image.shape), dtype=torch.uint8)
                elif image.shape != images.shape[1:]:
                    shapes = sorted({tuple(images.shape[1:]), tuple(image.shape)})
                    raise StoreError(f"{self.run_dir}: images have different shapes {shapes}; read fewer classes or "
                                     "use as_dataset()")
                if len(keys) == images.shape[0]:  # parts no manifest counts (a bare copy): grow
                    images = torch.cat([images, torch.empty_like(images)])
                images[len(keys)] = image
                keys.append((int(label), int(index)))
        if images is None:
            empty = torch.empty(0, dtype=torch.int64)
            return torch.empty((0, 0, 0, 0), dtype=torch.uint8), empty, empty.clone()
        images = images[:len(keys)]
        order = sorted(range(len(keys)), key=keys.__getitem__)
        for a, b in zip(order, order[1:]):
            if keys[a] == keys[b]:
                raise StoreError(f"{self.run_dir}: label {keys[a][0]} ipc_index {keys[a][1]} is stored twice")
        if order != list(range(len(order))):  # parts are read in (label, ipc) order: only a hand-made run gets here
            images = images[order]
        keys = [keys[i] for i in order]
        return images, torch.tensor([k[0] for k in keys], dtype=torch.int64), torch.tensor([k[1] for k in keys])

    def _rows_in_view(self, part: Part) -> int:
        """Rows of `part` this view reads, as its manifest counts them (at most that many where its
        IPC indices have gaps); 0 for a part no manifest counts."""
        if part.rows is None:
            return 0
        if self.ipc is None or part.ipc_range is None:
            return part.rows
        return min(part.rows, max(0, self.ipc - part.ipc_range[0]))

    def as_dataset(self, classes: Iterable[int] | None = None, transform: Callable | None = None):
        rows = self._rows(classes, with_images=True)
        return _StoreDataset([r["image"]["bytes"] for r in rows], [int(r["label"]) for r in rows], transform,
                             [r["where"] for r in rows])

    def _images_per_class(self) -> dict[int, int]:
        counts: dict[int, int] = defaultdict(int)
        for part in self._parts:
            rng = part.ipc_range or RunLayout.ipc_range_of(part.path)
            whole = self.ipc is None or (rng is not None and rng[1] <= self.ipc)
            if part.rows is not None and part.label is not None and whole:
                counts[part.label] += part.rows
            else:  # a bare copy without manifests, or a part the view cuts: only the file itself knows
                table = self._load(part, ["label", "ipc_index"])
                for label, index in zip(table.column("label").to_pylist(), table.column("ipc_index").to_pylist()):
                    if self.ipc is None or int(index) < self.ipc:
                        counts[int(label)] += 1
        return {c: counts[c] for c in sorted(counts)}

    def info(self) -> dict:
        """A description of the run for `fadrm info`: every part is checked against its manifest
        (read and hashed, not decoded), and one image is decoded for its shape."""
        self.verify()
        per_class = self._images_per_class()
        image_shape = first_image_shape(self._parts[0].path) if self._parts else None
        summary = self.manifest.summary if self.manifest else RunSummary()
        units = self.manifest.units if self.manifest else []
        written = sorted(u.written_at for u in units if u.written_at)
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            # the IPC every class holds (or the one it is read at)
            "ipc": self.ipc if self.ipc is not None else min(per_class.values(), default=0),
            "complete": self.complete,
            "verified": all(p.sha256 is not None for p in self._parts),
            "writer": _writer(self.layout),
            "rows": sum(per_class.values()),
            "classes": sorted(per_class),
            "num_classes": len(self.class_names),
            "class_names": list(self.class_names),
            "images_per_class": per_class,
            "image_shape": image_shape,
            "parts": len(self._parts),
            "config": _config_summary(self.config.to_dict() if self.config is not None else {}),
            "teachers": [{"path": t.path, "model": t.model_name, "test_accuracy": t.test_accuracy, "sha256": t.sha256}
                         for t in self.provenance.teachers],
            "timings": {
                **summary.timings,
                "first_unit_written_at": written[0] if written else None,
                "last_unit_written_at": written[-1] if written else None,
                "finalized_at": self.manifest.finalized_at if self.manifest else None,
            },
            "summary": summary.model_dump(mode="json", exclude_unset=True),
        }


def _writer(layout: RunLayout) -> dict | None:
    """The process writing the run now, if any (pid, host, since)."""
    owner = lock.read_owner(layout)
    return None if owner is None else {k: owner.get(k) for k in ("pid", "host", "since")}


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

