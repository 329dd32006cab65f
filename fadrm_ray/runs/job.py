"""DistillJob: everything one distillation needs, built once by whichever door asked for it.

A door (the `fadrm` command, `ray job submit`, a REST request, a Tune trial) turns what its user
said into a job with `build_job`: the config resolved for the dataset and the device the run uses,
the dataset by its spec and content hash, the teachers by path and sha256, the store root and the
run id (`make_run_id`, here). The paths in it are absolute (a folder or Parquet dataset's too:
`reopenable_spec`), so the run it makes can be read, evaluated and repaired from any directory;
the run id depends on none of them. The job is frozen and crosses processes as JSON
(`model_dump_json` / `model_validate_json`); nobody downstream resolves it again or derives the
run id again.

How the job runs (in this process or on Ray actors, how many workers, threads) is not part of
it: that is the `ExecutionSpec` beside it, and `runs.execute.run_job` runs any job through any
executor.

`JobParts` is what building a job loaded in this process (the dataset, the teacher models), so an
executor in the same process loads nothing twice; `JobParts.load` loads them for a job built
elsewhere, and refuses a dataset or teacher whose content is no longer what the job was built on.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Sequence

from annotated_types import Ge, Gt
from pydantic import BaseModel, ConfigDict

from fadrm_ray.config import ConfigError, DistillConfig
from fadrm_ray.errors import InputError
from fadrm_ray.pilot_record import PilotRecord, cached_pilot, pilot_reason
from fadrm_ray.settings import Settings
from fadrm_ray.teacher_record import TeacherRecord

if TYPE_CHECKING:
    import torch.nn as nn

    from fadrm_ray.data.base import ImageDataset


class DistillJob(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    config: DistillConfig            # resolved for the dataset and `device_type`
    dataset_spec: str                # what `fadrm_ray.data.get_dataset` loads
    data_root: str | None = None
    dataset_fingerprint: str
    num_classes: int
    image_size: int
    channels: int | None = None      # None in jobs recorded before the recipe depended on it
    teachers: tuple[TeacherRecord, ...]  # each `TeacherRecord.reference()`, by absolute path
    store: str                       # the store root; the run is STORE/<run_id>
    run_id: str
    device_type: str                 # the device type the config was resolved for
    pilot: PilotRecord | None = None  # the pilot whose choice `auto` took (pilot_record.py)
    recipe_given: bool = False       # the recipe was named (`--set recipe=NAME`), not left to auto

    @property
    def recipe(self) -> str:
        """The recipe the config's "auto" values came from, and why (`recipes.recipe_reason`)."""
        from fadrm_ray.recipes import recipe_reason

        if self.channels is None:
            return recipe_reason(self.config.recipe, given=self.recipe_given)
        return recipe_reason(self.config.recipe, self.image_size, self.channels, piloted=self.pilot is not None,
                             given=self.recipe_given)

    @property
    def run_dir(self) -> Path:
        return Path(self.store) / self.run_id

    @property
    def teacher_paths(self) -> list[str]:
        return [t.path for t in self.teachers]


class ExecutionSpec(Settings):
    """How a job runs (never what it computes): crosses processes as JSON like the job. A value
    out of range is refused when it is built, as one `ConfigError` line naming the field."""

    local: bool = False                  # in this process, without Ray
    address: str | None = None           # Ray cluster to join; None = an embedded local Ray
    workers: Annotated[int, Ge(1)] | None = None  # distill actors; None = one per GPU, else per cpus_per_worker CPUs
    cpus_per_worker: Annotated[float, Gt(0)] = 1.0
    gpus_per_worker: Annotated[float, Ge(0)] | None = None  # GPU share per actor (fractions); None = 1 when GPUs exist
    device: str | None = None            # cpu or cuda for --local; None = cuda when available
    threads: Annotated[int, Ge(1)] | None = None  # torch threads of this process (--local)
    data_root: str | None = None         # where downloadable datasets live
    progress: bool = True
    verbose: bool = False                # Ray's own lines on the terminal, not in the run's ray.log


def reopenable_spec(dataset_spec: str, dataset: "ImageDataset") -> str:
    """`dataset_spec` as it reopens `dataset` from any directory: a folder or Parquet dataset by
    the absolute path it was read from (`imagefolder:/abs/path`), a folder that left unreadable
    files out as `imagefolder+skip-bad-images:/abs/path` (so it leaves the same ones out again and
    its fingerprint matches), anything else as it is."""
    from fadrm_ray.data import SKIP_BAD_IMAGES, path_source

    named = path_source(dataset_spec)
    source = named.name if named else None
    path = dataset.info.get("path")
    if source is None or source != dataset.info.get("source") or not path:
        return dataset_spec
    if dataset.info.get("skipped"):
        source = f"{source}+{SKIP_BAD_IMAGES}"
    return f"{source}:{path}"


def make_run_id(cfg: DistillConfig, dataset_fingerprint: str, teacher_hashes: Sequence[str]) -> str:
    """Same pixel-deciding settings (`DistillConfig.identity`), data and teachers -> same run id,
    so a rerun resumes, and a rerun at another IPC or with other speed settings grows or reads
    the same run."""
    payload = json.dumps({"config": cfg.identity(), "dataset": dataset_fingerprint,
                          "teachers": list(teacher_hashes)}, sort_keys=True)
    return f"{cfg.preset.replace('+', 'plus')}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"


