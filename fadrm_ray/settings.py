"""What every settings model shares: the `Settings` base, the constrained value types, layering
(`layered`) and the one-line errors.

The models themselves live together in config.py: `DistillConfig` (the knobs of a
distillation), `EvalConfig` (student evaluation), `SqueezeConfig` (teacher training) and
`PilotConfig` (the pilot of `auto`). Each is validated when it is built, so a bad value fails
before any work starts (a `DistillConfig` once more when `resolve` fills in what depends on the
dataset, since those values are new); each is saved whole beside what it produced (config.yaml of
a run, `config` in report/evaluation.json, the teacher checkpoint's info). Runtime choices
(device, threads, progress bars, output paths) are not settings: they are `runs.job.ExecutionSpec`
(distillation), `evaluation.eval_job.EvalSpec` (evaluation) or arguments of the function that
runs a phase.

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
