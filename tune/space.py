"""The search space of a sweep: `--param KEY=SPEC` and `--space FILE.yaml`, checked by DistillConfig.

A SPEC is a list of values (a grid: `alpha=0.3,0.5,0.7`, `stage_resolutions=[24,28],[28,28]`,
`downsample_size=null,20`) or a distribution: `uniform(a,b)`, `loguniform(a,b)`, `randint(a,b)`
(both ends included) or `choice(v1,v2,...)`. A list of one value fixes the key for every trial.
Values are read as YAML, like `fadrm distill --set`. A space file maps keys to the same specs: a
YAML list, a scalar (fixed), or a string, read exactly as `--param` reads it (`alpha: 0.3,0.5` is
the grid `--param alpha=0.3,0.5` makes). A value given twice in one grid or choice, and a key
given twice with `--param`, are refused: either would run the same trial twice, or silently
drop one of them.

`DistillConfig` is the one judge of what a value may be: before any trial starts, every
combination of the grid values, the choices and both ends of each range is built into a config
with `make_config` and resolved for the dataset (`DistillConfig.resolve`), so an unknown key or
an out-of-range value fails with one line that names the key.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from fadrm_ray.config import DistillConfig, make_config
from fadrm_ray.settings import ConfigError

from tune.settings import TrialBase

_DIST = re.compile(r"^\s*(uniform|loguniform|randint|choice)\s*\((.*)\)\s*$", re.S)
# The checks of every combination stop here (the keys' values are still each checked alone).
MAX_CHECKED_COMBINATIONS = 4096


@dataclass(frozen=True)
class Param:
    """One swept key: `kind` is "grid" or a distribution name; `values` the grid values or choices,
    or the (low, high) ends of a range."""

    key: str
    kind: str
    values: tuple

    def checked_values(self) -> tuple:
        """The values the config model must accept: every grid value or choice, both ends of a range."""
        if self.kind in ("uniform", "loguniform"):
            return tuple(float(v) for v in self.values)
        return self.values

    def tune_domain(self, search: str):
        """The Tune search space of this key: a grid (grid search) or a distribution."""
        from ray import tune

        if self.kind == "grid":
            return tune.grid_search(list(self.values)) if search == "grid" else tune.choice(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        low, high = self.values
        if self.kind == "uniform":
            return tune.uniform(float(low), float(high))
        if self.kind == "loguniform":
            return tune.loguniform(float(low), float(high))
        return tune.randint(int(low), int(high) + 1)  # randint(a, b): b included

    def describe(self) -> str:
        if self.kind == "grid":
            return ",".join(shown_value(v) for v in self.values)
        return f"{self.kind}({','.join(shown_value(v) for v in self.values)})"


def shown_value(value: Any) -> str:
    """A value as the tables, plots and lines show it: in YAML's flow style, as `--param` takes it."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def shown_values(values: dict | None, swept) -> str:
    """The swept keys' values of a trial (`values`: its config or its row), as `key=value ...`."""
    return " ".join(f"{k}={shown_value((values or {}).get(k))}" for k in swept)


def parse_spec(key: str, spec: Any, where: str) -> Param:
    """A Param from a command-line string or a value of a space file."""
    if isinstance(spec, list):
        values = spec
    elif isinstance(spec, str) and (m := _DIST.match(spec)):
        kind, body = m.group(1), m.group(2)
        values = _yaml_list(body, where)
        if kind == "choice":
            if not values:
                raise ConfigError(f"{where}: choice(...) needs at least one value")
            _refuse_repeats(values, where)
            return Param(key, kind, tuple(values))
        if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{where}: {kind}(a, b) needs two numbers, got {spec!r}")
        low, high = values
        if not low < high:
            raise ConfigError(f"{where}: {kind}(a, b) needs a < b, got {spec!r}")
        if kind == "loguniform" and low <= 0:
            raise ConfigError(f"{where}: loguniform(a, b) needs a > 0, got {spec!r}")
        if kind == "randint" and not all(isinstance(v, int) for v in values):
            raise ConfigError(f"{where}: randint(a, b) needs two integers, got {spec!r}")
        return Param(key, kind, (low, high))
    elif isinstance(spec, str):  # the command line's syntax, from either place
        values = _yaml_list(spec, where)
    else:
        values = [spec]
    if not values:
        raise ConfigError(f"{where}: no values")
    _refuse_repeats(values, where)
    return Param(key, "grid", tuple(values))


def _refuse_repeats(values: list, where: str) -> None:
    """A grid or choice naming one value twice would run (or sample) the same trial twice."""
    seen: list = []
    for value in values:
        # == matches 0.3 and 0.30, or 1 and 1.0, but a bool is not the number it equals.
        if any(value == s and isinstance(value, bool) == isinstance(s, bool) for s in seen):
            raise ConfigError(f"{where}: the value {shown_value(value)} is given twice; give each value once")
        seen.append(value)


