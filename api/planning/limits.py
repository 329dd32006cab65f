"""What one request may make the service do: the limits, as data an operator can raise.

Every value a request carries that makes work or memory grow with it has a ceiling here, and
`check_request` (api.planning.requests) compares the request's raw values with them in constant
time, before anything proportional to a value is built: a config with `k` = 10**7 would build
lists of k + 1 entries while it is validated, and one with 10**9 iterations would run for ever.
The totals bound what the counts do together: recover work (images x iterations), evaluation work
(images x epochs x seeds) and the bytes of stored soft labels. `job_seconds` ends a job that runs
longer (it fails with that reason).

Each limit is read from FADRM_MAX_<NAME> (e.g. FADRM_MAX_K, FADRM_MAX_JOB_SECONDS) or from the
`limits:` mapping of the settings file.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

_AT_LEAST_1 = {"ge": 1}


class RequestLimits(BaseSettings):
    """The largest value one request may ask for, each `FADRM_MAX_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix="FADRM_MAX_", extra="ignore", frozen=True, case_sensitive=False,
                                      env_ignore_empty=True)

    # What to distill.
    ipc: int = Field(50, **_AT_LEAST_1, description="images per class")
    images: int = Field(2000, **_AT_LEAST_1, description="classes x ipc")
    # The recover loop.
    k: int = Field(8, ge=0, description="ARC merges (k + 1 stages)")
    iterations: int = Field(20_000, **_AT_LEAST_1, description="recover iterations T over all stages")
    work: int = Field(8_000_000, **_AT_LEAST_1, description="images x iterations of one request")
    patch_crops: int = Field(32, **_AT_LEAST_1, description="crops scored per candidate image")
    patch_candidates: int = Field(100_000, **_AT_LEAST_1, description="candidate images scored per class")
    patch_group: int = Field(64, **_AT_LEAST_1, description="images per group of grouped patch selection")
    pack: int = Field(64, **_AT_LEAST_1, description="IPC batches optimized together")
    jitter: int = Field(64, **_AT_LEAST_1, description="roll offset in pixels")
    classes_per_batch: int = Field(1000, **_AT_LEAST_1, description="classes in one recover batch")
    resolution: int = Field(1024, **_AT_LEAST_1, description="downsample_size and stage_resolutions, in pixels")
    # Evaluation.
    epochs: int = Field(2000, **_AT_LEAST_1, description="student epochs")
    seeds: int = Field(10, **_AT_LEAST_1, description="students (seeds) per evaluation")
    batch_size: int = Field(1024, **_AT_LEAST_1, description="student batch size")
    eval_every: int = Field(2000, **_AT_LEAST_1, description="epochs between test evaluations")
    student_width: int = Field(512, **_AT_LEAST_1, description="student_kwargs.width")
    student_depth: int = Field(8, **_AT_LEAST_1, description="student_kwargs.depth")
    eval_work: int = Field(10_000_000, **_AT_LEAST_1,
                           description="images x epochs x seeds of one evaluation, over every student it trains")
    soft_label_bytes: int = Field(2 * 1024**3, **_AT_LEAST_1, description="stored soft labels of one evaluation")
    eval_backlog: int = Field(50_000_000, **_AT_LEAST_1,
                              description="images x epochs x seeds of every evaluation queued or running at once "
                                          "(the service's one token: all its clients together)")
    # The whole job.
    job_seconds: float = Field(4 * 3600, gt=0, description="wall-clock seconds of one job (then it fails)")


class OverLimit(ValueError):
    """A value over one of the service's limits: `loc` is where in the request body."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


# DistillConfig fields whose integer value makes work or memory grow, and the limit of each.
_DISTILL_COUNTS = {"k": "k", "iterations": "iterations", "patch_crops": "patch_crops",
                   "patch_candidates": "patch_candidates", "patch_group": "patch_group", "pack": "pack",
                   "ipc_per_unit": "ipc", "jitter": "jitter", "classes_per_batch": "classes_per_batch",
                   "downsample_size": "resolution"}
# ... and the list fields (k + 1 entries at most), with the limit of each entry.
_DISTILL_LISTS = {"stage_iterations": "iterations", "stage_resolutions": "resolution"}
_EVAL_COUNTS = {"epochs": "epochs", "batch_size": "batch_size", "eval_every": "eval_every"}
# The students a request may name, and the builder keywords it may set (none of them a path).
STUDENTS = ("convnet-bn", "resnet18-cifar")
_STUDENT_KWARGS = {"width": "student_width", "depth": "student_depth"}
_ENV = "FADRM_MAX_"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _over(limits: RequestLimits, name: str, value: Any, loc: tuple) -> None:
    """Refuse an integer `value` above the limit `name`; other types are left to the settings' own checks."""
    cap = getattr(limits, name)
    if _is_int(value) and value > cap:
        raise OverLimit(loc, f"{'.'.join(map(str, loc))} must be at most {cap} on this service "
                             f"({_ENV}{name.upper()}), got {value}")


def check_overrides(overrides: dict[str, Any], limits: RequestLimits) -> None:
    """The distill overrides against the limits, before any config is built from them."""
    for key, name in _DISTILL_COUNTS.items():
        _over(limits, name, overrides.get(key), ("overrides", key))
    for key, name in _DISTILL_LISTS.items():
        values = overrides.get(key)
        if isinstance(values, list):
            if len(values) > limits.k + 1:
                raise OverLimit(("overrides", key), f"overrides.{key} may have at most k + 1 = {limits.k + 1} "
                                                    f"entries on this service ({_ENV}K), got {len(values)}")
            for i, value in enumerate(values):
                _over(limits, name, value, ("overrides", key, i))


def check_evaluation(evaluation: dict[str, Any], limits: RequestLimits) -> None:
    """The evaluation settings against the limits, before an EvalConfig is built from them."""
    for key, name in _EVAL_COUNTS.items():
        _over(limits, name, evaluation.get(key), ("evaluation", key))
    seeds = evaluation.get("seeds")
    if isinstance(seeds, list) and len(seeds) > limits.seeds:
        raise OverLimit(("evaluation", "seeds"), f"evaluation.seeds may list at most {limits.seeds} seeds on this "
                                                 f"service ({_ENV}SEEDS), got {len(seeds)}")
    _over(limits, "seeds", seeds, ("evaluation", "seeds"))
    student = evaluation.get("student")
    if student is not None and student not in STUDENTS:
        raise OverLimit(("evaluation", "student"), f"evaluation.student must be one of {', '.join(STUDENTS)} on "
                                                   f"this service, got {str(student)[:80]!r}")
    kwargs = evaluation.get("student_kwargs")
    if isinstance(kwargs, dict):
        for key, value in kwargs.items():
            loc = ("evaluation", "student_kwargs", str(key)[:80])
            if key not in _STUDENT_KWARGS:
                raise OverLimit(loc, f"evaluation.student_kwargs may set only {', '.join(_STUDENT_KWARGS)} on this "
                                     f"service, got {str(key)[:80]!r}")
            if not _is_int(value) or value < 1:
                raise OverLimit(loc, f"evaluation.student_kwargs.{key} must be an integer >= 1, got {value!r}")
            _over(limits, _STUDENT_KWARGS[key], value, loc)


def check_totals(images: int, iterations: int, eval_images: int | None, epochs: int | None, seeds: int,
                 soft_label_bytes: int, limits: RequestLimits, students: int = 1) -> None:
    """What the counts make together: recover work, evaluation work (`students` a seed, each on
    `eval_images` images: api.planning.requests.eval_students) and stored soft labels."""
    if images * iterations > limits.work:
        raise OverLimit(("overrides", "iterations"),
                        f"{images} images x {iterations} iterations = {images * iterations} image-iterations; this "
                        f"service runs at most {limits.work} per request ({_ENV}WORK)")
    if eval_images is not None and epochs is not None:
        work = eval_images * students * epochs * seeds
        if work > limits.eval_work:
            each = f" x {students} students a seed" if students > 1 else ""
            raise OverLimit(("evaluation", "epochs"),
                            f"{eval_images} images{each} x {epochs} epochs x {seeds} seeds = {work} image-epochs (every "
                            f"student counted: the set's, the baselines', the hard-label ones); this service trains "
                            f"at most {limits.eval_work} per evaluation ({_ENV}EVAL_WORK)")
        if soft_label_bytes > limits.soft_label_bytes:
            raise OverLimit(("evaluation", "soft_labels"),
                            f"stored soft labels would take about {soft_label_bytes} bytes; this service stores at "
                            f"most {limits.soft_label_bytes} per evaluation ({_ENV}SOFT_LABEL_BYTES); use "
                            f"soft_labels: online")
