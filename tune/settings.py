"""The bottom of the sweep: its constants (the folder names in OUT, Tune's time attribute), the
records its parts hand each other, and the driver's progress callback for the fit it runs (at
the bottom, and here, because Tune pickles it by this module's name with the experiment:
`restored_progress`). What the sweep's driver hands every trial is typed, frozen, and pickled
by Ray with the trainable (`tune.with_parameters(run_trial, sweep=TrialSettings(...))`), so a
trial reads attributes that were checked once in the driver instead of dict keys it has to
trust; what a trial hands back (its reports, the line it appends as it starts) is validated back
into its model (tune.results reads them). Every other module of tune/ may import this one; it
imports none of them.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from fadrm_ray.config import DistillConfig, EvalConfig
from fadrm_ray.settings import Count, Index, Indices

# Tune's time attribute: percent of the students' whole schedule (a TrialReport field).
TIME_ATTR = "student_pct"
# In OUT: Tune's experiment (its state, and each trial's folder), and what every part of the sweep
# did, one JSON object per line (the trials' lines are `TrialStarted` and free-form events).
EXPERIMENT = "experiment"
EVENTS = "events.jsonl"
# In OUT: Ray's and Tune's own lines of the sweep's driver, off the terminal (actors.ray_output).
RAY_LOG = "ray.log"


def _config_keys(values: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(values) - set(DistillConfig.model_fields))
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(unknown)}; known keys: "
                         f"{', '.join(sorted(DistillConfig.model_fields))}")
    return values


# DistillConfig overrides (key -> value, make_config's `overrides`): the keys are DistillConfig's;
# the values are judged when make_config builds a trial's config.
ConfigOverrides = Annotated[dict[str, Any], AfterValidator(_config_keys)]


class TrialBase(BaseModel):
    """What every trial's DistillConfig is built from before its own values: the sweep's preset,
    its flags (None: the preset's value) and the values the space fixes for every trial."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str
    ipc: Count | None = None
    classes: Indices | None = None
    seed: Index | None = None
    fixed: ConfigOverrides = {}


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


class PatchScoring(BaseModel):
    """One patch-scoring task of the sweep's driver (tune.trainable.score_patches): the resolved
    config whose patch settings decide the rankings, the classes to score, where, and with how
    many torch threads. The dataset and the teachers' bytes go beside it, through the object store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: DistillConfig               # resolved for the dataset and the device
    labels: list[int]
    device: Literal["cpu", "cuda"]
    threads: Count


class TrialReport(BaseModel):
    """What a trial reports to Tune (`tune.report(report.model_dump())`) at each of its students'
    test evaluations: the student's top-1 at `student_pct` percent of the students' schedule, and
    where and how its run was distilled. The last report (`final`) holds the mean over the student
    seeds and the seconds. tune.results reads it back from Tune's results with `from_metrics`."""

    # Tune adds keys of its own to what a trial reports (trial_id, training_iteration, ...).
    model_config = ConfigDict(extra="ignore", frozen=True)

    top1: float
    student_pct: float                  # TIME_ATTR
    final: bool
    node_id: str
    host: str
    run_id: str
    distill_seconds: float
    units_run: int
    patches_scored: int
    # The final report only:
    top1_std: float | None = None
    top1_per_seed: list[float] | None = None
    student_seconds: float | None = None
    evaluation_cached: bool | None = None
    trial_seconds: float | None = None

    @classmethod
    def from_metrics(cls, metrics: dict | None) -> "TrialReport | None":
        """A trial's last report from Tune's metrics of it; None when it reported nothing."""
        required = {name for name, field in cls.model_fields.items() if field.is_required()}
        if not metrics or not required <= set(metrics):
            return None
        return cls.model_validate(metrics)


assert TIME_ATTR in TrialReport.model_fields


class Reevaluation(BaseModel):
    """One of the sweep's best trials evaluated again (tune.confirm.evaluate_again, a Ray task of
    the driver): its run, read at `ipc`, on `seeds` (the trials' own seeds, read back from the
    run, and the confirmation's new ones) where `students`, and random real images of its classes
    and IPC on the same seeds where `random_real`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep: TrialSettings
    trial: str
    run_dir: str
    ipc: Count | None = None
    seeds: list[Index]
    students: bool = True
    random_real: bool


class Reevaluated(BaseModel):
    """What a Reevaluation measured: the students' top-1 seed by seed (in the order of `seeds`;
    empty where not asked), and random real images' on the same seeds (None where not asked, or
    `random_error` says why)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trial: str
    run_id: str
    seeds: list[int]
    top1_per_seed: list[float]
    random_real_per_seed: list[float] | None = None
    random_run_id: str | None = None
    random_error: str | None = None


class TrialStarted(BaseModel):
    """The line a trial appends to the sweep's events.jsonl as it starts (tune.trainable), read back
    by the driver (tune.results.started_trials): a trial that started and did not end was
    interrupted, not pending, whatever Tune's saved state says of it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    event: Literal["trial_started"] = "trial_started"
    trial: str
    values: dict[str, Any]
    node_id: str
    host: str


# The driver's progress callback (a tune.progress.SweepProgress) for the fit it runs. Tune pickles
# the callbacks with its experiment, and `Tuner.restore` unpickles them: a SweepProgress pickles
# as a call of `restored_progress`, so the restored Tuner calls the one this driver activated.
_active_progress: list = []


def activate_progress(progress) -> None:
    _active_progress[:] = [progress]


def restored_progress():
    """The driver's active progress callback, in place of the one pickled with the experiment."""
    if not _active_progress:
        raise RuntimeError("a sweep's experiment is resumed by the same `fadrm tune` command, not by Tuner.restore")
    return _active_progress[-1]
