"""What `fadrm tune` was asked: `SweepRequest`, built from the flags (tune.sweep_command), and the
same request with every path it names made absolute (`with_absolute_paths`).

Paths are resolved against the working folder of the command before anything else happens, as
the other `fadrm` commands read them: a trial runs in a working folder of Ray Tune's, the driver
works in OUT, and a Ray job's working folder may be deleted while the sweep runs, so a relative
`imagefolder:data/shapes`, `--teacher t.pt`, `--store`, `--space` or `--data-root` would name
another place, or nothing, by the time it is read.
"""
from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from fadrm_ray.settings import ConfigError, Count, Index, Indices, describe, error_loc

# The fewest student seeds whose standard error a sweep writes (tune.confirm): with two, the s.e.
# rests on one difference, and two seeds that happen to agree read as certain ("± 0.00 s.e.").
MIN_SE_SEEDS = 3
# The flags of fields whose flag is not `--` + the field's name with `-` for `_` (tune.sweep_command).
FLAGS = {"teachers": "--teacher", "params": "--param", "space_file": "--space", "progress": "--quiet"}
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def flag(field: str) -> str:
    """The command-line flag of a SweepRequest field."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def _local_folder(path: str | None) -> str | None:
    # The driver writes results into OUT and trials write into the store with plain file I/O, so
    # a URI (s3://, gs://) would become a local folder named "s3:".
    if path is not None and _URI.match(path):
        raise ValueError(f"must be a local or mounted folder, not a URI, got {path!r}")
    return path


Folder = Annotated[str, AfterValidator(_local_folder)]


def _confirm_seeds(count: int) -> int:
    if 0 < count < MIN_SE_SEEDS:
        raise ValueError(f"must be 0 (the best compared on the trials' own seeds) or at least {MIN_SE_SEEDS}: the "
                         f"standard error of {count} seed{'s' if count != 1 else ''} is not usable, got {count}")
    return count


class SweepRequest(BaseModel):
    """What `fadrm tune` was asked (tune.sweep_command builds it from the flags). A bad value fails when
    it is built, as one ConfigError line that names the flag."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = Field(min_length=1)
    teachers: list[str]
    out: Folder
    preset: str = "fadrm"
    ipc: Count | None = None
    classes: Indices | None = None
    seed: Index | None = None
    params: list[str] = []
    space_file: str | None = None
    samples: Count | None = None        # None: 1 for a grid, 10 for random and optuna
    search: Literal["grid", "random", "optuna"] = "grid"
    scheduler: Literal["asha", "fifo"] = "asha"
    metric: Literal["top1"] = "top1"
    student: str | None = None
    seeds: Count | None = None
    epochs: Count | None = None
    protocol: Literal["short", "published"] | None = None
    eval_set: list[str] = []
    # Student seeds, beyond the trials' own, on which the best trials are evaluated again before
    # best.yaml is written (tune.confirm); 0: none; else at least MIN_SE_SEEDS.
    confirm_seeds: Annotated[int, Field(ge=0, le=50), AfterValidator(_confirm_seeds)] = 3
    max_concurrent: Count | None = None
    cpus_per_trial: float = Field(1.0, gt=0)
    gpus_per_trial: float = Field(0.0, ge=0)
    # Where the trials distill and train their students: cuda gives each trial a whole GPU unless
    # --gpus-per-trial says its share; None: cuda when --gpus-per-trial gives the trials GPUs.
    device: Literal["cpu", "cuda"] | None = None
    workers_per_trial: Count = 1
    address: str | None = None
    store: Folder | None = None         # default OUT/store
    data_root: str | None = None
    share: bool = True                  # dataset, teachers and patches shared (False: bench.sweep's control)
    progress: bool = True
    verbose: bool = False               # Ray's and Tune's own lines on the terminal, not in OUT/ray.log

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(_request_error(exc, data), error_loc(exc)) from None

    @property
    def trial_device(self) -> str:
        """Where each trial runs: cuda when it is given a GPU share."""
        return "cuda" if self.trial_gpus > 0 else "cpu"

    @property
    def trial_gpus(self) -> float:
        """The GPU share of each trial: --gpus-per-trial, or one GPU for --device cuda."""
        return self.gpus_per_trial or (1.0 if self.device == "cuda" else 0.0)

    @property
    def sample_count(self) -> int:
        return self.samples or (1 if self.search == "grid" else 10)

    def identity(self) -> dict:
        """What makes a sweep this sweep (a rerun with the same identity resumes it)."""
        keep = ("dataset", "teachers", "preset", "ipc", "classes", "seed", "params", "space_file", "samples",
                "search", "scheduler", "metric", "student", "seeds", "epochs", "protocol", "eval_set")
        return {k: v for k, v in self.model_dump(mode="json").items() if k in keep}


def absolute_dataset(spec: str) -> str:
    """`imagefolder:data/x` -> `imagefolder:/cwd/data/x` (and `folder:`, `parquet:`); any other
    spec as it is."""
    from fadrm_ray.data import path_source

    kind, _, path = spec.strip().partition(":")
    if path_source(spec) is None or not path:  # imagefolder+OPTION:PATH too
        return spec
    return f"{kind}:{os.path.abspath(path)}"


def with_absolute_paths(req: SweepRequest) -> SweepRequest:
    """The request with every path it names resolved against this process's working folder:
    the dataset's, the teachers, OUT, the store, the space file and the data root."""
    def absolute(path: str | None) -> str | None:
        return None if path is None else os.path.abspath(path)

    return req.model_copy(update={
        "dataset": absolute_dataset(req.dataset), "teachers": [absolute(t) for t in req.teachers],
        "out": absolute(req.out), "store": absolute(req.store), "space_file": absolute(req.space_file),
        "data_root": absolute(req.data_root)})


def _request_error(exc: ValidationError, data: dict) -> str:
    """One line for the first problem, naming the flag."""
    errors = exc.errors()
    unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return f"unknown sweep setting(s) {', '.join(unknown)}; known: {', '.join(SweepRequest.model_fields)}"
    err = errors[0]
    name = str(err["loc"][0])
    if err["type"] == "value_error":  # a validator of the field said what is wrong
        return f"{flag(name)} {err['ctx']['error']}"
    return f"{flag(name)} must be {_accepts(SweepRequest.model_fields[name])}, got {data.get(name, err['input'])!r}"


def _accepts(field) -> str:
    # A flag left out is None, so "or null" would only confuse.
    options = [a for a in get_args(field.annotation) if a is not type(None)]
    if len(options) == 1 and get_origin(options[0]) is Literal:  # an optional choice
        return "one of " + ", ".join(map(str, get_args(options[0])))
    return describe(field).removesuffix(" or null")
