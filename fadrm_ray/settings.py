"""The settings schema: one pydantic model per phase, and what they share.

`DistillConfig` (config.py) holds the knobs of a distillation, `EvalConfig` those of student
evaluation and `SqueezeConfig` those of teacher training. Each is validated when it is built,
so a bad value fails before any work starts (a `DistillConfig` once more when `resolve` fills in
what depends on the dataset, since those values are new); each is saved whole beside what it produced
(config.yaml of a run, `config` in report/evaluation.json, the teacher checkpoint's info).
Runtime choices (device, threads, progress bars, output paths) are not settings: they are
arguments of the functions that run a phase, or of `run.job.ExecutionSpec`.

Errors reach users and the CLI as one `ConfigError` line that starts with the field's name and
states what it accepts, e.g. `alpha must be in (0, 1], got 2`. The accepted values are read from
each field's type and constraints, so the message cannot drift from what is checked.
"""
from __future__ import annotations

import json
import types
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from fadrm_ray.errors import InputError


class ConfigError(InputError):
    """A config value is out of range, of the wrong type, or unknown. `loc` is where, as pydantic
    gives it (the field first; empty for a check across fields), so a caller can point at the
    field (the REST service's 422) without reading the message."""

    def __init__(self, message: str, loc: tuple = ()):
        super().__init__(message)
        self.loc = tuple(loc)


class EvaluationError(InputError):
    """A run cannot be evaluated as asked (missing teacher, unknown dataset, bad option)."""


class EvalConfigError(ConfigError, EvaluationError):
    """A bad evaluation setting: callers that catch either error see it."""


class Settings(BaseModel):
    """Base of the settings models: unknown keys refused, immutable once built, and every
    validation failure raised as one `error_class` (a ConfigError) whose message starts with the field."""

    # No infinity or NaN anywhere: `lr: inf` would "succeed" with black images and null losses.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)
    error_class: ClassVar[type[ConfigError]] = ConfigError

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise self.error_class(error_message(exc, type(self), data), error_loc(exc)) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs):
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise cls.error_class(error_message(exc, cls, obj), error_loc(exc)) from None


SettingsT = TypeVar("SettingsT", bound=Settings)


# --------------------------------------------------------------------------- shared field types
def _ordered(pair: tuple[float, float]) -> tuple[float, float]:
    if pair[0] > pair[1]:
        raise ValueError(f"must satisfy low <= high, got {pair!r}")
    return pair


def _distinct(items: list[int]) -> list[int]:
    if len(set(items)) != len(items):
        raise ValueError(f"must not repeat, got {items}")
    return items


# Scalars are strict: "0.5", True or 1.5 are not silently read as a number or a count.
Flag = Annotated[bool, Field(strict=True)]
Count = Annotated[int, Field(strict=True, ge=1)]
Index = Annotated[int, Field(strict=True, ge=0)]
Fraction = Annotated[float, Field(strict=True, gt=0, le=1)]
Share = Annotated[float, Field(strict=True, ge=0, le=1)]   # a part of a whole that may be none of it
# A crop's area as a fraction of the image: below 1e-4 a crop is less than a pixel of a 100-px image.
AreaFraction = Annotated[float, Field(strict=True, ge=1e-4, le=1)]
# A [low, high] range of area fractions (random-resized crops, patch crops).
ScaleRange = Annotated[tuple[AreaFraction, AreaFraction], AfterValidator(_ordered)]
# A loss weight: finite and far below where a bf16/fp16 product overflows.
Weight = Annotated[float, Field(strict=True, ge=0, le=1e4)]
Indices = Annotated[list[Index], MinLen(1), AfterValidator(_distinct)]


# --------------------------------------------------------------------------- error messages
def error_loc(exc: ValidationError) -> tuple:
    """Where the problem `error_message` describes is: an unknown key, else the first error's loc."""
    errors = exc.errors()
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    inner = errors[0].get("ctx", {}).get("error")
    if not unknown and isinstance(inner, ConfigError):  # raised by __init__ (model_validate calls it): its loc
        return inner.loc
    loc = tuple((unknown or [errors[0]["loc"]])[0])
    # The field, then positions in it; pydantic's names of union branches ("constrained-float") are not places.
    return loc[:1] + tuple(x for x in loc[1:] if isinstance(x, int))


def error_message(exc: ValidationError, model: type[BaseModel], data: Any) -> str:
    """One line for the first problem pydantic found, naming the field first."""
    errors = exc.errors()
    unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return f"unknown config key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(model.model_fields))}"
    err = errors[0]
    if not err["loc"]:  # a check across fields: its message names them
        return str(err.get("ctx", {}).get("error", err["msg"]))
    field = str(err["loc"][0])
    if err["type"] == "value_error":  # a validator of this field said what is wrong
        return f"{field} {err['ctx']['error']}"
    value = data[field] if isinstance(data, dict) and field in data else err["input"]
    return f"{field} must be {describe(model.model_fields[field])}, got {value!r}"


