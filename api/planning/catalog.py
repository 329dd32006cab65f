"""What requests may name: the operator's datasets and teachers.

Datasets are the built-in offline ones plus those the operator lists in FADRM_DATASETS (a YAML
mapping of name -> dataset spec, e.g. `pets: imagefolder:/data/pets`); a request names one and
never carries a spec or a path. Teachers are the `NAME.pt` files of FADRM_TEACHERS; a request
names one by its stem, and the checkpoint is only ever loaded weights-only
(`fadrm_ray.models.load_teacher`). Both are loaded once and kept (a teacher again when its file
changes), each behind a lock of its own name: a dataset being loaded holds up no other.

`GET /v1/datasets` answers from `described`, the datasets' descriptions read once, as the service
starts, by `read_all` in a thread of its own (`CatalogReader`), never in a request; /readyz is
503 until it has read them all (a dataset that cannot be read is logged and left out; one still
being read after DATASET_READ_S seconds is logged, and listed once read).
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fadrm_ray.data import ImageDataset, get_dataset
from fadrm_ray.fileio import read_yaml_mapping
from fadrm_ray.models import load_teacher
from fadrm_ray.teacher_record import TeacherRecord

from api.contract.schemas import NAME_PATTERN
from api.contract.service_errors import scrub
from api.planning.service_settings import SettingsError

BUILTIN_DATASETS = {"digits": "digits", "mnist-sample": "mnist-sample"}
DATASET_READ_S = 120.0  # how long the service waits for one dataset's description before it is ready without it
_NAME = re.compile(NAME_PATTERN)
log = logging.getLogger("fadrm.api")


class UnknownName(LookupError):
    """A dataset or teacher the operator does not offer."""


class UnusableTeacher(LookupError):
    """A teacher file of the operator's that does not load (said without its path)."""


@dataclass(frozen=True)
class Teacher:
    name: str
    path: Path
    info: TeacherRecord


