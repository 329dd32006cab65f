"""The writer side of one run: config, the part files and manifest of each unit, the run manifest.

Finished work is never lost and never half-written: every file is written to a temporary name
in its final directory, fsynced, then renamed over the final name (`fadrm_ray.fileio`). A unit's
manifest is written after its part files, so a unit counts as done only once all of it is on
disk (`manifests.verify`), and `RunStore.finished_units` tells a restarted driver what is done
after a crash. Several processes may write disjoint units of one run at the same time (the
workers of one pool); one command at a time writes a run, in a `RunStore.session`, which holds the
run's writer lock (`lock.py`) and removes what a session that failed before finishing any work
had written.
"""
from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from pathlib import Path
from typing import Callable

import yaml

from fadrm_ray.config import DistillConfig
from fadrm_ray.fileio import atomic_write_bytes, atomic_write_text, sha256_bytes
from fadrm_ray.layout import RunLayout
from fadrm_ray.store import manifests
from fadrm_ray.store.lock import RunLock, waiting_notice
from fadrm_ray.store.run_files import PartFile, RunManifest, RunProvenance, RunSummary, UnitManifest, UnitStats
from fadrm_ray.store.records import (
    ImageRecord,
    StoreError,
    check_image,
    encode_part,
    part_class_names,
    to_plain,
    utc_now,
)


def _check_unit_id(unit_id: str) -> None:
    if not RunLayout.is_unit_id(unit_id):
        raise StoreError(f"invalid unit_id {unit_id!r}: use letters, digits, '.', '_' and '-' only")


