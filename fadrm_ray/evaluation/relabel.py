"""Relabel: soft labels from the frozen teacher(s) on the exact view the student sees.

docs/method.md section 6: every student step sees a batch of distilled images under a
random-resized crop (scale 0.08-1), a horizontal flip (only where the dataset says a flip keeps
the label) and CutMix with lambda ~ Beta(1, 1); its target is the teacher's logits on that same
augmented, mixed batch. Several teachers (FADRM+, section 5) average their logits.

A `ViewPlan` is everything random about one step (which images, each crop box and flip, the
CutMix partner of every slot and the box). `apply_plan` turns a plan into pixels, so the two
sources of soft labels share one code path and cannot drift apart:

- `OnlineSoftLabels` (the default) draws the plan and runs the teachers on every step;
  nothing is stored.

The distilled set is held as it is, uint8 (on the teachers' device), and only the pixels of each
step's views are converted to [0, 1] floats: a float copy of the whole set would take 4x its
bytes per student process (30 GB at ImageNet-1K IPC 50, 224 px). The conversion is per element,
so the views are the same floats as those cut from a converted set.
- the stored source (evaluation/soft_labels.py) writes the plans and logits of E epochs to Parquet
  and rebuilds the same views from them with `apply_plan`.

Each epoch's plan comes from its own generator, seeded from (seed, epoch), so an epoch can be
recomputed or read back on its own, in any order.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fadrm_ray.augment import crop_box, cutmix_box
from fadrm_ray.models import load_teacher, match_channels
from fadrm_ray.seeding import seeded_generator
from fadrm_ray.statistics import bn_layers
from fadrm_ray.errors import InputError
from fadrm_ray.evaluation import on_device
from fadrm_ray.runtime import to_device



# --------------------------------------------------------------------------- the augmentation
@dataclass(frozen=True)
class AugmentSpec:
    """The student-side augmentation (docs/method.md section 6)."""
    out_size: int
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = False          # only where a flip keeps the label (not for digits)
    cutmix_prob: float = 1.0     # the published students mix every batch

    def __post_init__(self):
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise InputError(f"crop_scale must satisfy 0 < low <= high <= 1, got {self.crop_scale}")
        if not 0.0 <= self.cutmix_prob <= 1.0:
            raise InputError(f"cutmix_prob must be in [0, 1], got {self.cutmix_prob}")
        if self.out_size < 1:
            raise InputError(f"out_size must be >= 1, got {self.out_size}")

    def to_dict(self) -> dict:
        return {"out_size": int(self.out_size), "crop_scale": [float(v) for v in self.crop_scale],
                "hflip": bool(self.hflip), "cutmix_prob": float(self.cutmix_prob)}


@dataclass
class ViewPlan:
    """Everything random about one student step; `apply_plan` turns it into pixels."""
    indices: torch.Tensor                 # (B,) int64 image index of each slot
    boxes: torch.Tensor                   # (B, 4) int64 crop (top, left, h, w) in source pixels
    flips: torch.Tensor                   # (B,) bool
    partner: torch.Tensor                 # (B,) int64 CutMix: slot j's box comes from slot partner[j]
    mix_box: tuple[int, int, int, int]    # (y0, y1, x0, x1) in output pixels; empty when not mixed
    lam: float                            # fraction of each view that stays its own image

    @property
    def mixed(self) -> bool:
        y0, y1, x0, x1 = self.mix_box
        return y1 > y0 and x1 > x0

    def __len__(self) -> int:
        return int(self.indices.numel())


def draw_plan(indices: torch.Tensor, height: int, width: int, spec: AugmentSpec,
              gen: torch.Generator) -> ViewPlan:
    """Draw one step's crops, flips and CutMix from `gen` (per-image crop and flip, one
    lambda, partner permutation and box for the whole batch, as in docs/method.md section 6)."""
    b = int(indices.numel())
    boxes = torch.tensor([crop_box(height, width, spec.crop_scale[0], gen, scale_max=spec.crop_scale[1])
                          for _ in range(b)], dtype=torch.long).view(b, 4)
    flips = (torch.rand(b, generator=gen) < 0.5) if spec.hflip else torch.zeros(b, dtype=torch.bool)
    partner, mix_box, lam = torch.arange(b), (0, 0, 0, 0), 1.0
    if b > 1 and spec.cutmix_prob > 0:
        use = spec.cutmix_prob >= 1.0 or float(torch.rand((), generator=gen)) < spec.cutmix_prob
        if use:
            lam0 = float(torch.rand((), generator=gen))  # Beta(1, 1) is uniform on [0, 1]
            partner = torch.randperm(b, generator=gen)
            cy, cx = (int(v) for v in torch.randint(0, spec.out_size, (2,), generator=gen))
            mix_box, lam = cutmix_box(spec.out_size, spec.out_size, lam0, cy, cx)
            if mix_box == (0, 0, 0, 0):
                partner = torch.arange(b)
    return ViewPlan(indices=indices.clone().long(), boxes=boxes, flips=flips, partner=partner,
                    mix_box=mix_box, lam=lam)


def apply_plan(images: torch.Tensor, plan: ViewPlan, out_size: int) -> torch.Tensor:
    """The augmented batch (B, C, out, out) in [0, 1] pixel units, on the device of `images`:
    uint8 images (N, C, H, W), each crop converted on its own (`unit`), or images already in
    [0, 1].

    Bilinear resampling and CutMix are convex combinations of pixels, so working in [0, 1]
    and normalizing afterwards (per model: student and teachers may use different statistics)
    gives the same view as working in normalized space.

    On a CPU each view is cut on its own (`F.interpolate` of its crop): the views the recorded
    results were trained on, bit for bit. On an accelerator the whole batch is cut in one
    `grid_sample` (`cut_views`), with the plan sent over in one non-blocking copy: no Python
    loop over images, and nothing that waits for the device. The two agree to rounding.
    """
    if images.device.type != "cpu":
        return cut_views(images, plan, out_size)
    views = []
    for j in range(len(plan)):
        top, left, h, w = (int(v) for v in plan.boxes[j])
        crop = unit(images[int(plan.indices[j]), :, top:top + h, left:left + w].unsqueeze(0))
        if h != out_size or w != out_size:
            crop = F.interpolate(crop, size=(out_size, out_size), mode="bilinear", align_corners=False)
        if bool(plan.flips[j]):
            crop = crop.flip(-1)
        views.append(crop)
    view = torch.cat(views)
    if plan.mixed:
        y0, y1, x0, x1 = plan.mix_box
        mixed = view.clone()
        mixed[:, :, y0:y1, x0:x1] = view[plan.partner, :, y0:y1, x0:x1]
        view = mixed
    return view


def cut_views(images: torch.Tensor, plan: ViewPlan, out_size: int) -> torch.Tensor:
    """`apply_plan`'s views, cut in one batched operation where `images` live (uint8, only the
    batch's images converted, or in [0, 1]).

    Each output pixel samples the point `F.interpolate(crop, align_corners=False)` samples,
    (i + 0.5) * size / out - 0.5 in the crop, clamped to the crop's own pixels; a flip reverses
    the columns; CutMix copies the box from each slot's partner. Only the plan's integers cross
    from the host, in one non-blocking copy.
    """
    device = images.device
    packed = to_device(torch.cat([plan.indices.view(-1, 1), plan.boxes, plan.flips.view(-1, 1).long(),
                                  plan.partner.view(-1, 1)], dim=1), device)
    index, top, left, h, w, flip, partner = packed.unbind(1)
    height, width = images.shape[-2:]
    centres = torch.arange(out_size, device=device, dtype=torch.float32) + 0.5

    def grid_coordinates(start: torch.Tensor, size: torch.Tensor, full: int) -> torch.Tensor:
        size = size.float()
        inside = ((size / out_size)[:, None] * centres - 0.5).clamp_min(0).minimum(size[:, None] - 1)
        return (start.float()[:, None] + inside) * (2.0 / max(1, full - 1)) - 1.0  # align_corners=True

    ys = grid_coordinates(top, h, height)
    xs = grid_coordinates(left, w, width)
    xs = torch.where(flip.bool()[:, None], xs.flip(1), xs)
    grid = torch.stack(torch.broadcast_tensors(xs[:, None, :], ys[:, :, None]), dim=-1)
    view = F.grid_sample(unit(images.index_select(0, index)), grid, mode="bilinear", padding_mode="border",
                         align_corners=True)
    if plan.mixed:
        y0, y1, x0, x1 = plan.mix_box
        view[:, :, y0:y1, x0:x1] = view.index_select(0, partner)[:, :, y0:y1, x0:x1]
    return view


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """One generator per (seed, epoch), so any epoch can be rebuilt on its own."""
    return seeded_generator("relabel", int(seed), int(epoch))


def epoch_batches(n: int, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """A shuffled pass over n images in batches; a trailing batch of one joins the batch before
    it, because BatchNorm cannot take training statistics from a single image."""
    order = torch.randperm(n, generator=gen)
    batches = list(order.split(batch_size))
    if len(batches) > 1 and batches[-1].numel() == 1:
        batches[-2] = torch.cat(batches[-2:])
        batches.pop()
    return batches


def steps_per_epoch(n: int, batch_size: int) -> int:
    full, rest = divmod(n, batch_size)
    return full + (1 if rest > 1 or full == 0 else 0)


# --------------------------------------------------------------------------- teachers
class SoftLabeler:
    """Frozen teacher(s) in eval mode; their logits on a [0, 1] view, averaged (FADRM+, section 5).

    Each teacher sees the view normalized with its own training statistics and channel count.
    `batch_statistics` (CV-DD's batch-specific soft labels, docs/method.md section 7c): the
    teachers' BatchNorm layers normalize each view with the statistics of that batch instead of
    their running statistics, which stay untouched.
    """

    batch_statistics: bool = False

    def __init__(self, models: Sequence[nn.Module], means: Sequence[Sequence[float]],
                 stds: Sequence[Sequence[float]], in_chans: Sequence[int], ids: Sequence[str] | None = None,
                 device: str | torch.device = "cpu"):
        if not models:
            raise InputError("at least one teacher is needed for soft labels")
        self.device = torch.device(device)
        # On CUDA the teachers label in mixed precision and channels-last, as the students train.
        self.layout = on_device.layout(self.device)
        self.models = [m.to(self.device, memory_format=self.layout).eval().requires_grad_(False) for m in models]
        self.means = [torch.tensor(list(m), dtype=torch.float32, device=self.device).view(1, -1, 1, 1) for m in means]
        self.stds = [torch.tensor(list(s), dtype=torch.float32, device=self.device).view(1, -1, 1, 1) for s in stds]
        self.in_chans = [int(c) for c in in_chans]
        self.ids = list(ids) if ids is not None else [_module_digest(m) for m in self.models]

    @classmethod
    def from_paths(cls, paths: Sequence[str | Path], dataset=None, device: str | torch.device = "cpu") -> "SoftLabeler":
        """Load teacher checkpoints; with `dataset`, check each fits it (class order, size, channels)."""
        from fadrm_ray.models import check_teacher_fits

        if not paths:
            raise InputError("at least one teacher checkpoint is needed for soft labels")
        loaded = [load_teacher(path, device=device) for path in paths]
        if dataset is not None:
            for _, info in loaded:
                check_teacher_fits(info, dataset)
        return cls.from_loaded([m for m, _ in loaded], [i for _, i in loaded], device)

    @classmethod
    def from_loaded(cls, models: Sequence[nn.Module], infos: Sequence, device: str | torch.device = "cpu") -> "SoftLabeler":
        """Teachers already loaded (`load_teacher`'s models and TeacherRecords)."""
        return cls(models, [i.mean for i in infos], [i.std for i in infos], [i.in_chans for i in infos],
                   [i.sha256 for i in infos], device)

    def with_batch_statistics(self, on: bool = True) -> "SoftLabeler":
        """The same teachers, labelling with batch statistics (`on`) or running ones."""
        if on == self.batch_statistics:
            return self
        other = object.__new__(SoftLabeler)
        other.__dict__.update(self.__dict__)
        other.batch_statistics = on
        return other

    @property
    def key_ids(self) -> list[str]:
        """What names these labels in a cache: the teachers, and how their BN layers normalize."""
        return [*self.ids, "bn=batch"] if self.batch_statistics else list(self.ids)

    @torch.no_grad()
    def __call__(self, view01: torch.Tensor) -> torch.Tensor:
        """The averaged fp32 logits of a [0, 1] view, on the teachers' device (on CUDA computed
        under autocast, in the students' precision)."""
        from fadrm_ray.evaluation.on_device import student_autocast

        view01 = view01.to(self.device)
        total = None
        for model, mean, std, chans in zip(self.models, self.means, self.stds, self.in_chans):
            x = match_channels((view01 - mean) / std, chans).contiguous(memory_format=self.layout)
            with batch_statistics(model) if self.batch_statistics else contextlib.nullcontext(), \
                    student_autocast(self.device):
                logits = model(x).float()
            total = logits if total is None else total + logits
        return total / len(self.models)


@contextlib.contextmanager
def batch_statistics(model: nn.Module):
    """`model`'s BatchNorm layers normalize with the statistics of the batch they see, their
    running statistics neither used nor updated; everything else stays in eval mode."""
    layers = bn_layers(model)
    saved = [(m.training, m.track_running_stats) for m in layers]
    for m in layers:  # training without tracked statistics: F.batch_norm gets no running buffers
        m.training, m.track_running_stats = True, False
    try:
        yield model
    finally:
        for m, (training, tracked) in zip(layers, saved):
            m.training, m.track_running_stats = training, tracked


def _module_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- one step
@dataclass
class Step:
    view01: torch.Tensor      # (B, C, S, S) the augmented batch in [0, 1]
    logits: torch.Tensor      # (B, K) float32 soft-label logits (teacher average)
    plan: ViewPlan
    epoch: int
    index: int                # step within the epoch


def to_unit(images_uint8: torch.Tensor) -> torch.Tensor:
    """A uint8 batch (N, C, H, W) as floats in [0, 1]."""
    if images_uint8.dtype != torch.uint8 or images_uint8.dim() != 4:
        raise ValueError(f"images must be uint8 (N, C, H, W), got {images_uint8.dtype} {tuple(images_uint8.shape)}")
    return images_uint8.float().div(255.0)


def unit(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels as floats in [0, 1] (`to_unit`'s arithmetic); floats as they are."""
    return pixels.float().div(255.0) if pixels.dtype == torch.uint8 else pixels


def held_images(images_uint8: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The set a student cuts its views from: uint8 (N, C, H, W), on `device` (the very tensor
    where it is there already); never converted whole (module docstring)."""
    if images_uint8.dtype != torch.uint8 or images_uint8.dim() != 4:
        raise ValueError(f"images must be uint8 (N, C, H, W), got {images_uint8.dtype} {tuple(images_uint8.shape)}")
    return images_uint8.to(device)


class OnlineSoftLabels:
    """Soft labels computed on the fly each step with the frozen teacher(s): no storage."""

    mode = "online"

    def __init__(self, images_uint8: torch.Tensor, labeler: SoftLabeler, spec: AugmentSpec,
                 batch_size: int, seed: int):
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        # The views are cut where the teachers run: on a GPU, a step never waits on the CPU. The
        # set stays uint8 there (`held_images`); `images_uint8` is the caller's, on the host.
        self.images_uint8, self.images = images_uint8, held_images(images_uint8, labeler.device)
        self.labeler, self.spec, self.batch_size, self.seed = labeler, spec, int(batch_size), int(seed)

    @property
    def images01(self) -> torch.Tensor:
        """The set as `apply_plan` takes it: `images` (uint8, converted view by view)."""
        return self.images

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.images.shape[0], self.batch_size)

    def plans(self, epoch: int) -> list[ViewPlan]:
        gen = epoch_generator(self.seed, epoch)
        h, w = self.images.shape[-2:]
        return [draw_plan(idx, h, w, self.spec, gen)
                for idx in epoch_batches(self.images.shape[0], self.batch_size, gen)]

    def epoch(self, epoch: int) -> Iterator[Step]:
        for i, plan in enumerate(self.plans(epoch)):
            view = apply_plan(self.images, plan, self.spec.out_size)
            yield Step(view, self.labeler(view), plan, epoch, i)
