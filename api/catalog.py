"""What requests may name: the operator's datasets and teachers.

Datasets are the built-in offline ones plus those the operator lists in FADRM_DATASETS (a YAML
mapping of name -> dataset spec, e.g. `pets: imagefolder:/data/pets`); a request names one and
never carries a spec or a path. Teachers are the `NAME.pt` files of FADRM_TEACHERS; a request
names one by its stem, and the checkpoint is only ever loaded weights-only
(`fadrm_ray.models.load_teacher`). Both are loaded once and kept (a teacher again when its file
changes).
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

from fadrm_ray.data import ImageDataset, get_dataset
from fadrm_ray.fileio import read_yaml_mapping
from fadrm_ray.models import TeacherInfo, load_teacher

from api.config import ServiceSettings, SettingsError
from api.models import NAME_PATTERN

BUILTIN_DATASETS = {"digits": "digits", "mnist-sample": "mnist-sample"}
_NAME = re.compile(NAME_PATTERN)


class UnknownName(LookupError):
    """A dataset or teacher the operator does not offer."""


@dataclass(frozen=True)
class Teacher:
    name: str
    path: Path
    info: TeacherInfo


class Catalog:
    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        self.dataset_specs = dict(BUILTIN_DATASETS)
        if settings.datasets is not None:
            self.dataset_specs.update(_read_dataset_specs(settings.datasets))
        self._datasets: dict[str, ImageDataset] = {}
        self._teachers: dict[Path, tuple[tuple[int, int], Teacher]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ datasets
    def dataset_names(self) -> list[str]:
        return sorted(self.dataset_specs)

    def dataset(self, name: str) -> ImageDataset:
        if name not in self.dataset_specs:
            raise UnknownName(f"unknown dataset {name!r}; this service offers: {', '.join(self.dataset_names())}")
        with self._lock:
            if name not in self._datasets:
                self._datasets[name] = get_dataset(self.dataset_specs[name])
            return self._datasets[name]

    # ------------------------------------------------------------------ teachers
    def teacher_names(self) -> list[str]:
        folder = self.settings.teachers
        return sorted(p.stem for p in folder.glob("*.pt") if p.is_file() and _NAME.match(p.stem))

    def teacher(self, name: str) -> Teacher:
        """The teacher `name` from the operator's folder (its info read weights-only, kept until the file changes)."""
        if not _NAME.match(name) or name not in self.teacher_names():
            raise UnknownName(f"unknown teacher {name!r}; this service offers: {', '.join(self.teacher_names()) or 'none'}")
        path = self.settings.teachers / f"{name}.pt"
        stat = path.stat()
        key = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._teachers.get(path)
            if cached is None or cached[0] != key:
                _, info = load_teacher(path)
                cached = (key, Teacher(name, path, info))
                self._teachers[path] = cached
            return cached[1]


def _read_dataset_specs(path: Path) -> dict[str, str]:
    loaded = read_yaml_mapping(path, f"FADRM_DATASETS: {path}", SettingsError)
    specs = {}
    for name, spec in loaded.items():
        if not isinstance(name, str) or not _NAME.match(name) or not isinstance(spec, str) or not spec.strip():
            raise SettingsError(f"FADRM_DATASETS: {path}: {name!r}: a name ({NAME_PATTERN}) must map to a dataset spec")
        specs[name] = spec.strip()
    return specs