class RunStore:
    """Writer side of one run directory. Safe to use from several processes on disjoint units."""

    def __init__(self, root: str | os.PathLike, run_id: str):
        if not run_id or "/" in run_id or run_id in (".", ".."):
            raise StoreError(f"invalid run_id {run_id!r}")
        self.root = Path(root)
        self.run_id = run_id
        self.layout = RunLayout(self.root / run_id)
        self.run_dir = self.layout.run_dir

    def __repr__(self) -> str:
        return f"RunStore({str(self.run_dir)!r})"

    def write_config(self, config: DistillConfig) -> Path:
        """config.yaml: the run's config, with the largest IPC asked. (A job.json that an earlier
        version kept beside it is removed: what was asked is in every part's provenance.)"""
        self.layout.legacy_job.unlink(missing_ok=True)
        text = yaml.safe_dump(config.to_dict(), sort_keys=False)
        return atomic_write_text(self.layout.config, text)

    # -- one writing command
    @contextlib.contextmanager
    def session(self, config: DistillConfig, *, timeout: float | None = None,
                on_wait: Callable[[dict], None] | None = None):
        """Write the run as its only writer: take the writer lock (waiting while another command
        writes the run; it then finds that command's units done), write config.yaml,
        yield.

        A session that fails before any unit or stage checkpoint is on disk removes what it
        wrote, so a failed start leaves no half-created run that readers would report.
        """
        new_root = not self.root.exists()
        lock = RunLock(self.layout)
        lock.acquire(timeout, on_wait if on_wait is not None else waiting_notice(self.layout))
        discard = False
        try:
            self.write_config(config)
            yield self
        except BaseException:
            discard = not self.layout.unit_ids() and not self.layout.checkpoints()
            raise
        finally:
            if discard:
                self._discard_files()
            lock.release()
            if discard:
                self._discard_folders(new_root)

    def _discard_files(self) -> None:
        # No unit manifest exists, so any part file or patch ranking is a leftover of this attempt.
        for path in (self.layout.config, self.layout.ledger, *self.layout.parts_on_disk(),
                     *self.layout.patch_selections()):
            path.unlink(missing_ok=True)

    def _discard_folders(self, new_root: bool) -> None:
        # rmdir only removes empty folders: a writer that took the lock meanwhile keeps its run.
        folders = sorted((p for p in self.run_dir.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for folder in [*folders, self.run_dir, *([self.root] if new_root else [])]:
            with contextlib.suppress(OSError):
                folder.rmdir()

    # -- finished units
    def unit_done(self, unit_id: str) -> bool:
        """True only if the unit's manifest exists and every file it lists has its sha256."""
        _check_unit_id(unit_id)
        manifest = manifests.unit_manifest(self.layout, unit_id)
        return manifest is not None and manifests.verify(self.layout, manifest)

    def finished_units(self) -> dict[str, UnitManifest]:
        """unit_id -> unit manifest for every unit whose files all verify."""
        return {uid: m for uid, m in manifests.unit_manifests(self.layout).items()
                if manifests.verify(self.layout, m)}

    # -- writing a unit
    def write_unit(
        self,
        unit_id: str,
        records: list[ImageRecord],
        class_names: list[str],
        provenance: RunProvenance,
        stats: UnitStats | dict | None = None,
    ) -> UnitManifest:
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
            check_image(rec.image, f"unit {unit_id}, record {i}")
            by_label[label].append(rec)

        plan: list[tuple[int, int, int, list[ImageRecord], Path]] = []
        for label in sorted(by_label):
            recs = sorted(by_label[label], key=lambda r: int(r.ipc_index))
            ipcs = [int(r.ipc_index) for r in recs]
            if len(set(ipcs)) != len(ipcs):
                raise StoreError(f"unit {unit_id}: duplicate ipc_index for label {label}")
            start, end = ipcs[0], ipcs[-1] + 1
            plan.append((label, start, end, recs, self.layout.part(label, start, end)))

        old = manifests.unit_manifest(self.layout, unit_id)
        own_old = {e.path for e in old.files} if old else set()
        self._check_no_foreign_overlap(unit_id, plan, own_old)

        files = []
        for label, start, end, recs, path in plan:
            data = encode_part(recs, class_names, provenance)
            atomic_write_bytes(path, data)
            files.append(PartFile(path=self.layout.relative(path), rows=len(recs), sha256=sha256_bytes(data),
                                  label=label, ipc_start=start, ipc_end=end))

        if not isinstance(stats, UnitStats):
            stats = UnitStats.model_validate(to_plain(stats or {}))
        manifest = UnitManifest(unit_id=unit_id, files=files, rows=sum(f.rows for f in files), stats=stats,
                                written_at=utc_now())
        atomic_write_text(self.layout.unit(unit_id), manifest.model_dump_json(indent=2))

        # Files of an earlier attempt of this unit that the new attempt no longer produces.
        new_paths = {f.path for f in files}
        for rel in own_old - new_paths:
            stale = self.layout.resolve(rel)
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
                rng = RunLayout.ipc_range_of(existing)
                if rng is None:
                    continue
                rel = self.layout.relative(existing)
                if rel in own_old:
                    continue
                if rng[0] < end and start < rng[1]:
                    suspects.append((rel, label, start, end))
        if not suspects:
            return
        owners: dict[str, str] = {}
        for other_id, m in manifests.unit_manifests(self.layout).items():
            if other_id == unit_id:
                continue
            for e in m.files:
                owners[e.path] = other_id
        for rel, label, start, end in suspects:
            if rel in owners:
                raise StoreError(
                    f"unit {unit_id}: label {label} ipc [{start}, {end}) clashes with {rel}, "
                    f"which belongs to unit {owners[rel]}"
                )
        # Files nobody lists are leftovers of a crashed attempt; readers go by the manifests.

    # -- completing the run
    def finalize(self, summary: RunSummary | dict) -> RunManifest:
        """Write manifest.json marking the run complete; refuses if any unit fails to verify."""
        units_by_id = manifests.unit_manifests(self.layout)
        bad = sorted(uid for uid, m in units_by_id.items() if not manifests.verify(self.layout, m))
        if bad:
            shown = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise StoreError(
                f"cannot finalize {self.run_dir}: {len(bad)} unit(s) have missing or corrupted files: {shown}"
            )
        units = [units_by_id[uid] for uid in sorted(units_by_id)]
        files = [f for m in units for f in m.files]
        class_names: list[str] = []
        if files:
            # Every listed file verified above, so its path resolves inside the run.
            class_names = part_class_names(self.layout.resolve(files[0].path)) or []
        if not isinstance(summary, RunSummary):
            summary = RunSummary.model_validate(to_plain(summary or {}))
        manifest = RunManifest(run_id=self.run_id, complete=True, finalized_at=utc_now(),
                               rows=sum(f.rows for f in files), classes=sorted({f.label for f in files}),
                               class_names=class_names, units=units, summary=summary)
        atomic_write_text(self.layout.manifest, manifest.model_dump_json(indent=2))
        return manifest

    def is_complete(self) -> bool:
        return manifests.run_manifest(self.layout) is not None
