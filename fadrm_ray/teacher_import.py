"""A classifier trained elsewhere made into a teacher: `fadrm import-teacher`, `import_teacher()`.

The weights come from torchvision (`torchvision:NAME` with a weights enum member such as
`IMAGENET1K_V1`, taken from torch hub's cache or downloaded where a network exists, or a file),
timm (`timm:NAME` with a `.pth`/`.bin`/`.safetensors` file, or `pretrained` for the Hugging Face
cache) or a plain state dict for a model this project builds (`resnet18-cifar`, `convnet-bn`),
found by teacher_weights.py. Files are read weights-only (timm's loader: safetensors, or
`torch.load(weights_only=True)`; a wrapping `state_dict`/`model` key and a `module.` prefix are
taken off).

The teacher takes the dataset's class order (ImageNet's sorted WordNet ids are torchvision's and
timm's index order) and its image size; the weights must have one output per class. Its
normalization comes from `--mean/--std`, else from the weights' own metadata (a torchvision
weights enum member, found by name or by its published file name; timm's `pretrained` weights),
else it is measured: the test top-1 under each candidate (ImageNet's mean/std, which torchvision
and timm users train with, and timm's default config where it differs, for those
architectures; the dataset's own statistics) and the best kept, every figure printed and
recorded (`ImportRecord.measured`), with a warning where they differ by more than two binomial
standard errors. The checkpoint says which and why (`ImportRecord`). Every phase then normalizes images for it with that mean/std
(`models.teacher_view`). The teacher's top-1 is measured on the dataset's test split (all of
it, or `eval_images` spread evenly over the classes) and recorded; a teacher no better than
chance (the sign of a class order or normalization that does not fit) is refused and nothing
is written.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from fadrm_ray.data import dataset_notes, get_dataset
from fadrm_ray.data.base import ImageDataset, Split
from fadrm_ray.fileio import check_new_output
from fadrm_ray.runtime import resolve_device
from fadrm_ray.teacher_weights import FoundWeights, find_weights, timm_meta
from fadrm_ray.models import (ModelError, create_model,
                              save_teacher, teacher_view)
from fadrm_ray.teacher_record import ImportRecord, NormalizationCandidate, TeacherRecord

# A teacher is refused when its top-1 is within this many binomial standard deviations of chance.
CHANCE_SIGMAS = 3.0


class ImportSettings(BaseModel):
    """What `import_teacher` is asked: validated once, recorded in the result."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), allow_inf_nan=False)
    model: str = Field(min_length=1)          # torchvision:NAME, timm:NAME, convnet-bn, resnet18-cifar
    weights: str = Field(min_length=1)        # a file, a torchvision weights name, or `pretrained` (timm)
    dataset: str = Field(min_length=1)        # a dataset spec (fadrm_ray.data.get_dataset)
    out: str = Field(min_length=1)            # the checkpoint to write (a new file)
    eval_images: int | None = Field(default=None, ge=1)   # None: the whole test split
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    accept_chance: bool = False               # write a teacher at chance level all the same
    # The dataset class of each of the weights' outputs, in output order (class names or indices):
    # weights trained with another class order are reordered to the dataset's.
    class_order: tuple[str, ...] | None = None
    device: str | None = None
    data_root: str | None = None


class ImportResult(BaseModel):
    """What an import wrote and measured."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())
    path: str
    sha256: str
    model: str
    dataset: str
    num_classes: int
    image_size: int
    top1: float                 # percent, on `eval_images` test images
    chance: float               # percent
    bar: float                  # the top-1 a teacher must exceed
    record: ImportRecord
    mean: tuple[float, ...]
    std: tuple[float, ...]
    seconds: float
    warnings: list[str] = []
    split_note: str | None = None  # where the test split was made here (ImageDataset.split_note)
    notes: list[str] = []          # what opening the dataset left out or converted (data.dataset_notes)


# --------------------------------------------------------------------------- model
def _first_conv_in_chans(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> int | None:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d):
            weight = state.get(f"{name}.weight")
            return int(weight.shape[1]) if weight is not None and weight.dim() == 4 else None
    return None


def _classifier(model: torch.nn.Module) -> str | None:
    """The name of the model's last Linear layer (its classifier)."""
    name = None
    for qualname, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            name = qualname
    return name


