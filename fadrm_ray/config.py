"""DistillConfig: every knob of a distillation run (docs/method.md sections 2-7), and its presets.

A config is validated when it is built (settings.py has the shared rules), so a bad value fails
before any work starts, with a message that names the field and the allowed range. Presets
are named sets of overrides of the defaults (docs/method.md section 7). `make_config` builds a
config in one pass from its layers: preset, YAML file, `key=value` overrides, then command-line
flags. What depends on the dataset (the recipe of the "auto" recover settings, stage budgets and
resolutions, jitter, flip, precision) is filled in by `resolve`, and the resolved config is what
every run saves beside its images.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Sequence

import yaml
from pydantic import Field, model_validator

from fadrm_ray.fileio import read_yaml_mapping
from fadrm_ray.settings import (AreaFraction, ConfigError, Count, Flag, Fraction, Index, Indices, ScaleRange, Settings,
                                Share, Weight, layered)


# ---------------------------------------------------------------------- presets
# docs/method.md section 7: the baselines are settings of the same loop.
_NO_ARC = {"k": 0, "alpha": 1.0, "downsample_size": None, "precision": "fp32"}
# The published recover step and crops, for the presets that must keep them at every size.
_PUBLISHED_STEP = {"lr": 0.25, "crop_scale_min": 0.08, "bound": "clamp"}
# Noise init uses no patches; the patch selection is fixed so that the saved config (and the run
# id) of a noise run does not follow the patch defaults.
_NOISE = {"init": "noise", "patch_selection": "easy"}
# RDED's patches: the best of 5 random crops of 0.5-1 of the image area per candidate, lowest CE first.
_RDED_PATCHES = {"patch_crop_scale": (0.5, 1.0), "patch_crops": 5, "patch_selection": "easy"}
# The released FADRM scripts' recover settings: lr 0.25, crops down to 8% of the image, the clamp,
# "medium" RDED patches, T = 2000 (docs/method.md section 7b).
_RELEASED = {**_PUBLISHED_STEP, **_RDED_PATCHES, "patch_selection": "medium", "iterations": 2000}
PRESETS: dict[str, dict[str, Any]] = {
    "fadrm": {},
    "fadrm+": {},  # several teachers in round robin; the teachers come from the command line
    # The released FADRM scripts' recover settings, with flips, at every image size and whatever
    # recipe "auto" would pick.
    "fadrm-paper": {**_RELEASED, "flip": True},
    "sre2l": {**_NO_ARC, **_PUBLISHED_STEP, **_NOISE, "iterations": 1000},
    "cda": {**_NO_ARC, **_PUBLISHED_STEP, **_NOISE, "iterations": 4000, "crop_curriculum": True},
    "sre2l++": {**_NO_ARC, "iterations": 4000},  # fadrm's loop and patches without ARC
    "rded": {**_NO_ARC, **_RDED_PATCHES, "iterations": 0},
    # A run's starting patches as a set of their own (the baseline of baselines.py): the run's
    # patch settings, which it sets, at zero recover iterations; stored as `patches-<hash>`.
    "patches": {**_NO_ARC, "iterations": 0},
    "random-real": {**_NO_ARC, "iterations": 0, "patch_selection": "whole"},
    # docs/method.md section 7c. G-VBSM (its released CIFAR-100 recover script): noise init,
    # several backbones in turn, BN + convolution statistics at one weight 0.01, lr 0.05, 4000
    # iterations, no ARC/MRO/MPT.
    "g-vbsm": {**_NO_ARC, **_NOISE, "lr": 0.05, "crop_scale_min": 0.08, "bound": "clamp", "iterations": 4000,
               "r_bn": 0.01, "r_conv": 0.01},
    # EDC (its released ImageNet recover script): RDED real-patch init, several backbones in turn,
    # BN + convolution statistics at weight 0.1, half of the BN loss against the batch's classes
    # (soft category-aware matching), lr 0.05, 1000 iterations, no ARC/MRO/MPT.
    "edc": {**_NO_ARC, **_RDED_PATCHES, "lr": 0.05, "crop_scale_min": 0.08, "bound": "clamp",
            "iterations": 1000, "r_bn": 0.1, "r_conv": 0.1, "bn_category": 0.5},
    # CV-DD (its released recover scripts): "medium" real patches, a committee voting with
    # softmax(test accuracy / 5) weights, lr 0.25, 4000 iterations, r_bn 0.01, no ARC/MRO/MPT.
    "cv-dd": {**_NO_ARC, **_PUBLISHED_STEP, **_RDED_PATCHES, "patch_selection": "medium", "iterations": 4000,
              "committee": "prior", "committee_temperature": 5.0},
}

# The recipes "auto" chooses from (docs/method.md section 7b): field -> value, for the fields that
# take their value from the dataset (RECIPE_FIELDS). Each recipe says where its values come from.
#
# small-grey: measured here (docs/benchmarks/accuracy.md, "Accuracy on small images") on the
# single-channel datasets below 64 px. There the released settings move the images far from their
# patches and train worse students than the patches themselves; smaller steps, larger crops and
# whole lowest-CE images keep recovered images at least as good as the real images they start
# from. Such data has many pixels at exactly 0 or 1, which a clamp lets drift (docs/method.md
# section 3); the sigmoid bound keeps them. At IPC 10 the ten most typical images of a class are
# alike and random ones train better students; at IPC 1 the most typical one does: `spread`
# takes that one first and then the most typical of small random groups.
#
# The released recipes: what the published FADRM scripts run for each family (lr 0.25, 4 stages
# of 500 iterations, crops down to 8% of the image, the clamp, "medium" RDED patches). Where
# nothing was measured here (colour images, or images of 64 px and more), the published evidence
# is the only evidence, so it decides. The families differ in what follows the image size in
# `resolve` (jitter 4 below 128 px and 32 from there, MRO 200/224 from 128 px), not in these fields.
RECIPE_FIELDS = ("lr", "crop_scale_min", "patch_crop_scale", "patch_crops", "bound", "iterations", "patch_selection")
_MEASURED_SMALL_GREY = {"lr": 0.01, "crop_scale_min": 0.5, "patch_crop_scale": (1.0, 1.0), "patch_crops": 1,
                        "bound": "sigmoid", "iterations": 500, "patch_selection": "spread"}


class Recipe(NamedTuple):
    values: dict[str, Any]
    source: str  # where the values come from


RECIPES: dict[str, Recipe] = {
    "small-grey": Recipe(_MEASURED_SMALL_GREY,
                         "measured on single-channel images below 64 px (docs/benchmarks/accuracy.md)"),
    "cifar": Recipe(_RELEASED, "the released FADRM scripts' CIFAR-10/100 recipe (32 px colour; no MRO), the paper's "
                    "evidence with ResNet-18 teachers on CIFAR; with a convnet-bn teacher on clipart10 at IPC 10 it "
                    "was level with random real images and with small-grey (docs/benchmarks/accuracy.md)"),
    "tiny-imagenet": Recipe(_RELEASED, "the released FADRM scripts' Tiny-ImageNet recipe (64 px; no MRO)"),
    "imagenet": Recipe(_RELEASED, "the released FADRM scripts' ImageNet recipe (224 px; MRO 200/224)"),
    # The pilot's other candidates on colour data no one measured (fadrm_ray/pilot.py), each one
    # step away from the released recipe along what the evidence says matters: who picks the
    # starting images, whole images or crops, and how far and how long recovery moves them.
    "crops-random": Recipe({**_RELEASED, "patch_selection": "random"},
                           "the released recipe with its crops drawn at random instead of picked by the teacher"),
    "whole": Recipe({**_RELEASED, "lr": 0.05, "crop_scale_min": 0.5, "patch_crop_scale": (1.0, 1.0), "patch_crops": 1,
                     "patch_selection": "grouped", "iterations": 1000},
                    "whole images picked by the teacher (`grouped`), a smaller step (lr 0.05), views of at least half "
                    "the image, T = 1000"),
    "gentle": Recipe({"lr": 0.01, "crop_scale_min": 0.5, "patch_crop_scale": (1.0, 1.0), "patch_crops": 1,
                      "bound": "sigmoid", "iterations": 300, "patch_selection": "whole"},
                     "a gentle recovery from random whole images (lr 0.01, T = 300, the sigmoid bound): it starts "
                     "from random real images and stays near them"),
}
# What the pilot tries on colour data no one measured, beside random real images; the released
# recipe of the images' size family (`auto_recipe`) is always the first.
PILOT_CANDIDATES = ("crops-random", "whole", "gentle")
SMALL_IMAGE = 64     # below it: small-grey for one channel, cifar for more
LARGE_IMAGE = 128    # from it: imagenet (MRO and jitter 32 start here too)


def auto_recipe(image_size: int, channels: int) -> str:
    """The recipe "auto" takes for images of `image_size` px with `channels` channels: the
    measured one only where it was measured, else the released recipe of the size's family."""
    if image_size < SMALL_IMAGE:
        return "small-grey" if channels == 1 else "cifar"
    return "tiny-imagenet" if image_size < LARGE_IMAGE else "imagenet"


