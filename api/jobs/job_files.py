"""The folder of one job (`JobFiles`), and the small files the service and the job's driver hand each
other there, each a pydantic model: the driver's `Outcome`, the service's `StopOrder`, the
driver's `SoftLabelSnapshot` and `EvaluationStarted`. Each is written atomically and owner-only
(`write_model`) and read back validated (`read_model`: None for a file that is missing or garbled,
as for one not written yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from api.jobs.private_files import private_write

M = TypeVar("M", bound=BaseModel)


class Outcome(BaseModel):
    """How a job's driver ended (`JobFiles.outcome`): written once by the driver, and rewritten
    by the service where the driver could not (killed) or where it disagrees with the record.
    `state` is what the driver said, checked by the service (an unknown one fails the job)."""

    model_config = ConfigDict(extra="ignore")
    state: str
    error: str | None = None
    pid: int | None = None
    seconds: float | None = None


class StopOrder(BaseModel):
    """Why the service stopped a job's driver (`JobFiles.stop`): the state and error the job ends
    with, which the driver's outcome repeats."""

    model_config = ConfigDict(extra="ignore")
    state: str
    error: str | None = None


class EvaluationStarted(BaseModel):
    """Written by the driver as the job's evaluation starts (`JobFiles.evaluating`): when, so the
    service says the job is evaluating and times its students from then."""

    model_config = ConfigDict(extra="ignore")
    t: float


class SoftLabelSnapshot(BaseModel):
    """What a run's soft-label folder held before an evaluation (`JobFiles.soft_labels_before`):
    its files and folders (relative paths) and the text of each `meta.json` and `sha256.json`
    (`meta`; api.jobs.leftovers)."""

    model_config = ConfigDict(extra="ignore")
    existed: bool = True
    files: list[str] = []
    dirs: list[str] = []
    meta: dict[str, str] = {}


def write_model(path: Path, model: BaseModel) -> Path:
    """`model` as JSON at `path`: atomic, mode 0600."""
    return private_write(path, model.model_dump_json())


def read_model(path: Path, model: type[M]) -> M | None:
    """The model in `path`; None when the file is missing, unreadable or not that model."""
    try:
        return model.model_validate_json(Path(path).read_bytes())
    except (OSError, ValidationError):
        return None


@dataclass
class JobFiles:
    """The folder of one job: `STATE/jobs/<id>/`."""

    root: Path

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def outcome(self) -> Path:
        """Written once by the driver when it ends (`Outcome`)."""
        return self.root / "outcome.json"

    @property
    def stop(self) -> Path:
        """Written by the service before it stops the driver: the state and error the job ends
        with (cancelled, or failed past the time limit), which the driver's outcome repeats (`StopOrder`)."""
        return self.root / "stop.json"

    @property
    def soft_labels_before(self) -> Path:
        """Written by the driver before an evaluation that stores soft labels: what the run's
        soft-label folder held then (`SoftLabelSnapshot`), so a job that does not succeed can remove
        what it added."""
        return self.root / "soft-labels-before.json"

    @property
    def evaluating(self) -> Path:
        """Written by the driver as the job's evaluation starts (`EvaluationStarted`)."""
        return self.root / "evaluating.json"

    @property
    def log(self) -> Path:
        return self.root / "driver.log"

    @property
    def heartbeat(self) -> Path:
        """Touched by the driver every few seconds while it runs (api.jobs.runner.HEARTBEAT_S)."""
        return self.root / "heartbeat"

    @property
    def evaluation(self) -> Path:
        return self.root / "evaluation.json"

    @property
    def dataset(self) -> Path:
        return self.root / "dataset.parquet"

    @property
    def soft_labels(self) -> Path:
        """The stored soft labels of the job's evaluation, packed (built on the first request)."""
        return self.root / "soft-labels.parquet"

    @property
    def imagefolder(self) -> Path:
        return self.root / "imagefolder.zip"

    @property
    def preview(self) -> Path:
        return self.root / "preview.png"
