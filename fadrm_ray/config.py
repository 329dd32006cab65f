"""One config dataclass for every knob of a distillation run (FADRM.md sections 2-7).

A config is validated on construction, so a bad value fails before any work starts, with a
message that names the field and the allowed range. Presets are named sets of overrides of the
defaults (FADRM.md section 7). What depends on the dataset (stage budgets and resolutions,
jitter, flip, precision) is filled in by `resolve`, and the resolved config is what every run
saves beside its images.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value is out of range, of the wrong type, or unknown."""


PRECISIONS = ("auto", "fp32", "bf16", "fp16")
INITS = ("real", "noise")
PATCH_SELECTIONS = ("easy", "medium", "random", "whole")
ARC_TIMINGS = ("fixed", "converged")


@dataclass
class DistillConfig:
    # What to distill.
    preset: str = "fadrm"
    ipc: int = 10                        # images per class
    classes: list[int] | None = None     # class indices to distill; None = every class
    seed: int = 0

    # Initialization (FADRM.md section 2).
    init: str = "real"                   # "real" patches or Gaussian "noise" (SRe2L, CDA)
    patch_selection: str = "easy"        # easy = lowest teacher CE first; medium = middle of the ranking;
                                         # random = random crops; whole = random whole images (random-real)
    patch_crops: int = 5                 # random square crops scored per candidate image
    patch_crop_scale: tuple[float, float] = (0.5, 1.0)   # crop area as a fraction of the image
    patch_candidates: int = 0            # candidate images scored per class; 0 = all of them

    # The optimization loop (FADRM.md section 3).
    iterations: int = 2000               # T, over all stages
    lr: float = 0.25
    r_bn: float = 0.01
    first_bn_weight: float = 10.0
    jitter: int | str = "auto"           # roll offset bound in pixels; auto = 32 at >= 128 px, else D // 8 capped at 4
    flip: bool | str = "auto"            # auto = the dataset says whether a flip keeps the label
    crop_scale_min: float = 0.08         # RandomResizedCrop lower scale bound
    crop_curriculum: bool = False        # CDA: the lower bound anneals 1.0 -> crop_scale_min by cosine

    # Stages, ARC, MRO, MPT (FADRM.md section 4).
    k: int = 3                           # number of ARC merges; k + 1 stages
    alpha: float = 0.5                   # x <- alpha * x + (1 - alpha) * P at each merge
    stage_iterations: list[int] | None = None    # explicit budgets (k + 1 of them, summing to iterations)
    downsample_size: int | str | None = "default"  # D_ds: int, "auto" (TV-based), "default"
                                                   # (200/224 of D when D >= 128, else no MRO), None = no MRO
    stage_resolutions: list[int] | None = None   # explicit R_s per stage; the last must be D
    arc_timing: str = "fixed"            # "converged": end a stage early once CE and BN losses are small
    arc_ce_threshold: float = 0.01
    arc_bn_threshold: float = 60.0
    precision: str = "auto"              # auto = bf16 on a CPU that has it, fp16 + GradScaler on CUDA

    # Scheduling: how a run is cut into units of work.
    classes_per_batch: int = 100         # classes in one batch (one image per class; 100 as published); 0 = all
    ipc_per_unit: int = 1                # IPC indices in one unit of work
    pack: int = 1                        # IPC batches optimized together in one forward/backward

    # Speed only: how fast the loop runs, not what it computes (beyond float rounding).
    channels_last: bool = True           # channels-last activations (faster convs and pooling on CPU)
    compile: bool = False                # torch.compile the teacher's loss (compiled once per input shape)

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        _int_at_least("ipc", self.ipc, 1)
        _int_at_least("seed", self.seed, 0)
        if self.classes is not None:
            if isinstance(self.classes, (str, bytes)) or not all(_is_int(c) for c in self.classes):
                raise ConfigError(f"classes must be a list of class indices, got {self.classes!r}")
            if not self.classes:
                raise ConfigError("classes must not be empty (leave it unset for every class)")
            if any(c < 0 for c in self.classes):
                raise ConfigError(f"classes must be >= 0, got {self.classes}")
            if len(set(self.classes)) != len(self.classes):
                raise ConfigError(f"classes must not repeat, got {self.classes}")
        _choice("init", self.init, INITS)
        _choice("patch_selection", self.patch_selection, PATCH_SELECTIONS)
        _int_at_least("patch_crops", self.patch_crops, 1)
        _int_at_least("patch_candidates", self.patch_candidates, 0)
        lo, hi = _pair("patch_crop_scale", self.patch_crop_scale)
        if not 0 < lo <= hi <= 1:
            raise ConfigError(f"patch_crop_scale must satisfy 0 < low <= high <= 1, got {self.patch_crop_scale}")
        self.patch_crop_scale = (lo, hi)
        _int_at_least("iterations", self.iterations, 0)
        _positive("lr", self.lr)
        _number_at_least("r_bn", self.r_bn, 0.0)
        _number_at_least("first_bn_weight", self.first_bn_weight, 0.0)
        if self.jitter != "auto":
            _int_at_least("jitter", self.jitter, 0, extra=' or "auto"')
        if self.flip not in ("auto", True, False):
            raise ConfigError(f'flip must be true, false or "auto", got {self.flip!r}')
        if not (isinstance(self.crop_scale_min, (int, float)) and 0 < self.crop_scale_min <= 1):
            raise ConfigError(f"crop_scale_min must be in (0, 1], got {self.crop_scale_min!r}")
        _int_at_least("k", self.k, 0)
        if not (isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and 0 < self.alpha <= 1):
            raise ConfigError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if self.stage_iterations is not None:
            if not isinstance(self.stage_iterations, (list, tuple)) or not all(_is_int(v) and v >= 0 for v in self.stage_iterations):
                raise ConfigError(f"stage_iterations must be a list of integers >= 0, got {self.stage_iterations!r}")
            if len(self.stage_iterations) != self.k + 1:
                raise ConfigError(f"stage_iterations must have k + 1 = {self.k + 1} entries, got {len(self.stage_iterations)}")
            if sum(self.stage_iterations) != self.iterations:
                raise ConfigError(f"stage_iterations must sum to iterations = {self.iterations}, got {sum(self.stage_iterations)}")
        if not (self.downsample_size is None or self.downsample_size in ("auto", "default")):
            _int_at_least("downsample_size", self.downsample_size, 1, extra=', "auto", "default" or null')
        if self.stage_resolutions is not None:
            if not isinstance(self.stage_resolutions, (list, tuple)) or not all(_is_int(v) and v >= 1 for v in self.stage_resolutions):
                raise ConfigError(f"stage_resolutions must be a list of integers >= 1, got {self.stage_resolutions!r}")
            if len(self.stage_resolutions) != self.k + 1:
                raise ConfigError(f"stage_resolutions must have k + 1 = {self.k + 1} entries, got {len(self.stage_resolutions)}")
        _choice("arc_timing", self.arc_timing, ARC_TIMINGS)
        _number_at_least("arc_ce_threshold", self.arc_ce_threshold, 0.0)
        _number_at_least("arc_bn_threshold", self.arc_bn_threshold, 0.0)
        _choice("precision", self.precision, PRECISIONS)
        _int_at_least("classes_per_batch", self.classes_per_batch, 0)
        _int_at_least("ipc_per_unit", self.ipc_per_unit, 1)
        _int_at_least("pack", self.pack, 1)
        for name in ("channels_last", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.init == "noise" and self.uses_arc:
            raise ConfigError("alpha < 1 with k > 0 (ARC) merges back to real patches, so it needs init = real, "
                              "not noise; set alpha = 1 or k = 0 for a noise-initialized run")

    @property
    def uses_arc(self) -> bool:
        return self.k > 0 and self.alpha < 1

    # ------------------------------------------------------------------ resolution
    def stage_budgets(self) -> list[int]:
        """Iterations per stage: explicit, or T split as evenly as possible over k + 1 stages."""
        if self.stage_iterations is not None:
            return list(self.stage_iterations)
        n = self.k + 1
        base, extra = divmod(self.iterations, n)
        return [base + (1 if s < extra else 0) for s in range(n)]

    def resolve(self, image_size: int, num_classes: int, hflip: bool = True, device_type: str = "cpu") -> "DistillConfig":
        """Return a copy with every dataset-dependent "auto" made explicit; checks fit to the dataset."""
        cfg = dataclasses.replace(self)
        if cfg.classes is not None and max(cfg.classes) >= num_classes:
            raise ConfigError(f"classes must be in [0, {num_classes - 1}] for this dataset, got {cfg.classes}")
        if cfg.jitter == "auto":
            cfg.jitter = 32 if image_size >= 128 else min(4, max(1, image_size // 8))
        if cfg.flip == "auto":
            cfg.flip = bool(hflip)
        if cfg.precision == "auto":
            cfg.precision = default_precision(device_type)
        if cfg.stage_iterations is None:
            cfg.stage_iterations = cfg.stage_budgets()
        if cfg.downsample_size == "default":
            # MRO as published: 200/224 at large resolutions, none on small data (FADRM.md section 4).
            cfg.downsample_size = int(round(image_size * 200 / 224)) if image_size >= 128 else None
        if isinstance(cfg.downsample_size, int) and cfg.downsample_size > image_size:
            raise ConfigError(f"downsample_size must be <= the image size {image_size}, got {cfg.downsample_size}")
        if cfg.stage_resolutions is not None:
            if cfg.stage_resolutions[-1] != image_size:
                raise ConfigError(f"stage_resolutions must end at the image size {image_size}, got {cfg.stage_resolutions}")
            if max(cfg.stage_resolutions) > image_size:
                raise ConfigError(f"stage_resolutions must be <= the image size {image_size}, got {cfg.stage_resolutions}")
        elif cfg.downsample_size != "auto":
            cfg.stage_resolutions = mro_resolutions(cfg.k, image_size, cfg.downsample_size)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch_crop_scale"] = list(self.patch_crop_scale)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DistillConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}")
        data = dict(data)
        if "patch_crop_scale" in data and isinstance(data["patch_crop_scale"], list):
            data["patch_crop_scale"] = tuple(data["patch_crop_scale"])
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def mro_resolutions(k: int, image_size: int, downsample_size: int | None) -> list[int]:
    """Stage resolutions: alternate D_ds and D so the last stage is at D (FADRM.md section 4:
    200, 224, 200, 224 for k = 3). No downsampling gives D for every stage."""
    if downsample_size is None or downsample_size == image_size:
        return [image_size] * (k + 1)
    return [image_size if (k - s) % 2 == 0 else downsample_size for s in range(k + 1)]


def tv_downsample_size(x01, image_size: int) -> int:
    """Adaptive D_ds from total variation (FADRM.md section 4, adaptive variants).

    TV is taken per pixel (the L1 sums divided by the number of differences) so the ratio is
    independent of the image size; the 128-px floor at 224 px scales with D.
    """
    dh = (x01[:, :, 1:, :] - x01[:, :, :-1, :]).abs().mean(dim=(1, 2, 3))
    dw = (x01[:, :, :, 1:] - x01[:, :, :, :-1]).abs().mean(dim=(1, 2, 3))
    tv = float((dh + dw).mean())
    shrink = min(0.8, 0.5 / max(tv, 1e-4))
    floor = max(1, math.ceil(image_size * 128 / 224))
    return min(image_size, max(int(math.floor(image_size * shrink)), floor))


def default_precision(device_type: str) -> str:
    """MPT (FADRM.md section 4): fp16 with a GradScaler on CUDA; bf16 on CPUs with native bf16."""
    if device_type == "cuda":
        return "fp16"
    try:
        import torch
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "bf16"
    except (AttributeError, RuntimeError):
        pass
    return "fp32"


# ---------------------------------------------------------------------- presets
# FADRM.md section 7: the baselines are settings of the same loop.
_NO_ARC = {"k": 0, "alpha": 1.0, "downsample_size": None, "precision": "fp32"}
PRESETS: dict[str, dict[str, Any]] = {
    "fadrm": {},
    "fadrm+": {},  # several teachers in round robin; the teachers come from the command line
    "sre2l": {**_NO_ARC, "init": "noise", "iterations": 1000},
    "cda": {**_NO_ARC, "init": "noise", "iterations": 4000, "crop_curriculum": True},
    "sre2l++": {**_NO_ARC, "iterations": 4000},
    "rded": {**_NO_ARC, "iterations": 0},
    "random-real": {**_NO_ARC, "iterations": 0, "patch_selection": "whole"},
}


def make_config(preset: str = "fadrm", config_file: str | Path | None = None,
                overrides: list[str] | dict[str, Any] | None = None) -> DistillConfig:
    """Preset defaults, then a YAML file, then key=value overrides (later wins)."""
    if preset not in PRESETS:
        raise ConfigError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    values: dict[str, Any] = {"preset": preset, **PRESETS[preset]}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of key: value")
        if "preset" in loaded and loaded["preset"] != preset:
            values = {"preset": loaded["preset"], **PRESETS.get(loaded["preset"], {})}
        values.update(loaded)
    if isinstance(overrides, dict):
        values.update(overrides)
    else:
        values.update(parse_overrides(overrides or []))
    if values.get("preset") not in PRESETS:
        raise ConfigError(f"preset must be one of {', '.join(PRESETS)}, got {values.get('preset')!r}")
    return DistillConfig.from_dict(values)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Parse `key=value` strings; values are read as YAML (so 0.5, [1, 2], null, auto work)."""
    out: dict[str, Any] = {}
    known = {f.name for f in fields(DistillConfig)}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value")
        if key not in known:
            raise ConfigError(f"unknown config key {key!r} in override {item!r}; known keys: {', '.join(sorted(known))}")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: cannot read value {raw!r} ({exc.__class__.__name__})") from None
    return out


# ---------------------------------------------------------------------- checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_at_least(name: str, value, low: int, extra: str = "") -> None:
    if not _is_int(value) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}{extra}, got {value!r}")


def _number_at_least(name: str, value, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
        raise ConfigError(f"{name} must be a number >= {low}, got {value!r}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a number > 0, got {value!r}")


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _pair(name: str, value) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{name} must be a pair [low, high], got {value!r}")
    return float(value[0]), float(value[1])
