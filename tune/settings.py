"""What the sweep's driver hands every trial: typed, frozen, and pickled by Ray with the trainable
(`tune.with_parameters(run_trial, sweep=TrialSettings(...))`), so a trial reads attributes that
were checked once in the driver instead of dict keys it has to trust.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fadrm_ray.settings import Count, EvalConfig, Index, Indices


class TrialBase(BaseModel):
    """What every trial's DistillConfig is built from before its own values: the sweep's preset,
    its flags (None: the preset's value) and the values the space fixes for every trial."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str
    ipc: Count | None = None
    classes: Indices | None = None
    seed: Index | None = None
    fixed: dict[str, Any] = {}


class TrialSettings(BaseModel):
    """The sweep's settings every trial reads (tune.trainable.run_trial's `sweep`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: TrialBase
    eval: EvalConfig                    # the students' settings, the same for every trial
    dataset: str                        # the dataset spec, for a trial that loads it itself
    data_root: str | None = None        # absolute: a trial's working folder is not the driver's
    teachers: list[str]                 # absolute paths (a node without them gets the bytes)
    store: str                          # absolute
    device: Literal["cpu", "cuda"]
    threads: Count                      # torch threads of a trial
    workers_per_trial: Count = 1
    cpus_per_worker: float = Field(gt=0)
    gpus_per_worker: float | None = Field(default=None, gt=0)
    events: str                         # the sweep's events.jsonl (absolute)


class TrialState(BaseModel):
    """What a trial's distillation did, kept in its Tune checkpoint (trial.json): a trial resumed
    after an error evaluates the run again without distilling it again."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_dir: str
    units_run: int
    units_skipped: int
    patches_scored: int
    distill_seconds: float