def describe(field: FieldInfo) -> str:
    """What a field accepts, in words: 'an integer >= 1', 'in (0, 1]', 'one of a, b'."""
    if get_origin(field.annotation) is Literal:
        return "one of " + ", ".join(str(v) for v in get_args(field.annotation))
    alternatives = _alternatives(field.annotation, list(field.metadata))
    return alternatives[0] if len(alternatives) == 1 else ", ".join(alternatives[:-1]) + " or " + alternatives[-1]


def _alternatives(tp: Any, meta: list, plural: bool = False) -> list[str]:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _alternatives(args[0], meta + _flat(tp.__metadata__), plural)
    if origin in (Union, types.UnionType):
        return [alt for arg in args for alt in _alternatives(arg, meta, plural)]
    if tp is type(None):
        return ["null"]
    if origin is Literal:
        return [json.dumps(v) for v in args]
    if tp is bool:
        return ["true", "false"]
    if tp in (int, float):
        noun = {int: ("an integer", "integers"), float: ("a number", "numbers")}[tp][plural]
        return [_bounded(noun, meta, plural)]
    if origin is list:
        sized = "a non-empty list" if any(isinstance(m, MinLen) and m.min_length > 0 for m in meta) else "a list"
        return [f"{sized} of " + " or ".join(_alternatives(args[0], [], plural=True))]
    if origin is tuple:
        return ["a pair [low, high] of " + " or ".join(_alternatives(args[0], [], plural=True))]
    if origin is dict or tp is dict:
        return ["a mapping of key: value"]
    if tp is str:
        return ["a non-empty string" if any(isinstance(m, MinLen) for m in meta) else "a string"]
    return [getattr(tp, "__name__", str(tp))]


def _flat(meta) -> list:
    return [m for item in meta for m in (item.metadata if isinstance(item, FieldInfo) else [item])]


def _bounded(noun: str, meta: list, plural: bool) -> str:
    """'an integer >= 1', 'a number > 0', or for two bounds 'in (0, 1]' ('numbers in (0, 1]')."""
    b = {type(m): m for m in meta if isinstance(m, (Ge, Gt, Le, Lt))}
    low = (">=", "[", b[Ge].ge) if Ge in b else (">", "(", b[Gt].gt) if Gt in b else None
    high = ("<=", "]", b[Le].le) if Le in b else ("<", ")", b[Lt].lt) if Lt in b else None
    if low and high:
        return f"{noun + ' ' if plural else ''}in {low[1]}{low[2]:g}, {high[2]:g}{high[1]}"
    if low or high:
        op, _, value = low or high
        return f"{noun} {op} {value:g}"
    return noun


# --------------------------------------------------------------------------- layers
def layered(model: type[SettingsT], *layers: dict[str, Any], flags: dict[str, Any] | None = None) -> SettingsT:
    """Merge `layers` (later wins), then `flags` (a flag left at None is not given), and
    validate the result once."""
    values: dict[str, Any] = {}
    for layer in layers:
        values.update(layer)
    values.update({k: v for k, v in (flags or {}).items() if v is not None})
    return model.model_validate(values)


# --------------------------------------------------------------------------- evaluate and squeeze
# EvalConfig fields added after evaluations were cached, with the value those evaluations had.
EVAL_LATER_FIELDS = {"teacher_bn": "running", "soft_label_topk": None, "soft_label_epochs": None,
                     "reference_steps": 5000}


