"""Presets and recipes: named sets of DistillConfig values, and which recipe `auto` takes.

Presets (docs/method.md section 7) are the baselines and methods as settings of one loop;
recipes are the recover settings measured per kind of data (docs/benchmarks/accuracy.md), which
`DistillConfig.resolve` fills in where the config says `auto`. Plain data and the functions that
name a recipe for an image size and channel count; the settings model itself is config.py's.
"""
from __future__ import annotations

from typing import Any, NamedTuple

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
_RELEASED = {**_PUBLISHED_STEP, **_RDED_PATCHES, "patch_selection": "medium", "iterations": 2000, "mosaic": 1}
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
RECIPE_FIELDS = ("lr", "crop_scale_min", "patch_crop_scale", "patch_crops", "bound", "iterations", "patch_selection",
                 "mosaic")
_MEASURED_SMALL_GREY = {"lr": 0.01, "crop_scale_min": 0.5, "patch_crop_scale": (1.0, 1.0), "patch_crops": 1,
                        "bound": "sigmoid", "iterations": 500, "patch_selection": "spread", "mosaic": 1}


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
                     "patch_selection": "grouped", "iterations": 1000, "mosaic": 1},
                    "whole images picked by the teacher (`grouped`), a smaller step (lr 0.05), views of at least half "
                    "the image, T = 1000"),
    "gentle": Recipe({"lr": 0.01, "crop_scale_min": 0.5, "patch_crop_scale": (1.0, 1.0), "patch_crops": 1,
                      "bound": "sigmoid", "iterations": 300, "patch_selection": "whole", "mosaic": 1},
                     "a gentle recovery from random whole images (lr 0.01, T = 300, the sigmoid bound): it starts "
                     "from random real images and stays near them"),
    # One image per class carries four real views: RDED's stitched images (its factor 2) of random
    # whole images, recovered with the gentle step for four times as long. Measured at IPC 1 on
    # the colour sets here (docs/benchmarks/accuracy.md, "IPC 1: every candidate").
    "mosaic": Recipe({"lr": 0.01, "crop_scale_min": 0.5, "patch_crop_scale": (1.0, 1.0), "patch_crops": 1,
                      "bound": "sigmoid", "iterations": 1200, "patch_selection": "whole", "mosaic": 2},
                     "2 x 2 mosaics of random whole images (RDED's factor 2: four real views in each image), "
                     "recovered with the gentle step for longer (lr 0.01, T = 1200, the sigmoid bound); the best row at "
                     "IPC 1 on the colour sets measured (above random real images on pairs10, level on clipart10)"),
}


class PilotCandidates(NamedTuple):
    """What the pilot measures for runs up to an IPC, beside random real images and the size
    family's released recipe (`auto_recipe`, always first), and the recipe it keeps unless
    another is clearly above it (`pilot.choose`)."""

    up_to_ipc: int | None      # None: every larger IPC
    recipes: tuple[str, ...]
    safe: str


# By the IPC of the run, from the grids of docs/benchmarks/accuracy.md ("The pilot", "IPC 1: every
# candidate"): at IPC 1 the mosaics were the best row of the colour grids and the gentle recovery
# below random real images; from IPC 2 the candidates and the rule are those measured at IPC 10,
# where the gentle recovery was the best row of every grid (the mosaics were not measured there).
PILOT_CANDIDATES = (PilotCandidates(1, ("gentle", "mosaic"), "mosaic"),
                    PilotCandidates(None, ("crops-random", "whole", "gentle"), "gentle"))


def pilot_candidates(ipc: int) -> PilotCandidates:
    """What the pilot of a run at `ipc` images per class measures (PILOT_CANDIDATES)."""
    return next(c for c in PILOT_CANDIDATES if c.up_to_ipc is None or ipc <= c.up_to_ipc)
SMALL_IMAGE = 64     # below it: small-grey for one channel, cifar for more
LARGE_IMAGE = 128    # from it: imagenet (MRO and jitter 32 start here too)


def auto_recipe(image_size: int, channels: int) -> str:
    """The recipe "auto" takes for images of `image_size` px with `channels` channels: the
    measured one only where it was measured, else the released recipe of the size's family."""
    if image_size < SMALL_IMAGE:
        return "small-grey" if channels == 1 else "cifar"
    return "tiny-imagenet" if image_size < LARGE_IMAGE else "imagenet"


def recipe_reason(name: str, image_size: int | None = None, channels: int = 1, piloted: bool = False,
                  given: bool = False) -> str:
    """One line on a recipe: its name, whether it is auto's choice for images of `image_size` px
    with `channels` channels (when the size is given; `piloted`: chosen by the pilot on this
    data) or the user's (`given`: `--set recipe=NAME`), and where its values come from."""
    if name not in RECIPES:
        return "not recorded (the run was distilled before recipes were)"
    text = name
    images = f"{channels}-channel {image_size}-px images" if image_size is not None else None
    auto = auto_recipe(image_size, channels) if image_size is not None else None
    if given:
        text += ", as set" + (f" (auto takes {auto} for {images})" if images else "")
    elif piloted:
        text += ", auto's choice for this data by its pilot (fadrm_ray/pilot.py)"
    elif images is not None:
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