def build_model(model_name: str, weights: FoundWeights, dataset: ImageDataset,
                model_kwargs: dict[str, Any]) -> tuple[torch.nn.Module, int]:
    """The model `model_name` with `weights` loaded (strict), for `dataset`'s classes: (model, in_chans)."""
    state = weights.state_dict
    probe = create_model(model_name, dataset.num_classes, in_chans=3, image_size=dataset.image_size, **model_kwargs)
    in_chans = _first_conv_in_chans(probe, state) or 3
    head = _classifier(probe)
    if head is not None and f"{head}.weight" in state:
        classes = int(state[f"{head}.weight"].shape[0])
        if classes != dataset.num_classes:
            raise ModelError(f"the weights have {classes} classes ({head}.weight), dataset {dataset.name} has "
                             f"{dataset.num_classes}; a teacher needs one output per class of the dataset")
    model = probe if in_chans == 3 else create_model(model_name, dataset.num_classes, in_chans=in_chans,
                                                     image_size=dataset.image_size, **model_kwargs)
    try:
        outcome = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else (lines[0] if lines else "")
        raise ModelError(f"the weights ({weights.described}) do not fit {model_name}: {detail[:300]}") from None
    if outcome.missing_keys or outcome.unexpected_keys:
        def some(keys: list[str]) -> str:
            return (", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")) or "none"

        raise ModelError(f"the weights ({weights.described}) do not fit {model_name}: "
                         f"{len(outcome.missing_keys)} of its tensors missing: {some(outcome.missing_keys)}; "
                         f"{len(outcome.unexpected_keys)} unknown to it: {some(outcome.unexpected_keys)}")
    return model.eval().requires_grad_(False), in_chans


# --------------------------------------------------------------------------- class order
# A class is taken for another where at least this share of its test images (and MIN_SWAPPED of
# them) is predicted as that one other class.
SWAPPED_SHARE = 0.5
MIN_SWAPPED = 3


def reorder_outputs(model: torch.nn.Module, dataset: ImageDataset, class_order: Sequence[str] | None,
                    categories: list[str] | None, categories_from: str | None = None) -> str | None:
    """Reorder the classifier's outputs to the dataset's class order, where `class_order` names the
    dataset class of each output (names or indices), or where the weights' own categories (from
    `categories_from`, where said) are the dataset's class names in another order; one line
    saying so, or None where nothing moved."""
    names = [str(n) for n in dataset.class_names]
    if class_order is not None:
        if len(class_order) != len(names):
            raise ModelError(f"--class-order names {len(class_order)} classes, dataset {dataset.name} has {len(names)}")
        order = [_class_index(entry, names) for entry in class_order]
        if sorted(order) != list(range(len(names))):
            raise ModelError("--class-order must name every class of the dataset once")
        said = "--class-order"
    elif categories is not None and sorted(categories) == sorted(names) and list(categories) != names:
        order = [names.index(c) for c in categories]
        said = f"the class names in {categories_from}" if categories_from else "the weights' own category names"
    else:
        return None
    if order == list(range(len(names))):
        return None
    head = _classifier(model)
    if head is None:
        raise ModelError("the model has no Linear classifier whose outputs could be reordered")
    layer = model.get_submodule(head)
    output_of = [order.index(c) for c in range(len(names))]  # the weights' output of each dataset class
    with torch.no_grad():
        layer.weight.copy_(layer.weight[output_of].clone())
        if layer.bias is not None:
            layer.bias.copy_(layer.bias[output_of].clone())
    moved = sum(1 for c, o in enumerate(output_of) if c != o)
    return f"the weights' outputs were reordered to the dataset's class order by {said} ({moved} classes moved)"


def _class_index(entry: str, names: list[str]) -> int:
    if entry in names:
        return names.index(entry)
    if entry.strip().isdigit() and int(entry) < len(names):
        return int(entry)
    raise ModelError(f"--class-order: {entry!r} is neither a class name of the dataset nor a class index")


@torch.no_grad()
def class_confusion(model: torch.nn.Module, split: Split, view: ImageDataset, batch_size: int = 256) -> torch.Tensor:
    """(K, K) counts: row = the image's class, column = the predicted class (its trace over the
    images is the top-1: one pass gives both)."""
    from fadrm_ray.data.parallel import prefetch
    from fadrm_ray.models import match_channels, model_in_chans

    k = view.num_classes
    counts = torch.zeros(k, k, dtype=torch.long)
    device = next(model.parameters()).device
    in_chans = model_in_chans(model, view.channels)
    for idx, images in prefetch(split.load, torch.arange(len(split)).split(batch_size)):
        pred = model(match_channels(view.normalize(images), in_chans).to(device)).argmax(dim=1).cpu()
        counts.index_put_((split.labels[idx], pred), torch.ones_like(pred), accumulate=True)
    return counts