def _yaml_list(text: str, where: str) -> list:
    try:
        values = yaml.safe_load(f"[{text}]")
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: cannot read the values {text!r} ({exc.__class__.__name__})") from None
    return list(values)


def _check_key(key: str, where: str) -> None:
    known = DistillConfig.model_fields
    if key not in known:
        raise ConfigError(f"{where}: unknown config key {key!r}; known keys: {', '.join(sorted(known))}")
    if key in ("preset", "ipc"):
        raise ConfigError(f"{where}: {key} is set by --{key}, not swept here")


def parse_space(params: Sequence[str] = (), space_file: str | Path | None = None) -> dict[str, Param]:
    """key -> Param from a space file, then `--param` (a key on the command line replaces the
    file's); keys are checked to exist, and a key repeated with `--param` is refused."""
    space: dict[str, Param] = {}
    given: set[str] = set()
    if space_file is not None:
        from fadrm_ray.fileio import read_yaml_mapping

        path = Path(space_file)
        loaded = read_yaml_mapping(path, f"--space {path}", ConfigError)
        for key, spec in loaded.items():
            where = f"--space {path}: {key}"
            _check_key(str(key), where)
            space[str(key)] = parse_spec(str(key), spec, where)
    for item in params:
        key, sep, raw = item.partition("=")
        key = key.strip()
        where = f"--param {key or item}"
        if not sep or not key or not raw.strip():
            raise ConfigError(f"--param {item!r} must look like KEY=V1,V2,... or KEY=uniform(a,b)")
        _check_key(key, where)
        if key in given:
            raise ConfigError(f"{where} is given twice; give each key once (KEY=V1,V2,... for a grid)")
        given.add(key)
        space[key] = parse_spec(key, raw.strip(), where)
    return space


def split_space(space: dict[str, Param]) -> tuple[dict[str, Any], dict[str, Param]]:
    """(fixed values, swept params): a grid of one value is fixed for every trial."""
    fixed = {k: p.values[0] for k, p in space.items() if p.kind == "grid" and len(p.values) == 1}
    return fixed, {k: p for k, p in space.items() if k not in fixed}


def trial_config(base: TrialBase, values: dict[str, Any]) -> DistillConfig:
    """The DistillConfig of one trial: the sweep's preset and flags, its fixed values, the trial's
    values (make_config's layering: preset -> overrides -> flags)."""
    return make_config(base.preset, None, {**base.fixed, **values}, ipc=base.ipc, classes=base.classes,
                       seed=base.seed)


def check_values(base: TrialBase, swept: dict[str, Param]) -> None:
    """Build the config of each swept value alone, without the dataset: a value the config model
    refuses anywhere (alpha=2, k=uniform(1,3)) fails here, before the data and torch load."""
    for key, param in swept.items():
        for value in param.checked_values():
            _check(base, {key: value}, None, "cpu", key)
    if not swept:
        _check(base, {}, None, "cpu", None)


def validate_space(base: TrialBase, swept: dict[str, Param], dataset, device_type: str = "cpu") -> int:
    """Build and resolve the config of every combination of the swept values (grid values,
    choices, both ends of ranges), raising one ConfigError naming the key at the first bad one.
    Returns the number of combinations checked."""
    for key, param in swept.items():  # each key alone first, so the message names the right key
        for value in param.checked_values():
            _check(base, {key: value}, dataset, device_type, key)
    keys = list(swept)
    combos = itertools.product(*(swept[k].checked_values() for k in keys))
    checked = 0
    for combo in itertools.islice(combos, MAX_CHECKED_COMBINATIONS):
        values = dict(zip(keys, combo))
        _check(base, values, dataset, device_type, None)
        checked += 1
    if not swept:
        _check(base, {}, dataset, device_type, None)
    return checked


def _check(base: TrialBase, values: dict, dataset, device_type: str, key: str | None) -> None:
    try:
        cfg = trial_config(base, values)
        if dataset is not None:  # the checks that depend on the images (sizes, classes)
            cfg.resolve(dataset.image_size, dataset.num_classes, dataset.hflip, device_type,
                        channels=dataset.channels)
    except ConfigError as exc:
        combination = ", ".join(f"{k}={shown_value(v)}" for k, v in values.items())
        named = key or next((k for k in values if str(exc).startswith(k)), None)
        prefix = f"--param {named}" if named else "the fixed settings"
        raise ConfigError(f"{prefix}: {exc}" + (f" (with {combination})" if len(values) > 1 else "")) from None