def recipe_reason(name: str, image_size: int | None = None, channels: int = 1, piloted: bool = False) -> str:
    """One line on a recipe: its name, whether it is auto's choice for images of `image_size` px
    with `channels` channels (when the size is given; `piloted`: chosen by the pilot on this
    data), and where its values come from."""
    if name not in RECIPES:
        return "not recorded (the run was distilled before recipes were)"
    text = name
    if piloted:
        text += ", auto's choice for this data by its pilot (fadrm_ray/pilot.py)"
    elif image_size is not None:
        auto, images = auto_recipe(image_size, channels), f"{channels}-channel {image_size}-px images"
        text += f", auto's choice for {images}" if auto == name else f", set (auto takes {auto} for {images})"
    return f"{text}: {RECIPES[name].source}"


def recipe_to_try(name: str, image_size: int, channels: int) -> str:
    """What to try when a run of recipe `name` on `channels`-channel `image_size`-px images trains
    worse students than random real images: on colour images the gentle recipe (the whole one
    after it), on small grey ones the other measured recipe, and a sweep (tune/)."""
    sweep = "`fadrm tune` over lr, iterations, crop_scale_min and patch_selection"
    if channels > 1:  # the pilot's grid: on colour data where crops lose, the gentle recipe did not
        other = "whole" if name == "gentle" else "gentle"
        return f"try recipe {other} (`--set recipe={other}`, or overrides.recipe), or {sweep}"
    if image_size < SMALL_IMAGE:
        other = "cifar" if name == "small-grey" else "small-grey"
        return f"try recipe {other} (`--set recipe={other}`, or overrides.recipe), or {sweep}"
    return f"try {sweep}"