def check_class_order(counts: torch.Tensor, dataset: ImageDataset) -> None:
    """Refuse weights that take whole classes for one another (the weights' class order is not the
    dataset's), from their confusion counts on test images (`class_confusion`): naming each pair,
    and how to give the order."""
    names = [str(n) for n in dataset.class_names]
    taken = {}
    for c in range(len(names)):
        total = int(counts[c].sum())
        other = counts[c].clone()
        other[c] = -1
        d = int(other.argmax())
        if total and int(counts[c, d]) >= max(MIN_SWAPPED, SWAPPED_SHARE * total) and counts[c, d] > counts[c, c]:
            taken[c] = (d, int(counts[c, d]), total)
    # Classes in a cycle of such takings: a permutation of the class order, not a weak teacher.
    swapped = []
    for c in taken:
        seen, d = [c], taken[c][0]
        while d in taken and d not in seen:
            seen.append(d)
            d = taken[d][0]
        if d == c and min(seen) == c:
            swapped.append(seen)
    if not swapped:
        return
    pairs = "; ".join(", ".join(f"'{names[c]}' predicted as '{names[taken[c][0]]}' for {taken[c][1]} of its "
                                f"{taken[c][2]} test images" for c in cycle) for cycle in swapped)
    raise ModelError(f"the weights take whole classes for one another: {pairs}. Their class order is not the "
                     f"dataset's ({dataset.name} sorts its classes: {', '.join(names[:6])}"
                     f"{', ...' if len(names) > 6 else ''}); give the class of each of the weights' outputs in "
                     f"order with --class-order NAME,NAME,... (or indices); nothing written")


# --------------------------------------------------------------------------- measure
def spread_sample(split: Split, num_classes: int, count: int | None) -> Split:
    """`count` images of `split` spread evenly over its classes (evenly spaced within each), or all of it."""
    if count is None or count >= len(split):
        return split
    per_class = max(1, math.ceil(count / num_classes))
    keep = []
    for label in range(num_classes):
        idx = split.indices_of_class(label)
        if idx.numel():
            take = min(per_class, idx.numel())
            keep.append(idx[torch.linspace(0, idx.numel() - 1, take).round().long().unique()])
    return split.subset(torch.sort(torch.cat(keep)).values, f"spread{count}")


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def normalization_candidates(model: str, dataset: ImageDataset) -> list[tuple[str, tuple, tuple]]:
    """What an import measures where nothing says the normalization: for a torchvision or timm
    architecture ImageNet's mean/std (and timm's default config where it differs), then the
    dataset's own statistics; the first wins a tie."""
    prefix, sep, arch = model.partition(":")
    out = []
    if sep and prefix in ("torchvision", "timm"):
        out.append(("ImageNet's mean/std", IMAGENET_MEAN, IMAGENET_STD))
        timm_default = timm_meta(arch) if prefix == "timm" else {}  # what timm's training scripts use
        if timm_default and (timm_default["mean"], timm_default["std"]) != (IMAGENET_MEAN, IMAGENET_STD):
            out.append((f"timm's default config for {arch}", timm_default["mean"], timm_default["std"]))
    out.append((f"the dataset's own statistics ({dataset.name})", tuple(dataset.mean), tuple(dataset.std)))
    return out


def _for_channels(mean: tuple, std: tuple, channels: int) -> tuple[tuple, tuple]:
    """Three-channel constants averaged for grey images (which an RGB model sees repeated)."""
    if len(mean) == 3 and channels == 1:
        return (sum(mean) / 3,), (sum(std) / 3,)
    return tuple(mean), tuple(std)


def binomial_se(top1: float, count: int) -> float:
    """The standard error, in points, of a top-1 of `top1` percent measured on `count` images."""
    p = min(max(top1 / 100.0, 1.0 / max(count, 1)), 1 - 1.0 / max(count, 1))
    return 100.0 * math.sqrt(p * (1 - p) / max(count, 1))


def chance_bar(num_classes: int, count: int) -> tuple[float, float]:
    """Chance top-1 and the top-1 a teacher must exceed (CHANCE_SIGMAS binomial deviations above it), percent."""
    p = 1.0 / num_classes
    return 100.0 * p, 100.0 * (p + CHANCE_SIGMAS * math.sqrt(p * (1 - p) / max(1, count)))