class Catalog:
    """The operator's datasets and teachers: `teachers` the folder of checkpoints (FADRM_TEACHERS),
    `datasets` the YAML file of dataset specs (FADRM_DATASETS), beside the built-in ones."""

    def __init__(self, teachers: Path, datasets: Path | None = None):
        self.teacher_folder = teachers
        self.dataset_specs = dict(BUILTIN_DATASETS)
        if datasets is not None:
            self.dataset_specs.update(_read_dataset_specs(datasets))
        self._datasets: dict[str, ImageDataset] = {}
        self._loading: dict[str, threading.Lock] = {}
        # Each dataset's description for GET /v1/datasets (DatasetInfo's fields), or why it cannot
        # be read; filled by `read_all`.
        self.described: dict[str, dict | str] = {}
        self.read = threading.Event()  # set once `read_all` has been through every dataset
        # Each teacher file as last read: the file's identity (inode, size, mtime), and the
        # teacher, or why it does not load: a broken file is read once, not on every listing.
        self._teachers: dict[Path, tuple[tuple[int, int, int], Teacher | str]] = {}
        self._reading: dict[Path, threading.Lock] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ datasets
    def dataset_names(self) -> list[str]:
        return sorted(self.dataset_specs)

    def dataset(self, name: str) -> ImageDataset:
        """The dataset `name`, loaded at its first use and kept (one loader per name)."""
        if name not in self.dataset_specs:
            raise UnknownName(f"unknown dataset {name!r}; this service offers: {', '.join(self.dataset_names())}")
        with self._lock:
            if name in self._datasets:
                return self._datasets[name]
            gate = self._loading.setdefault(name, threading.Lock())
        with gate:
            with self._lock:
                if name in self._datasets:
                    return self._datasets[name]
            loaded = get_dataset(self.dataset_specs[name])
            with self._lock:
                self._datasets[name] = loaded
            return loaded

    def read_all(self, stop: threading.Event | None = None, each_s: float = DATASET_READ_S) -> None:
        """Describe every dataset into `described` (the built-in ones first), then set `read`. Each
        is read in a thread of its own, waited for at most `each_s` seconds: one that takes longer
        (an operator's folder on a mount that hangs) is logged and left to finish on its own,
        listed once read, and the service is ready without it. `stop` ends the reading between
        datasets (the service stopping)."""
        stop = stop or threading.Event()
        for name in sorted(self.dataset_names(), key=lambda n: (n not in BUILTIN_DATASETS, n)):
            reader = threading.Thread(target=self._describe, args=(name,), name=f"fadrm-dataset-{name}", daemon=True)
            reader.start()
            if not self._waited(reader, stop, each_s):
                if stop.is_set():
                    return
                log.warning("dataset %s is still being read after %.0f s: the service is ready without it; it is "
                            "listed once read", name, each_s)
        self.read.set()

    @staticmethod
    def _waited(reader: threading.Thread, stop: threading.Event, seconds: float) -> bool:
        """Whether `reader` ended within `seconds` (False at once when `stop` is set)."""
        deadline = time.monotonic() + seconds
        while reader.is_alive() and not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            reader.join(min(left, 0.2))
        return not reader.is_alive()

    def _describe(self, name: str) -> None:
        try:
            self.described[name] = {**self.dataset(name).describe(), "name": name}
        except Exception as exc:  # an operator's dataset that cannot be read: logged, not listed
            log.warning("dataset %s is not offered: it cannot be read: %s", name, scrub(str(exc))[:300])
            self.described[name] = f"{type(exc).__name__}"

    def pending(self) -> list[str]:
        """The datasets not described yet."""
        return [name for name in self.dataset_names() if name not in self.described]

    # ------------------------------------------------------------------ teachers
    def _files(self) -> list[str]:
        return sorted(p.stem for p in self.teacher_folder.glob("*.pt") if p.is_file() and _NAME.match(p.stem))

    def teacher_names(self) -> list[str]:
        """The teachers offered: the files of the folder that load as teachers."""
        return [name for name in self._files() if isinstance(self._entry(name), Teacher)]

    def _entry(self, name: str) -> Teacher | str:
        """The teacher of `name`'s file, or why it does not load: read once per version of the
        file (its inode, size and mtime), one reader at a time per file, outside the catalog's
        lock, so a large broken file neither is read again nor holds up other requests."""
        path = self.teacher_folder / f"{name}.pt"
        try:
            stat = path.stat()
        except OSError:
            return f"teacher {name!r} is gone from the teacher folder"
        key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            cached = self._teachers.get(path)
            if cached is not None and cached[0] == key:
                return cached[1]
            gate = self._reading.setdefault(path, threading.Lock())
        with gate:
            with self._lock:
                cached = self._teachers.get(path)
                if cached is not None and cached[0] == key:
                    return cached[1]
            try:
                _, info = load_teacher(path)
                entry: Teacher | str = Teacher(name, path, info)
            except Exception as exc:  # not a readable fadrm checkpoint: refused for what it is, never offered
                log.warning("teacher %s is not offered: %s", name, scrub(str(exc)))
                entry = (f"teacher {name!r} cannot be used: its file is not a readable fadrm teacher checkpoint "
                         f"({type(exc).__name__}); the operator's log says more")
            with self._lock:
                self._teachers[path] = (key, entry)
            return entry

    def teacher(self, name: str) -> Teacher:
        """The teacher `name` from the operator's folder (its info read weights-only, kept until the
        file changes): UnknownName for a name not in the folder, UnusableTeacher for a file that
        does not load."""
        if not _NAME.match(name) or name not in self._files():
            raise UnknownName(f"unknown teacher {name!r}; this service offers: {', '.join(self.teacher_names()) or 'none'}")
        entry = self._entry(name)
        if isinstance(entry, str):
            raise UnusableTeacher(entry)
        return entry


class CatalogReader(threading.Thread):
    """`catalog.read_all()` in a thread of its own, started with the service, ended between
    datasets by `stopping`."""

    def __init__(self, catalog: Catalog):
        super().__init__(name="fadrm-catalog", daemon=True)
        self.catalog, self.stopping = catalog, threading.Event()

    def run(self) -> None:
        try:
            self.catalog.read_all(self.stopping)
        except Exception:
            log.exception("reading the datasets failed")
            self.catalog.read.set()


def _read_dataset_specs(path: Path) -> dict[str, str]:
    loaded = read_yaml_mapping(path, f"FADRM_DATASETS: {path}", SettingsError)
    specs = {}
    for name, spec in loaded.items():
        if not isinstance(name, str) or not _NAME.match(name) or not isinstance(spec, str) or not spec.strip():
            raise SettingsError(f"FADRM_DATASETS: {path}: {name!r}: a name ({NAME_PATTERN}) must map to a dataset spec")
        specs[name] = spec.strip()
    return specs