class LabelStorage(BaseModel):
    """How stored soft labels are kept (soft_label_store.py): the logits' number type, the k
    largest logits of each view (None: all), the epochs kept (None: every training epoch), and
    the KD temperature at which the top-k probabilities are kept exactly."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    dtype: Literal["float16", "float32"] = "float16"
    topk: Count | None = None
    epochs: Count | None = None
    temperature: float = Field(20.0, gt=0)

    def kept(self, num_classes: int) -> int | None:
        """The logits kept per view, or None when that is all of them."""
        return None if self.topk is None or self.topk >= num_classes else int(self.topk)


class EvalConfig(Settings):
    """How students are trained on distilled images and scored (evaluate.py, docs/method.md section 6)."""

    error_class: ClassVar[type[ConfigError]] = EvalConfigError

    student: str = Field("convnet-bn", strict=True, min_length=1)   # model name (models.create_model)
    student_kwargs: dict[str, Any] = {}
    # How epochs and the cosine stretch are chosen when they are left unset (evaluate.resolve_protocol):
    # "short" trains about 600 optimizer steps with a full cosine; "published" is the published
    # schedule, 300 epochs (1000 at IPC 1) with the stretched cosine.
    protocol: Literal["short", "published"] = "short"
    epochs: Count | None = None          # None: chosen by the protocol
    seeds: Count | Annotated[list[Index], MinLen(1)] = 3   # a count (seeds 0..n-1) or the seeds themselves
    batch_size: Count = 16
    temperature: float = Field(20.0, strict=True, gt=0, le=1e3)  # KD temperature T
    lr: float = Field(1e-3, strict=True, gt=0, le=10)      # AdamW
    weight_decay: float = Field(0.01, strict=True, ge=0, le=10)
    cosine_stretch: float | None = Field(None, strict=True, ge=1)  # eta of the stretched cosine; None: by protocol
    soft_labels: Literal["online", "stored"] = "online"    # teacher logits on the fly, or precomputed into the run
    soft_label_dtype: Literal["float16", "float32"] = "float16"  # storage of stored soft labels
    # Stored soft labels keep the k largest logits of each view (and one value for the other
    # classes) and only this many epochs, read in turn (soft_label_store.py); None: all.
    soft_label_topk: Count | None = None
    soft_label_epochs: Count | None = None
    crop_scale: ScaleRange = (0.08, 1.0)                   # random-resized crop area of each student view
    cutmix_prob: float = Field(1.0, strict=True, ge=0, le=1)
    eval_every: Count | None = None      # epochs between test evaluations; None: about 6 in all
    # How the teachers' BatchNorm layers normalize a student batch when they label it: with
    # their running statistics, or with the batch's own (CV-DD's batch-specific soft labels,
    # docs/method.md section 7c).
    teacher_bn: Literal["running", "batch"] = "running"
    # The most optimizer steps DD-Ranking's full-data reference (ranking.py) may take when it is
    # not kept yet; where training on the whole split would take more, the teachers' recorded
    # test top-1 stands in for it, and the evaluation says so.
    reference_steps: Count = 5000

    def key_values(self) -> dict[str, Any]:
        """The settings as they name a cached evaluation: a field added later, at the value that
        gives the results cached before it (EVAL_LATER_FIELDS), is left out, so those stay valid."""
        return {k: v for k, v in self.model_dump(mode="json").items()
                if not (k in EVAL_LATER_FIELDS and v == EVAL_LATER_FIELDS[k])}

    def label_storage(self) -> "LabelStorage":
        """How this recipe's stored soft labels are kept."""
        return LabelStorage(dtype=self.soft_label_dtype, topk=self.soft_label_topk,
                            epochs=self.soft_label_epochs, temperature=self.temperature)

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)


class SqueezeConfig(Settings):
    """How a teacher is trained on the real data (squeeze.py, docs/method.md section 1)."""

    model: str = Field("convnet-bn", strict=True, min_length=1)  # model name (models.create_model)
    model_kwargs: dict[str, Any] = {}    # builder keywords; in_chans here feeds grey data to an RGB model
    epochs: Count = 15
    batch_size: Count = 128
    lr: float = Field(1e-3, strict=True, gt=0)             # Adam, cosine over all steps
    weight_decay: float = Field(1e-4, strict=True, ge=0)
    label_smoothing: float = Field(0.1, strict=True, ge=0, le=1)
    cutmix_prob: float = Field(0.5, strict=True, ge=0, le=1)
    seed: Index = 0


class PilotConfig(Settings):
    """How the pilot measures the candidate recipes on data no one measured (pilot.py): a sample
    of classes, a few images per class, each candidate's recover budget cut to a share, short
    students with paired seeds, beside random real images. Bounded: it may always spend
    `free_seconds`; above that, at most `max_share` of the run's estimated recover time, scaled
    down to fit (never below `min_scale` of these sizes; below it, it is skipped and says so)."""

    classes: Count = 10                  # classes sampled (every class of smaller datasets)
    ipc: Count = 10                      # images per class: the run's IPC where it is smaller
    recover_share: Fraction = 0.25       # each candidate's T, as a share of its recipe's
    student_steps: Count = 1000          # optimizer steps of each pilot student
    seeds: Annotated[int, Field(strict=True, ge=2, le=10)] = 3  # paired student seeds
    free_seconds: float = Field(600.0, strict=True, ge=0)        # spent whatever the run's size
    max_share: Fraction = 0.1            # of the run's estimated recover time, above free_seconds
    min_scale: Fraction = 0.25           # the smallest scaling of the sizes above before skipping