def import_teacher(settings: ImportSettings) -> ImportResult:
    """Wrap `settings.weights` into a teacher checkpoint for `settings.dataset` at `settings.out`
    (a new file), after measuring its top-1; ModelError (nothing written) when it cannot be."""
    started = time.perf_counter()
    out = check_new_output(settings.out, "--out")
    if (settings.mean is None) != (settings.std is None):
        raise ModelError("--mean and --std go together: give both or neither")
    dataset = get_dataset(settings.dataset, root=settings.data_root)
    if settings.mean is not None and len(settings.mean) != len(settings.std):
        raise ModelError(f"--mean has {len(settings.mean)} values, --std {len(settings.std)}: one each per channel")
    if settings.std is not None and min(settings.std) <= 0:
        raise ModelError("--std values must be positive")
    weights = find_weights(settings.model, settings.weights)
    model, in_chans = build_model(settings.model, weights, dataset, dict(settings.model_kwargs))
    if settings.mean is not None:
        candidates = [("flags", settings.mean, settings.std)]
    elif weights.mean is not None:
        candidates = [(f"the weights' metadata ({weights.meta_from})", weights.mean, weights.std)]
    else:
        candidates = normalization_candidates(settings.model, dataset)
    if settings.mean is None:  # RGB constants for grey images
        candidates = [(name + (", averaged over its 3 channels for grey images" if len(mean) != dataset.channels
                               and dataset.channels == 1 else ""), *_for_channels(mean, std, dataset.channels))
                      for name, mean, std in candidates]
    for name, mean, std in candidates:
        if len(mean) != dataset.channels:
            raise ModelError(f"the normalization ({name}) has {len(mean)} channels, dataset {dataset.name} has "
                             f"{dataset.channels}; pass --mean and --std with {dataset.channels} value(s)")
    categories = weights.categories if weights.categories and len(weights.categories) == dataset.num_classes else None
    order_note = reorder_outputs(model, dataset, settings.class_order, categories, weights.categories_from)
    device = resolve_device(settings.device)
    model.to(device)
    test = spread_sample(dataset.test, dataset.num_classes, settings.eval_images)
    if len(test) == 0:
        raise ModelError(f"dataset {dataset.name} has no test images to measure the teacher on")
    chance, bar = chance_bar(dataset.num_classes, len(test))

    def teacher_info(mean, std, record) -> TeacherRecord:
        return TeacherRecord(model_name=settings.model, model_kwargs=dict(settings.model_kwargs),
                             num_classes=dataset.num_classes, in_chans=in_chans, image_size=dataset.image_size,
                             mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std),
                             class_names=list(dataset.class_names), dataset=dataset.name,
                             dataset_fingerprint=dataset.fingerprint(), imported=record)

    base = ImportRecord(source=weights.described, weights_sha256=weights.weights_sha256, normalization="",
                        trained_size=weights.trained_size, eval_images=len(test), chance=round(chance, 4),
                        display_names=categories)
    measured, confusion = [], {}
    model.eval()
    for name, mean, std in candidates:
        # One pass over the test images per normalization: its confusion counts give the top-1 and,
        # for the one kept, the class-order check.
        view = teacher_view(dataset, [teacher_info(mean, std, base)])
        confusion[name] = counts = class_confusion(model, test, view, batch_size=256 if device == "cpu" else 512)
        top1 = 100.0 * int(counts.diagonal().sum()) / len(test)
        measured.append(NormalizationCandidate(name=name, mean=mean, std=std, top1=round(float(top1), 4)))
    kept = max(measured, key=lambda c: c.top1)  # the first of equals: candidates are in order of preference
    warnings = []
    if len(measured) == 1:
        norm_from = kept.name
        measured = []
    else:
        norm_from = f"measured: {kept.name} gave the best test top-1 (no --mean/--std, no metadata in the weights)"
        measured = [kept] + [c for c in measured if c is not kept]
        worst = min(measured, key=lambda c: c.top1)
        if kept.top1 - worst.top1 > 2 * binomial_se(kept.top1, len(test)):
            warnings.append(f"the normalization matters for these weights: {kept.name} gives {kept.top1:.2f}%, "
                            f"{worst.name} {worst.top1:.2f}% (more than two standard errors apart on {len(test)} "
                            f"images); kept the better. Pass --mean/--std if you know what the weights were trained "
                            f"with")
    record = base.model_copy(update={"normalization": norm_from, "measured": measured})
    info = teacher_info(kept.mean, kept.std, record)
    top1 = kept.top1
    if top1 <= bar and not settings.accept_chance:
        raise ModelError(f"the teacher's top-1 on {len(test)} test images of {dataset.name} is {top1:.2f}% (chance "
                         f"{chance:.2f}%, a teacher must exceed {bar:.2f}%): the weights' class order or "
                         f"normalization does not fit the dataset; nothing written (--accept-chance writes it "
                         f"anyway)")
    if not settings.accept_chance:
        check_class_order(confusion[kept.name], dataset)
    if order_note:
        warnings.insert(0, order_note)
    info = save_teacher(out, model.cpu(), info.model_copy(update={"test_accuracy": round(float(top1), 4)}),
                        replace=False)
    return ImportResult(path=str(Path(out).resolve()), sha256=info.sha256, model=settings.model, dataset=dataset.name,
                        num_classes=dataset.num_classes, image_size=dataset.image_size, top1=round(float(top1), 4),
                        chance=round(chance, 4), bar=round(bar, 4), record=record, mean=info.mean, std=info.std,
                        seconds=round(time.perf_counter() - started, 2), warnings=warnings,
                        split_note=dataset.split_note(imported_teachers=True), notes=dataset_notes(dataset))
