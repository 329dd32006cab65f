"""What a pilot measured, and where it is kept (pilot.py runs it).

A pilot compares a few recipes on a sample of a dataset, beside random real images, and keeps
the best; its `PilotRecord` is kept in the store at `STORE/.pilots/<key>.json` and in the
machine's cache (`FADRM_CACHE/pilots/<key>.json`), the key being the dataset's content hash, the
teachers' sha256 and the IPC asked for: the same data, teachers and IPC are measured once on a
machine, whatever store a run goes to. Every door that builds a job (`runs.job.build_job`: the
command, the Ray door, the service, a sweep's trials) looks the record up (the store first, then
the machine's cache) and takes its recipe where the config leaves the recipe to `auto`, so one
measurement serves them all, and the job carries the record into the run's provenance.

Whether the pilot may say its choice is below random real images is calibrated on the grids
where its verdict was checked against full-size runs (docs/benchmarks/accuracy.md, "Is the
pilot's verdict right?"): at IPC 1 its students of 1,000 steps ranked the sets as full-size
students did, at IPC 10 they undervalued the gentle recovery by 2 to 6 points. So it warns only
at the IPCs where its evidence held (`WARNS_UP_TO_IPC`), where its choice is below random real
images by more than two standard errors; elsewhere it says it cannot tell, and that `fadrm
evaluate` measures it at full size.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Protocol, Sequence

from pydantic import BaseModel, ConfigDict

from fadrm_ray.config import DistillConfig
from fadrm_ray.recipes import RECIPE_FIELDS
from fadrm_ray.fileio import atomic_write_text, cache_root, read_model
from fadrm_ray.paired import PairedGain
from fadrm_ray.config import PilotConfig

PILOTS_DIR = ".pilots"
MACHINE_PILOTS = "pilots"   # under fileio.cache_root()
# The largest pilot IPC at which the pilot's "below random real images" was right wherever it was
# checked at full size (pairs10 and clipart10 at IPC 1; at IPC 10 it was wrong: accuracy.md).
WARNS_UP_TO_IPC = 1
PILOT_VERSION = 2  # 2: the candidates by IPC (mosaics at IPC 1)
# Datasets the paper published a recipe for: their recipe stays the default; the pilot is for
# data no one measured. Matched on the dataset's name (a folder's or Parquet dataset's own name).
PUBLISHED_DATA = {"cifar10", "cifar-10", "cifar100", "cifar-100", "imagenet", "imagenet-1k", "ilsvrc2012",
                  "tiny-imagenet", "tiny-imagenet-200"}
PILOT_PRESETS = ("fadrm", "fadrm+")


class PilotRow(BaseModel):
    """One candidate (or random real images) as the pilot measured it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    recipe: str                          # a recipe name, or "random-real"
    run_id: str
    top1_per_seed: list[float]
    top1_mean: float
    images: int = 0                      # the images its students trained on
    vs_random: PairedGain | None = None  # paired over random real images (None for their own row)
    seconds: float                       # its distillation and students
    estimated_seconds: float | None = None  # what the pilot's plan estimated for it