# Fields that change how fast a run goes but not its images (beyond float rounding).
SPEED_FIELDS = ("ipc_per_unit", "pack", "channels_last", "compile", "cuda_graphs")
# Left out of the run id: the speed fields, the IPC (a run grows or is read at any IPC) and the
# recipe (a record of where the "auto" values came from; the values themselves are in the id).
NOT_IN_IDENTITY = (*SPEED_FIELDS, "ipc", "recipe")
# Fields added after runs were stored, with the value that gives the images those runs have:
# at that value a field is left out of the run id (and of a saved config compared with an older
# one), so the older runs keep theirs. Runs below 64 px stored before the recipe was recorded
# took the small-grey values.
LATER_FIELDS = {"bound": "clamp", "patch_group": 4, "recipe": "small-grey",
                "r_conv": 0.0, "committee": "round-robin", "committee_temperature": 5.0,
                "bn_category": 0.0, "cuda_graphs": False}


def without_later_fields(values: dict[str, Any]) -> dict[str, Any]:
    """`values` less the LATER_FIELDS that hold the value of the runs stored before them."""
    return {k: v for k, v in values.items() if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}


def auto_values(image_size: int, channels: int) -> dict[str, Any]:
    """What the RECIPE_FIELDS resolve to for such images (`auto_recipe`)."""
    return dict(RECIPES[auto_recipe(image_size, channels)].values)