def build_job(cfg: DistillConfig, dataset: "ImageDataset", dataset_spec: str, teachers: Sequence["TeacherRecord"],
              store: str | Path, device_type: str = "cpu", data_root: str | None = None) -> DistillJob:
    """The job of `cfg` (unresolved) on `dataset` with `teachers` (checked to fit the dataset):
    resolved once, its run id computed once. The dataset spec and the teachers' paths are
    recorded absolute (`reopenable_spec`; a teacher's path as this process sees it). Where the
    config leaves the recipe to `auto` on data no one measured (`pilot_reason`), the recipe is
    the choice of the pilot cached in the store for this data, teachers and IPC (pilot_record.py),
    which the job carries into the run's provenance; without one, the size's recipe."""
    from fadrm_ray.models import check_teacher_fits

    if not teachers:
        raise InputError("at least one teacher checkpoint is needed (--teacher PATH)")
    if cfg.preset == "fadrm+" and len(teachers) < 2:
        raise ConfigError("preset fadrm+ needs several teachers (--teacher PATH, repeated)")
    for info in teachers:
        check_teacher_fits(info, dataset)
    fingerprint = dataset.fingerprint()
    given = cfg.recipe != "auto"
    pilot = None
    if pilot_reason(cfg, dataset) is None:
        pilot = cached_pilot(store, fingerprint, [i.sha256 for i in teachers], cfg.ipc)
        if pilot is not None:
            cfg = cfg.model_copy(update={"recipe": pilot.chosen})
    resolved = cfg.resolve(dataset.image_size, dataset.num_classes, dataset.hflip, device_type,
                           channels=dataset.channels)
    refs = tuple(i.reference().model_copy(update={"path": os.path.abspath(i.path)}) for i in teachers)
    return DistillJob(config=resolved, dataset_spec=reopenable_spec(dataset_spec, dataset), data_root=data_root,
                      dataset_fingerprint=fingerprint, num_classes=dataset.num_classes,
                      image_size=dataset.image_size, channels=dataset.channels, teachers=refs, store=str(store),
                      run_id=make_run_id(resolved, fingerprint, [t.sha256 for t in refs]), device_type=device_type,
                      pilot=pilot, recipe_given=given)


@dataclass
class JobParts:
    """The loaded things a job names: its dataset and its teacher models (on `device`)."""

    dataset: "ImageDataset"
    models: list["nn.Module"]
    infos: list["TeacherRecord"]
    device: str

    @classmethod
    def of(cls, dataset: "ImageDataset", loaded: Sequence[tuple], device: str) -> "JobParts":
        """From `load_teacher`'s (model, info) pairs; the dataset normalized as the teachers expect
        (`models.teacher_view`)."""
        from fadrm_ray.models import teacher_view

        infos = [info for _, info in loaded]
        return cls(teacher_view(dataset, infos), [model for model, _ in loaded], infos, device)

    @classmethod
    def load(cls, job: DistillJob, device: str = "cpu", dataset: "ImageDataset | None" = None) -> "JobParts":
        """Load what `job` names, checked against the content it was built on."""
        from fadrm_ray.models import load_teacher

        dataset = dataset if dataset is not None else load_dataset(job)
        loaded = [load_teacher(ref.path, device=device) for ref in job.teachers]
        for ref, (_, info) in zip(job.teachers, loaded):
            if info.sha256 != ref.sha256:
                raise InputError(f"teacher {ref.path} changed since the job was built (its sha256 is not the job's)")
        return cls.of(dataset, loaded, device)

    def on(self, device: str) -> "JobParts":
        """The same parts with the teacher models on `device`."""
        if device == self.device:
            return self
        return JobParts(self.dataset, [m.to(device) for m in self.models], self.infos, device)


def load_dataset(job: DistillJob) -> "ImageDataset":
    """The job's dataset, refused if its content is no longer what the job was built on."""
    from fadrm_ray.data import get_dataset

    dataset = get_dataset(job.dataset_spec, root=job.data_root)
    if not dataset.matches(job.dataset_fingerprint):
        raise InputError(f"dataset {job.dataset_spec!r} changed since the job was built "
                         f"(its content hash is not the job's)")
    return dataset


def teacher_blobs(job: DistillJob) -> tuple[bytes, ...]:
    """The bytes of the job's teachers (for processes that may not see these files), refused if
    a file is no longer what the job was built on."""
    blobs = tuple(Path(ref.path).read_bytes() for ref in job.teachers)
    for ref, blob in zip(job.teachers, blobs):
        if hashlib.sha256(blob).hexdigest() != ref.sha256:
            raise InputError(f"teacher {ref.path} changed since the job was built (its sha256 is not the job's)")
    return blobs


def prepare_job(cfg: DistillConfig, dataset: "ImageDataset", dataset_spec: str, teacher_paths: Sequence[str | Path],
                store: str | Path, device: str = "cpu", device_type: str | None = None,
                data_root: str | None = None) -> tuple[DistillJob, JobParts]:
    """Load the teachers (on `device`) and build the job for a run on `device_type` (default:
    `device`'s type): the job, and the parts it loaded for an executor in this process."""
    import torch

    from fadrm_ray.models import load_teacher

    if not teacher_paths:
        raise InputError("at least one teacher checkpoint is needed (--teacher PATH)")
    parts = JobParts.of(dataset, [load_teacher(path, device=device) for path in teacher_paths], device)
    job = build_job(cfg, dataset, dataset_spec, parts.infos, store, device_type or torch.device(device).type, data_root)
    return job, parts