class PilotRecord(BaseModel):
    """A pilot's measurement and its choice; crosses processes as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = PILOT_VERSION
    dataset: str
    dataset_fingerprint: str
    teachers: tuple[str, ...]            # sha256
    ipc: int                             # the IPC of the runs it serves
    settings: PilotConfig
    classes: list[int] = []              # the classes sampled
    pilot_ipc: int = 0
    scale: float = 1.0                   # the sizes of `settings` it ran at (the bound may scale them)
    rows: list[PilotRow] = []            # the candidates, in the order tried
    random_real: PilotRow | None = None
    chosen: str                          # the recipe the runs take
    estimated_seconds: float = 0.0
    run_estimate_seconds: float = 0.0    # the run's time at the size's own recipe, as the pilot estimated it
    run_estimates: dict[str, float] = {}  # the run's time at each recipe tried, as the pilot estimated it
    seconds: float = 0.0
    skipped: str | None = None           # why it did not run (then `chosen` is the size's recipe)

    def run_estimate(self) -> tuple[float, str] | None:
        """The run's estimated seconds at the recipe chosen, and how it was made: its steps as they
        were timed when the pilot began, times what the pilot's own sets then took against their
        estimates (this machine's speed as it went on to be, other work on it included); None
        where the pilot estimated no run."""
        timed = self.run_estimates.get(self.chosen)
        if timed is None:
            return None
        if not (self.seconds and self.estimated_seconds):  # skipped: no set measured
            return timed, "from its steps timed on this machine"
        factor = self.seconds / self.estimated_seconds
        return timed * factor, (f"from its steps timed on this machine ({timed:.1f} s), times {factor:.2f} as the "
                                f"pilot's sets took against their estimates")

    @property
    def chosen_row(self) -> PilotRow | None:
        return next((r for r in self.rows if r.recipe == self.chosen), None)

    @property
    def below_random(self) -> str | None:
        """One line when the chosen recipe is below random real images by more than two standard
        errors on the pilot (no candidate was level with them) at an IPC where the pilot's verdict
        held at full size (`WARNS_UP_TO_IPC`), with the choices; else None."""
        gain = self._gain
        if gain is None or not gain.clearly_below or self.pilot_ipc > WARNS_UP_TO_IPC:
            return None
        return (f"no recipe the pilot tried is level with random real images on this data (the best, {self.chosen}, "
                f"{gain.mean:+.2f} ± {gain.stderr:.2f} points on the pilot): the run goes on with {self.chosen}; "
                f"for random real images instead, distill with --preset random-real")

    @property
    def cannot_tell(self) -> str | None:
        """One line where the pilot's choice came out below random real images at an IPC where its
        short students are known to misjudge that (above `WARNS_UP_TO_IPC`): it cannot tell, and
        the full evaluation will; else None."""
        gain = self._gain
        if gain is None or gain.stderr is None or gain.mean >= 0 or self.pilot_ipc <= WARNS_UP_TO_IPC:
            return None
        return (f"the pilot cannot tell whether {self.chosen} is above random real images here ({gain.mean:+.2f} ± "
                f"{gain.stderr:.2f} on its short students, which at IPC {self.pilot_ipc} undervalued it before: "
                f"docs/benchmarks/accuracy.md); fadrm evaluate measures the run beside random real images")

    @property
    def _gain(self) -> PairedGain | None:
        row = self.chosen_row
        return row.vs_random if row is not None else None

    def summary(self) -> str:
        """One line: what was chosen and why, or why the pilot was skipped."""
        if self.skipped is not None:
            return f"pilot skipped: {self.skipped}; recipe {self.chosen} (by image size)"
        row = self.chosen_row
        gain = "" if row is None or row.vs_random is None else \
            f", {row.vs_random.mean:+.2f} ± {row.vs_random.stderr or 0:.2f} over random real images"
        tried = ", ".join(f"{r.recipe} {r.top1_mean:.1f}" for r in self.rows)
        base = f"random real {self.random_real.top1_mean:.1f}" if self.random_real is not None else ""
        return (f"pilot chose {self.chosen}{gain} (top-1 on {len(self.classes)} classes at IPC {self.pilot_ipc}: "
                f"{tried}; {base}; {self.seconds:.0f} s)")


class NamedData(Protocol):
    """What `pilot_reason` reads of a dataset (a `fadrm_ray.data.ImageDataset`): this record sits
    below the store, which keeps it, and the data sources sit above the store, which they read."""

    name: str
    channels: int


def pilot_reason(cfg: DistillConfig, dataset: NamedData) -> str | None:
    """Why no pilot is run for `cfg` on `dataset` (a recipe given, nothing left to `auto`, data
    with a measured or published recipe...), or None when one is: the recipe is `auto`, some
    recipe field is left to it, and the data is colour data no one measured."""
    if cfg.recipe != "auto":
        return f"the recipe is set ({cfg.recipe})"
    if cfg.preset not in PILOT_PRESETS or cfg.init != "real":
        return f"preset {cfg.preset} sets its own recover settings"
    if all(getattr(cfg, name) != "auto" for name in RECIPE_FIELDS):
        return "every value a recipe sets is given"
    if dataset.channels == 1:
        return "single-channel data takes the recipe measured on it (small-grey below 64 px)"
    name = dataset.name.partition(":")[2] or dataset.name
    if name.lower() in PUBLISHED_DATA:
        return f"{name} takes the recipe the paper published for it"
    return None


def pilot_file(fingerprint: str, teacher_hashes: Sequence[str], ipc: int) -> str:
    """The file name of the pilot of this data, teachers (sha256) and IPC, in a store and on the machine."""
    key = json.dumps({"data": fingerprint, "teachers": list(teacher_hashes), "ipc": ipc, "version": PILOT_VERSION},
                     sort_keys=True)
    return f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def pilot_path(store: str | Path, fingerprint: str, teacher_hashes: Sequence[str], ipc: int) -> Path:
    return Path(store) / PILOTS_DIR / pilot_file(fingerprint, teacher_hashes, ipc)


def machine_pilots() -> Path:
    """Where this machine keeps every pilot it measured, for every store (`fileio.cache_root`)."""
    return cache_root() / MACHINE_PILOTS


def cached_pilot(store: str | Path, fingerprint: str, teacher_hashes: Sequence[str], ipc: int) -> PilotRecord | None:
    """The pilot measured for this data, teachers (by sha256) and IPC: the store's, else the one this
    machine measured for another store; None where neither is (or is readable)."""
    found = read_model(PilotRecord, pilot_path(store, fingerprint, teacher_hashes, ipc))
    if found is None:
        found = read_model(PilotRecord, machine_pilots() / pilot_file(fingerprint, teacher_hashes, ipc))
    return found


def keep_pilot(store: str | Path, record: PilotRecord) -> Path:
    """Cache a measured pilot in the store and on the machine (a skipped one is not kept: its bound
    depends on the run). The machine's copy is best effort: a cache that cannot be written costs
    a later store a measurement, not this run."""
    path = pilot_path(store, record.dataset_fingerprint, record.teachers, record.ipc)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = record.model_dump_json(indent=1)
    with contextlib.suppress(OSError):
        machine = machine_pilots() / pilot_file(record.dataset_fingerprint, record.teachers, record.ipc)
        machine.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(machine, text)
    return atomic_write_text(path, text)