class DistillConfig(Settings):
    """Every knob of a distillation run; `resolve` fills in what depends on the dataset."""

    # What to distill.
    preset: Literal[tuple(PRESETS)] = "fadrm"
    ipc: Count = 10                      # images per class
    classes: Indices | None = None       # class indices to distill; None = every class
    seed: Index = 0

    # Initialization (docs/method.md section 2).
    init: Literal["real", "noise"] = "real"  # "real" patches or Gaussian "noise" (SRe2L, CDA)
    # easy = lowest teacher CE first; medium = middle of the ranking; random = random crops;
    # grouped = the lowest-CE image of each group of `patch_group` shuffled images (typical, yet as
    # varied as random ones); spread = the class's lowest-CE image first, then grouped;
    # whole = random whole images (random-real); auto = the recipe's (RECIPES)
    patch_selection: Literal["easy", "medium", "grouped", "spread", "random", "whole", "auto"] = "auto"
    # "auto" fields of RECIPE_FIELDS take their value from the recipe: `recipe`, or for "auto" the
    # one `auto_recipe` picks by the images' size and channels. The resolved config records it.
    recipe: Literal[("auto", *RECIPES)] = "auto"
    patch_crops: Count | Literal["auto"] = "auto"  # random square crops scored per candidate image
    patch_crop_scale: ScaleRange | Literal["auto"] = "auto"  # crop area as a fraction of the image
    patch_candidates: Index = 0          # candidate images scored per class; 0 = all of them
    patch_group: Count = 4               # images per group for patch_selection = grouped or spread

    # The optimization loop (docs/method.md section 3).
    iterations: Index | Literal["auto"] = "auto"  # T, over all stages
    lr: Annotated[float, Field(strict=True, gt=0, le=100)] | Literal["auto"] = "auto"
    r_bn: Weight = 0.01
    # G-VBSM, EDC (docs/method.md section 7c): weight of the convolution-statistics loss against
    # real-data targets (fadrm_ray/statistics.py); 0 = off.
    r_conv: Weight = 0.0
    # EDC's soft category-aware matching (statistics.ClassStatistics): the share of each BN
    # layer's loss taken against the real statistics of the batch's classes instead of the
    # layer's running statistics; 0 = off.
    bn_category: Share = 0.0
    # How several teachers share the steps: "round-robin" (one per step, FADRM+, G-VBSM) or
    # "prior" (CV-DD: all of them every step, weighted by softmax(test accuracy / temperature)).
    committee: Literal["round-robin", "prior"] = "round-robin"
    committee_temperature: Annotated[float, Field(strict=True, gt=0, le=1e4)] = 5.0
    first_bn_weight: Weight = 10.0
    # Roll offset bound in pixels; auto = 32 at >= 128 px, else D // 8 capped at 4.
    jitter: Index | Literal["auto"] = "auto"
    flip: Flag | Literal["auto"] = "auto"  # auto = the dataset says whether a flip keeps the label
    crop_scale_min: AreaFraction | Literal["auto"] = "auto"  # RandomResizedCrop lower scale bound
    crop_curriculum: Flag = False        # CDA: the lower bound anneals 1.0 -> crop_scale_min by cosine

    # Stages, ARC, MRO, MPT (docs/method.md section 4).
    k: Index = 3                         # number of ARC merges; k + 1 stages
    alpha: Fraction = 0.5                # x <- alpha * x + (1 - alpha) * P at each merge
    stage_iterations: list[Index] | None = None  # explicit budgets (k + 1 of them, summing to iterations)
    # D_ds: an integer, "auto" (TV-based), "default" (200/224 of D when D >= 128, else no MRO),
    # or None (no MRO).
    downsample_size: Count | Literal["auto", "default"] | None = "default"
    stage_resolutions: list[Count] | None = None  # explicit R_s per stage; the last must be D
    # "converged": end a stage early once CE and BN losses are small.
    arc_timing: Literal["fixed", "converged"] = "fixed"
    arc_ce_threshold: Annotated[float, Field(strict=True, ge=0)] = 0.01  # finite (Settings)
    arc_bn_threshold: Annotated[float, Field(strict=True, ge=0)] = 60.0
    # How images stay in [0, 1]: "clamp" after every step (as published), or "sigmoid": optimize
    # the logits of the pixels, so a pixel at 0 or 1 moves only when its gradient keeps pushing.
    bound: Literal["auto", "clamp", "sigmoid"] = "auto"
    # auto = bf16 on a CPU that has it, fp16 + GradScaler on CUDA.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"

    # Scheduling: which classes share a batch (this one changes the images: BatchNorm statistics
    # and the augmentation seed are per batch).
    classes_per_batch: Index = 100       # classes in one batch (one image per class; 100 as published); 0 = all

    # Speed only: how fast the loop runs, not what it computes (beyond float rounding). These
    # are left out of the run id (`identity`), so changing one resumes the same run.
    # auto = from the device, the workers, the image size and the IPC (fadrm_ray/packing.py).
    ipc_per_unit: Count | Literal["auto"] = "auto"  # IPC indices in one unit of work
    pack: Count | Literal["auto"] = "auto"          # IPC batches optimized together in one forward/backward
    channels_last: Flag = True           # channels-last activations (faster convs and pooling on CPU)
    compile: Flag = False                # torch.compile the teacher's loss (compiled once per input shape)
    # With compile on CUDA: replay the compiled forward and backward as CUDA graphs (torch.compile's
    # "reduce-overhead" mode), which removes the launch cost of every kernel; ignored on a CPU.
    cuda_graphs: Flag = False

    @model_validator(mode="after")
    def _fits_together(self) -> "DistillConfig":
        for name in ("stage_iterations", "stage_resolutions"):
            values = getattr(self, name)
            if values is not None and len(values) != self.k + 1:
                raise ValueError(f"{name} must have k + 1 = {self.k + 1} entries, got {len(values)}")
        if self.stage_iterations is not None and self.iterations != "auto" and \
                sum(self.stage_iterations) != self.iterations:
            raise ValueError(f"stage_iterations must sum to iterations = {self.iterations}, "
                             f"got {sum(self.stage_iterations)}")
        if self.init == "noise" and self.uses_arc:
            raise ValueError("alpha < 1 with k > 0 (ARC) merges back to real patches, so it needs init = real, "
                             "not noise; set alpha = 1 or k = 0 for a noise-initialized run")
        return self

    @property
    def uses_arc(self) -> bool:
        return self.k > 0 and self.alpha < 1

    def identity(self) -> dict[str, Any]:
        """The settings that decide the pixels of an image: every field but the speed-only ones
        and `ipc`. An image depends on its class set, its IPC index, the seed and these settings,
        not on how many images were asked for (docs/method.md section 2), so one run holds every
        IPC of the same settings: a larger IPC adds images to it, a smaller one reads a prefix."""
        return without_later_fields({k: v for k, v in self.to_dict().items() if k not in NOT_IN_IDENTITY})

    # ------------------------------------------------------------------ resolution
    def stage_budgets(self) -> list[int]:
        """Iterations per stage: explicit, or T split as evenly as possible over k + 1 stages."""
        if self.stage_iterations is not None:
            return list(self.stage_iterations)
        n = self.k + 1
        base, extra = divmod(self.iterations, n)
        return [base + (1 if s < extra else 0) for s in range(n)]

    def recipe_for(self, image_size: int, channels: int) -> str:
        """The recipe this config takes its "auto" values from for such images."""
        return auto_recipe(image_size, channels) if self.recipe == "auto" else self.recipe

    def sized(self, image_size: int, channels: int) -> "DistillConfig":
        """This config with the recipe's "auto" values (RECIPE_FIELDS) made explicit, and the
        recipe recorded."""
        name = self.recipe_for(image_size, channels)
        changes = {k: v for k, v in RECIPES[name].values.items() if getattr(self, k) == "auto"}
        if "iterations" in changes and self.stage_iterations is not None:
            changes["iterations"] = sum(self.stage_iterations)  # explicit stage budgets decide T
        if self.recipe != name:
            changes["recipe"] = name
        return self.model_copy(update=changes) if changes else self

    def resolve(self, image_size: int, num_classes: int, hflip: bool = True, device_type: str = "cpu", *,
                channels: int) -> "DistillConfig":
        """A new config with every dataset-dependent "auto" made explicit; checks fit to the dataset.
        `channels` picks the recipe with the size (`auto_recipe`)."""
        if self.classes is not None and max(self.classes) >= num_classes:
            raise ConfigError(f"classes must be in [0, {num_classes - 1}] for this dataset, got {self.classes}",
                              ("classes",))
        downsample = self.downsample_size
        if downsample == "default":
            # MRO as published: 200/224 at large resolutions, none on small data (docs/method.md section 4).
            downsample = int(round(image_size * 200 / 224)) if image_size >= LARGE_IMAGE else None
        if isinstance(downsample, int) and downsample > image_size:
            raise ConfigError(f"downsample_size must be <= the image size {image_size}, got {downsample}",
                              ("downsample_size",))
        resolutions = self.stage_resolutions
        if resolutions is not None:
            if resolutions[-1] != image_size:
                raise ConfigError(f"stage_resolutions must end at the image size {image_size}, got {resolutions}",
                                  ("stage_resolutions",))
            if max(resolutions) > image_size:
                raise ConfigError(f"stage_resolutions must be <= the image size {image_size}, got {resolutions}",
                                  ("stage_resolutions",))
        elif downsample != "auto":
            resolutions = mro_resolutions(self.k, image_size, downsample)
        jitter = self.jitter
        if jitter == "auto":
            jitter = 32 if image_size >= LARGE_IMAGE else min(4, max(1, image_size // 8))
        sized = self.sized(image_size, channels)
        changes = {
            **sized.model_dump(include={*RECIPE_FIELDS, "recipe"}),
            "jitter": jitter,
            "flip": bool(hflip) if self.flip == "auto" else self.flip,
            "precision": default_precision(device_type) if self.precision == "auto" else self.precision,
            "stage_iterations": sized.stage_budgets(),
            "downsample_size": downsample,
            "stage_resolutions": resolutions,
        }
        return DistillConfig.model_validate(self.model_copy(update=changes).model_dump())

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DistillConfig":
        return cls.model_validate(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def make_config(preset: str = "fadrm", config_file: str | Path | None = None,
                overrides: list[str] | dict[str, Any] | None = None, **flags: Any) -> DistillConfig:
    """One config from its layers, later wins: the preset's defaults, a YAML file, key=value
    overrides, then `flags` (e.g. ipc=, classes=, seed= from the command line; None = not given).
    The layers are merged into one mapping and validated once."""
    values: dict[str, Any] = {"preset": preset, **PRESETS.get(preset, {})}
    if config_file is not None:
        loaded = read_yaml_mapping(config_file, f"config file {config_file}", ConfigError)
        if "preset" in loaded and loaded["preset"] != preset:  # the file names its own preset: start from it
            values = {"preset": loaded["preset"], **PRESETS.get(loaded["preset"], {})}
        values.update(loaded)
    if not isinstance(overrides, dict):
        overrides = parse_overrides(overrides or [])
    return layered(DistillConfig, values, overrides, flags=flags)


def parse_overrides(items: Sequence[str], model: type[Settings] = DistillConfig) -> dict[str, Any]:
    """Parse `key=value` strings for `model`; values are read as YAML (so 0.5, [1, 2], null, auto work)."""
    out: dict[str, Any] = {}
    known = model.model_fields
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


def mro_resolutions(k: int, image_size: int, downsample_size: int | None) -> list[int]:
    """Stage resolutions: alternate D_ds and D so the last stage is at D (docs/method.md section 4:
    200, 224, 200, 224 for k = 3). No downsampling gives D for every stage."""
    if downsample_size is None or downsample_size == image_size:
        return [image_size] * (k + 1)
    return [image_size if (k - s) % 2 == 0 else downsample_size for s in range(k + 1)]


def tv_downsample_size(x01, image_size: int) -> int:
    """Adaptive D_ds from total variation (docs/method.md section 4, adaptive variants).

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
    """MPT (docs/method.md section 4): fp16 with a GradScaler on CUDA; bf16 on CPUs with native bf16."""
    if device_type == "cuda":
        return "fp16"
    try:
        import torch
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "bf16"
    except (AttributeError, RuntimeError):
        pass
    return "fp32"
