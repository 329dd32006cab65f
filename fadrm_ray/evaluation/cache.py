"""Evaluations kept on disk, under one key convention.

Every result an evaluation keeps (a run's evaluation, each of its students, a hard-label student,
DD-Ranking's full-data reference) is a JSON file named by `EvalKey.digest()`: a hash of
everything that decides the result, so a later identical call reads it instead of training
again, and anything that changes the result names another file. Fields at their defaults are
left out of the hash, so a key that gains a field keeps naming the files written before it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from fadrm_ray.fileio import atomic_write_text

# Part of every key: raise it when a change of student training changes results.
EVALUATION_CACHE_VERSION = 1

M = TypeVar("M", bound=BaseModel)


def digest(source: dict[str, Any]) -> str:
    """The name a kept result is filed under: a hash of the JSON of what decides it."""
    return hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:32]


class EvalKey(BaseModel):
    """What decides a kept result."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: dict[str, Any]                 # the resolved student settings (`EvalConfig.key_values`)
    data: str                              # the dataset's fingerprint
    device: str                            # the device type the students trained on
    teachers: list[str] | None = None      # ids of the teachers labelling (None: hard labels)
    images: str | None = None              # the images' content hash (None: the dataset's training split)
    kind: str | None = None                # None: students of the teachers' soft labels; else what they learn
    test_classes: list[int] | None = None  # tested on these classes only (None: every class)
    augment: bool = True                   # False: students that see the images as they are
    seed: int | None = None                # one student (None: the seeds of `config`)
    version: int = EVALUATION_CACHE_VERSION

    def digest(self) -> str:
        source = self.model_dump(mode="json")
        for name in ("teachers", "images", "kind", "test_classes", "augment", "seed"):
            if source[name] == EvalKey.model_fields[name].default:
                del source[name]
        return digest(source)

    def student(self, seed: int) -> "EvalKey":
        """The key of one student of this evaluation: the same, its seed instead of the seed list."""
        config = {k: v for k, v in self.config.items() if k != "seeds"}
        return self.model_copy(update={"config": config, "seed": seed})



def keep(path: Path, result: BaseModel, **dump: Any) -> None:
    """Write `result` to `path` (atomically, its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, result.model_dump_json(**dump))
