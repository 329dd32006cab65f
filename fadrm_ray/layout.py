"""Where everything of one run lives: the paths inside ``<store root>/<run_id>/``.

Layout of one run::

    config.yaml                                   the resolved configuration
    label=<c>/part-ipc<start>-<end>.parquet       images of class c, ipc_index in [start, end)
    units/<unit_id>.json                          one manifest per finished unit (files + sha256)
    manifest.json                                 the run manifest, written when the run completes
    checkpoints/<unit_id>.after<stage>.safetensors  recover states of a unit after `stage` stages (Ray runs)
    patches/label=<c>.json                        the scored ranking of class c's real patches (scored once per run)
    ledger.jsonl                                  what ran where, one JSON event per line (Ray runs)
    ray.log                                       Ray's own lines of the Ray runs that wrote it (not with --verbose)
    writer.lock                                   held by the one process writing the run (pid, host)
    soft_labels/                                  teacher soft labels kept by `evaluate --soft-labels stored`
    evaluations/<key>.json                        every evaluation of the run, by what decides its result
    report/                                       grid.png, losses.png, evaluation.json, evaluation.png

Every module that writes or reads one of these asks a `RunLayout` for the path, and every name
found on disk (part files, label folders, unit manifests, checkpoints) is parsed here. Runs
written earlier stay readable only as long as these names stay the same, so a change here is a
change of the on-disk format.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_CONFIG = "config.yaml"
_LEGACY_JOB = "job.json"  # kept by earlier versions beside config.yaml; removed when the run is next written
_MANIFEST = "manifest.json"
_UNITS = "units"
_CHECKPOINTS = "checkpoints"
_PATCHES = "patches"
_LEDGER = "ledger.jsonl"
_RAY_LOG = "ray.log"
_LOCK = "writer.lock"
_SOFT_LABELS = "soft_labels"
_REPORT = "report"
_EVALUATIONS = "evaluations"
_REPORT_FILES = {"grid": "grid.png", "losses": "losses.png", "evaluation": "evaluation.json",
                 "evaluation_plot": "evaluation.png"}
_REPORT_SOURCE = "source.json"

_PART_GLOB = "label=*/part-ipc*-*.parquet"
_PART_RE = re.compile(r"^part-ipc(\d+)-(\d+)\.parquet$")
_LABEL_DIR_RE = re.compile(r"^label=(\d+)$")
_UNIT_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_CHECKPOINT_MARK = ".after"
_CHECKPOINT_SUFFIX = ".safetensors"
_LEGACY_CHECKPOINT_SUFFIX = ".pt"


class RunLayout:
    """The paths of one run directory. Building one touches nothing on disk."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.run_dir)!r})"

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    # -- the run's own files
    @property
    def config(self) -> Path:
        return self.run_dir / _CONFIG

    @property
    def legacy_job(self) -> Path:
        return self.run_dir / _LEGACY_JOB

    @property
    def manifest(self) -> Path:
        return self.run_dir / _MANIFEST

    @property
    def ledger(self) -> Path:
        return self.run_dir / _LEDGER

    @property
    def ray_log(self) -> Path:
        """Ray's own lines (its start, its connection to a cluster, its warnings) of the Ray runs
        that wrote this run, kept off the terminal (actors.ray_output); kept when a start fails."""
        return self.run_dir / _RAY_LOG

    @property
    def lock(self) -> Path:
        """The writer lock (`fadrm_ray.store.lock`); its temporary and broken copies sit beside it."""
        return self.run_dir / _LOCK

    @property
    def soft_labels(self) -> Path:
        """The folder `relabel` keeps stored soft labels in (its own layout below it)."""
        return self.run_dir / _SOFT_LABELS

    # -- unit manifests
    @staticmethod
    def is_unit_id(unit_id: object) -> bool:
        """Unit ids become file names, so only a safe alphabet is allowed (no '/', no leading '.')."""
        return isinstance(unit_id, str) and _UNIT_ID_RE.match(unit_id) is not None

    @property
    def units_dir(self) -> Path:
        return self.run_dir / _UNITS

    def unit(self, unit_id: str) -> Path:
        """The manifest of one unit; `unit_id` must pass `is_unit_id` (the writer checks it)."""
        return self.units_dir / f"{unit_id}.json"

    def unit_ids(self) -> list[str]:
        """Ids of the unit manifests present, sorted; temporary files and odd names are skipped."""
        if not self.units_dir.is_dir():
            return []
        ids = [p.stem for p in self.units_dir.iterdir()
               if p.suffix == ".json" and not p.name.startswith(".") and self.is_unit_id(p.stem)]
        return sorted(ids)

    # -- part files
    @staticmethod
    def part_name(ipc_start: int, ipc_end: int) -> str:
        """File name of the part holding ipc indices [ipc_start, ipc_end)."""
        return f"part-ipc{ipc_start:05d}-{ipc_end:05d}.parquet"

    def label_dir(self, label: int) -> Path:
        return self.run_dir / f"label={int(label)}"

    def part(self, label: int, ipc_start: int, ipc_end: int) -> Path:
        return self.label_dir(label) / self.part_name(ipc_start, ipc_end)

    @staticmethod
    def label_of(part: Path) -> int | None:
        """The class of a part, from its label=<c> folder."""
        m = _LABEL_DIR_RE.match(part.parent.name)
        return int(m.group(1)) if m else None

    @staticmethod
    def ipc_range_of(part: Path) -> tuple[int, int] | None:
        """[start, end) of a part, from its file name; None for anything that is not a part."""
        m = _PART_RE.match(part.name)
        return (int(m.group(1)), int(m.group(2))) if m else None

    @classmethod
    def part_sort_key(cls, part: Path) -> tuple:
        """Class, then ipc range: the order readers return parts in."""
        label = cls.label_of(part)
        rng = cls.ipc_range_of(part)
        return (label if label is not None else -1, rng or (-1, -1), str(part))

    def parts_on_disk(self) -> list[Path]:
        """Every part file under the run, sorted, whether a manifest lists it or not."""
        return sorted(self.run_dir.glob(_PART_GLOB), key=self.part_sort_key)

    # -- paths recorded in manifests, relative to the run
    def relative(self, path: Path) -> str:
        return path.relative_to(self.run_dir).as_posix()

    def resolve(self, rel: str) -> Path | None:
        """``run_dir / rel`` if ``rel`` stays inside the run; manifests are data, not trusted paths."""
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts:
            return None
        return self.run_dir / p

    # -- stage checkpoints
    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / _CHECKPOINTS

    def checkpoint(self, unit_id: str, stage: int) -> Path:
        """The recover states of a unit after `stage` stages have run (`store.checkpoints`)."""
        return self.checkpoints_dir / f"{unit_id}{_CHECKPOINT_MARK}{stage}{_CHECKPOINT_SUFFIX}"

    def legacy_checkpoint(self, unit_id: str, stage: int) -> Path:
        """The same, as an earlier version wrote it (torch.save)."""
        return self.checkpoints_dir / f"{unit_id}{_CHECKPOINT_MARK}{stage}{_LEGACY_CHECKPOINT_SUFFIX}"

    def checkpoints(self, unit_id: str | None = None) -> list[Path]:
        """The checkpoint files of one unit, or of every unit (either format)."""
        if not self.checkpoints_dir.is_dir():
            return []
        pattern = f"{'*' if unit_id is None else unit_id}{_CHECKPOINT_MARK}*"
        return [p for p in self.checkpoints_dir.glob(pattern) if self.checkpoint_stage(p) is not None
                and (unit_id is None or self.checkpoint_stage(p)[0] == unit_id)]

    @staticmethod
    def checkpoint_stage(path: Path) -> tuple[str, int] | None:
        """(unit_id, stages completed) of a checkpoint file; None for any other name."""
        unit_id, mark, rest = path.name.rpartition(_CHECKPOINT_MARK)
        suffix = next((s for s in (_CHECKPOINT_SUFFIX, _LEGACY_CHECKPOINT_SUFFIX) if rest.endswith(s)), None)
        if not mark or suffix is None:
            return None
        try:
            return unit_id, int(rest.removesuffix(suffix))
        except ValueError:
            return None

    # -- patch selections
    def patch_selection(self, label: int) -> Path:
        """The scored patch ranking of one class (patches.ClassSelection as JSON)."""
        return self.run_dir / _PATCHES / f"label={int(label)}.json"

    def patch_selections(self) -> list[Path]:
        """Every class's patch ranking on disk."""
        return sorted((self.run_dir / _PATCHES).glob("label=*.json"))

    # -- evaluations
    @property
    def evaluations_dir(self) -> Path:
        return self.run_dir / _EVALUATIONS

    def evaluation(self, key: str) -> Path:
        """The cached result of the evaluation whose settings, teachers, data and images hash to `key`."""
        if not re.fullmatch(r"[0-9a-f]{8,64}", key):
            raise ValueError(f"an evaluation key is a hex digest, got {key!r}")
        return self.evaluations_dir / f"{key}.json"

    # -- report
    @property
    def report_dir(self) -> Path:
        return self.run_dir / _REPORT

    def report_files(self) -> dict[str, Path]:
        """Every report file by name (grid, losses, evaluation, evaluation_plot), present or not."""
        return {key: self.report_dir / name for key, name in _REPORT_FILES.items()}

    @property
    def report_source(self) -> Path:
        """Which data the grid and loss figures describe (the run's content hash when written)."""
        return self.report_dir / _REPORT_SOURCE
