"""The settings models of every phase, in one place: `DistillConfig` (every knob of a
distillation run, docs/method.md sections 2-7), `EvalConfig` (how students are trained and
scored, section 6), `SqueezeConfig` (teacher training), `PilotConfig` (the pilot of `auto`,
section 7b) and `LabelStorage` (stored soft labels). What they share (the base model, value
types, error lines) is settings.py's; the presets and recipes a config is built from are
recipes.py's.

A config is validated when it is built, so a bad value fails before any work starts, with a
message that names the field and the allowed range. `make_config` builds a distillation config
in one pass from its layers: preset, YAML file, `key=value` overrides, then command-line flags.
What depends on the dataset (the recipe of the "auto" recover settings, stage budgets and
resolutions, jitter, flip, precision) is filled in by `resolve`, and the resolved config is what
every run saves beside its images.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Sequence

import yaml
from annotated_types import MinLen
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fadrm_ray.fileio import read_yaml_mapping
from fadrm_ray.recipes import LARGE_IMAGE, PRESETS, RECIPE_FIELDS, RECIPES, auto_recipe
from fadrm_ray.settings import (AreaFraction, ConfigError, Count, EvalConfigError, Flag, Fraction, Index, Indices,
                                ScaleRange, Settings, Share, Weight, layered)


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
                "bn_category": 0.0, "cuda_graphs": False, "mosaic": 1}
# The largest mosaic factor, and the smallest cell side it may leave (patches.class_patch_images).
MAX_MOSAIC, MIN_MOSAIC_CELL = 8, 4


def without_later_fields(values: dict[str, Any]) -> dict[str, Any]:
    """`values` less the LATER_FIELDS that hold the value of the runs stored before them."""
    return {k: v for k, v in values.items() if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}


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
    # RDED's stitched images: each image an f x f grid of the class's next f * f patches in the
    # selection's order, each resized (antialiased) to a cell of about D / f; 1 = one patch per
    # image; auto = the recipe's (docs/method.md section 2).
    mosaic: Annotated[int, Field(strict=True, ge=1, le=MAX_MOSAIC)] | Literal["auto"] = "auto"

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
        if image_size // sized.mosaic < MIN_MOSAIC_CELL:
            raise ConfigError(f"mosaic {sized.mosaic} would cut {image_size}-px images into cells of "
                              f"{image_size // sized.mosaic} px; at most {image_size // MIN_MOSAIC_CELL} here "
                              f"(cells of at least {MIN_MOSAIC_CELL} px)", ("mosaic",))
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


# --------------------------------------------------------------------------- evaluate and squeeze
# EvalConfig fields added after evaluations were cached, with the value those evaluations had.
EVAL_LATER_FIELDS = {"teacher_bn": "running", "soft_label_topk": None, "soft_label_epochs": None,
                     "reference_steps": 5000}


class LabelStorage(BaseModel):
    """How stored soft labels are kept (evaluation/soft_labels.py): the logits' number type, the k
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
    """How students are trained on distilled images and scored (evaluation/training.py, docs/method.md section 6)."""

    error_class: ClassVar[type[ConfigError]] = EvalConfigError

    student: str = Field("convnet-bn", strict=True, min_length=1)   # model name (models.create_model)
    student_kwargs: dict[str, Any] = {}
    # How epochs and the cosine stretch are chosen when they are left unset (training.resolve_protocol):
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
    # classes) and only this many epochs, read in turn (evaluation/soft_labels.py); None: all.
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
    # The user's bound in seconds (--pilot-budget): in place of the two above; 0 skips the pilot.
    # Not part of what a cached pilot is matched on: it bounds the measuring, not what is measured.
    budget: float | None = Field(None, strict=False, ge=0)
