"""Recover: optimize synthetic images against frozen teachers (docs/method.md sections 3-5).

The whole method is in this file, but for the teachers and their statistics losses
(frozen_teacher.py, statistics.py) and the random-resized-crop box of its views, which the
student's views share (augment.py). A unit of work is a set of classes and a few IPC indices;
each IPC index is one *group*, a batch of one image per class. Groups are independent: each has
its own random stream (so its result does not depend on which process ran it or on which other
groups it was packed with), its own crop/flip/roll, and its own BatchNorm-statistics loss. The
total loss is the sum of the group losses, so packing G groups in one forward/backward gives the
math of G separate runs (BatchNorm is frozen in eval mode, so images never interact).

Recover runs one stage at a time: `init_state` -> `run_stage` (k + 1 times) -> `final_images`.
A `RecoverState` holds everything needed to continue (images, patches, counters, random
streams, loss history), so a scheduler can checkpoint a unit at a stage boundary
(`runs.stages.checkpoint_of`, written by `store.checkpoints`) and continue it in another process.
"""
from __future__ import annotations

import math
import time
import warnings
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from fadrm_ray.augment import crop_box
from fadrm_ray.config import DistillConfig, mro_resolutions, tv_downsample_size
from fadrm_ray.seeding import derive_seed
from fadrm_ray.committee import committee_weights
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.errors import InputError
from fadrm_ray.runtime import autotune_convolutions, to_device

# With bound = "sigmoid", pixels are kept this far from 0 and 1: a quarter of an 8-bit level, so
# a pixel that starts saturated is written back as 0 or 255.
EDGE = 1.0 / 1024


# --------------------------------------------------------------------------- state
@dataclass
class RecoverState:
    x: torch.Tensor                  # (G*B, C, R, R) float32, normalized, at the current stage resolution,
                                     # on the device of the last stage run (the host in a checkpoint)
    patches: torch.Tensor | None     # (G*B, C, D, D) uint8 real patches (ARC target); None for noise init
    labels: torch.Tensor             # (G*B,) int64 class index of each image
    ipc_indices: list[int]           # the IPC index of each group
    mean: list[float]
    std: list[float]
    budgets: list[int]               # iterations per stage (a stage that ends early passes its rest on)
    resolutions: list[int]           # R_s per stage
    total_iterations: int            # T, for the global cosine schedule
    rng_states: list[torch.Tensor]   # one generator state per group
    stage: int = 0                   # the next stage to run
    iteration: int = 0               # global iteration counter
    history: list[dict] = field(default_factory=list)

    @property
    def groups(self) -> int:
        return len(self.ipc_indices)

    @property
    def done(self) -> bool:
        return self.stage >= len(self.budgets)


def group_seed(seed: int, classes: Sequence[int], ipc_index: int) -> int:
    """The seed of one group: a function of the run seed, its classes and its IPC index only."""
    return derive_seed(seed, ",".join(map(str, classes)), ipc_index)


def init_state(cfg: DistillConfig, classes: Sequence[int], ipc_indices: Sequence[int],
               patches: torch.Tensor | None, image_size: int, channels: int,
               mean: Sequence[float], std: Sequence[float]) -> RecoverState:
    """Initial images for the groups `ipc_indices` of `classes` (docs/method.md section 2).

    `patches` is uint8 (G, B, C, D, D) with B = len(classes), or None for noise init.
    `cfg` must be resolved (`DistillConfig.resolve`).
    """
    g, b = len(ipc_indices), len(classes)
    gens = [torch.Generator().manual_seed(group_seed(cfg.seed, classes, i)) for i in ipc_indices]
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    if cfg.init == "real":
        if patches is None or tuple(patches.shape) != (g, b, channels, image_size, image_size):
            raise ValueError(f"patches must be uint8 {(g, b, channels, image_size, image_size)}, "
                             f"got {None if patches is None else tuple(patches.shape)}")
        patches = patches.reshape(g * b, channels, image_size, image_size).contiguous()
        full = (patches.float() / 255.0 - mean_t) / std_t
    else:
        patches = None
        full = torch.cat([torch.randn(b, channels, image_size, image_size, generator=gen) for gen in gens])

    resolutions = cfg.stage_resolutions
    if resolutions is None:  # downsample_size == "auto": from the total variation of each group's patches
        x01 = patches.float() / 255.0 if patches is not None else (full * std_t + mean_t).clamp(0, 1)
        found = {tuple(mro_resolutions(cfg.k, image_size, tv_downsample_size(x01[j * b:(j + 1) * b], image_size)))
                 for j in range(g)}
        if len(found) > 1:  # a group's schedule must not depend on what it is packed with
            raise ValueError(f"groups packed together must share their stage resolutions, got {sorted(found)}")
        resolutions = list(found.pop())
    x = resize(full, resolutions[0])
    return RecoverState(
        x=x, patches=patches, labels=torch.tensor(list(classes), dtype=torch.long).repeat(g),
        ipc_indices=list(ipc_indices), mean=list(mean), std=list(std),
        budgets=list(cfg.stage_budgets()), resolutions=list(resolutions),
        total_iterations=cfg.iterations, rng_states=[gen.get_state() for gen in gens])


# --------------------------------------------------------------------------- one stage
def run_stage(state: RecoverState, teachers: Sequence[FrozenTeacher], cfg: DistillConfig,
              device: str | torch.device = "cpu",
              on_step: Callable[[int], None] | None = None) -> RecoverState:
    """Run the next stage of `state` in place and return it (docs/method.md sections 3-4).

    At the end of every stage but the last, the images are resampled to the next stage's
    resolution and, with ARC, merged with the real patch resampled to the same size.

    The loop never waits on the device: the loss curves collect in a device tensor read once
    at the end of the stage (only `arc_timing: converged` looks at the losses every step).
    """
    if state.done:
        raise ValueError("all stages of this state have already run")
    device = torch.device(device)
    autotune_convolutions(device)  # a stage repeats one input shape
    s, last = state.stage, len(state.budgets) - 1
    budget, res = state.budgets[s], state.resolutions[s]
    groups = state.groups
    gens = [torch.Generator().set_state(st) for st in state.rng_states]
    labels = state.labels.to(device)
    mean = torch.tensor(state.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(state.std, device=device).view(1, -1, 1, 1)
    lo, hi = (0 - mean) / std, (1 - mean) / std  # keep de-normalized pixels in [0, 1]
    jitter, flip = int(cfg.jitter), bool(cfg.flip)
    autocast, scaler = mixed_precision(cfg.precision, device)
    losses = [teacher_loss(t, cfg) for t in teachers]
    if cfg.r_conv > 0 and any(t.conv is None for t in teachers):
        raise ValueError("r_conv > 0 needs each teacher's convolution targets from real images: "
                         "build them with frozen_teacher.equip_teachers (or FrozenTeacher(conv_targets=...))")
    if cfg.bn_category > 0 and any(t.category is None for t in teachers):
        raise ValueError("bn_category > 0 needs each teacher's class-wise BN targets from real images: "
                         "build them with frozen_teacher.equip_teachers (or FrozenTeacher(category=...))")
    votes = committee_weights([t.prior for t in teachers], cfg.committee_temperature).tolist() \
        if cfg.committee == "prior" else None
    converge = cfg.arc_timing == "converged" and s < last

    sigmoid = cfg.bound == "sigmoid"
    if sigmoid:
        # The parameters are the logits of the [0, 1] pixels; a saturated pixel starts at logit(EDGE).
        x = torch.logit((state.x.to(device) * std + mean).clamp(EDGE, 1 - EDGE)).requires_grad_(True)
    else:
        x = state.x.to(device).clone().requires_grad_(True)

    def normalized(params: torch.Tensor) -> torch.Tensor:
        """The normalized images the parameters stand for."""
        return (torch.sigmoid(params) - mean) / std if sigmoid else params

    # A fresh Adam per stage: its moments are reset, the cosine keeps the global counter (section 4).
    # The fused kernel does Adam's update in one pass over x on CUDA.
    opt = torch.optim.Adam([x], lr=cfg.lr, betas=(0.5, 0.9), fused=device.type == "cuda")
    curves = torch.zeros(budget, 2, device=device)  # per-step mean CE and BN loss, read once at the end
    started = time.perf_counter()
    steps = 0
    held = ExitStack()
    for teacher in teachers:  # the low-precision weights autocast would cast every step
        held.enter_context(teacher.weights_in(held_dtype(cfg)))
    with held:
        while steps < budget:
            t = state.iteration
            opt.param_groups[0]["lr"] = cosine(cfg.lr, t, state.total_iterations)
            scale_min = cda_scale_min(cfg.crop_scale_min, t, state.total_iterations) if cfg.crop_curriculum else cfg.crop_scale_min
            view = augment(normalized(x), groups, gens, res, scale_min, flip, jitter)
            with autocast():
                if votes is None:  # FADRM+ and G-VBSM: the teachers take turns (section 5)
                    ce, bn, stat = step_loss(losses[t % len(teachers)], view, labels, groups, cfg)
                else:  # CV-DD: every teacher votes, weighted by its prior (section 7c)
                    parts = [step_loss(fn, view, labels, groups, cfg) for fn in losses]
                    ce, bn, stat = (sum(w * p[i] for w, p in zip(votes, parts)) for i in range(3))
            loss = (ce + stat).sum()  # a sum over groups keeps each group's gradient its own
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            with torch.no_grad():
                if not sigmoid:
                    x.clamp_(lo, hi)
                curves[steps, 0] = ce.mean()
                curves[steps, 1] = bn.mean()
            state.iteration += 1
            steps += 1
            if on_step is not None:
                on_step(1)
            if converge and ce.max() < cfg.arc_ce_threshold and bn.max() < cfg.arc_bn_threshold:
                break  # adaptive ARC timing: the stage has converged, merge now (section 4)

    if steps < budget:  # the iterations a converged stage did not use go to the next stage
        state.budgets[s + 1] += budget - steps
        state.budgets[s] = steps

    with torch.no_grad():
        x = normalized(x.detach())
        merged = False
        if s < last:
            next_res = state.resolutions[s + 1]
            x = resize(x, next_res)
            if cfg.uses_arc and state.patches is not None:
                # ARC: re-inject real local detail washed out by optimization (section 4).
                patch = (to_device(state.patches, device).float() / 255.0 - mean) / std
                x = cfg.alpha * x + (1 - cfg.alpha) * resize(patch, next_res)
                merged = True
    ce_curve, bn_curve = curves[:steps].T.tolist()
    state.x = x  # stays on the device for the next stage; a checkpoint and `final_images` bring it back
    state.rng_states = [gen.get_state() for gen in gens]
    state.history.append({
        "stage": s, "resolution": res, "iterations": steps, "merged_after": merged,
        "ce": ce_curve, "bn": bn_curve, "seconds": time.perf_counter() - started,
    })
    state.stage += 1
    return state


def step_loss(fn, view: torch.Tensor, labels: torch.Tensor, groups: int,
              cfg: DistillConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group CE, BN loss and weighted statistics term r_bn * BN + r_conv * conv of one
    teacher's `teacher_loss` fn (the convolution term of G-VBSM and EDC, section 7c)."""
    ce, bn, conv = fn(view, labels, groups)
    stat = cfg.r_bn * bn
    if conv is not None and cfg.r_conv > 0:
        stat = stat + cfg.r_conv * conv
    return ce, bn, stat


def teacher_loss(teacher: FrozenTeacher, cfg: DistillConfig):
    """`fn(view, labels, groups) -> (ce, bn, conv)`: the per-group CE, BN and convolution
    (None unless attached) losses of one teacher.

    With `cfg.compile` the function is compiled once per input shape and kept on the teacher,
    so later stages and units reuse it.
    """
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    teacher.set_memory_format(memory_format)
    device = teacher.bn_layers[0].running_mean.device
    teacher.matching.prepare(device)
    if teacher.conv is not None:
        teacher.conv.matching.prepare(device)

    def loss(view: torch.Tensor, labels: torch.Tensor, groups: int):
        logits, bn, conv = teacher.measure(view.contiguous(memory_format=memory_format), groups, labels)
        ce = F.cross_entropy(logits.float(), labels, reduction="none").view(groups, -1).mean(dim=1)
        return ce, bn, conv

    if not cfg.compile:
        return loss
    graphs = cfg.cuda_graphs and teacher.bn_layers[0].running_mean.device.type == "cuda"
    key = (str(memory_format), graphs)
    if key not in teacher._compiled:
        teacher._compiled[key] = _compile(loss, teacher.model, graphs)
    return teacher._compiled[key]


def _compile(fn: Callable, model: nn.Module, cuda_graphs: bool = False) -> Callable:
    """torch.compile `fn` (as CUDA graphs with `cuda_graphs`: the "reduce-overhead" mode), after
    routing one op around an Inductor bug.

    Inductor's backward of a ceil_mode average pool divides the overhanging last window by the
    whole kernel (pytorch/pytorch#198119, open for torch 2.14 on CPU and CUDA). convnet-bn pools
    that way, so at an odd size (the 7-px map of a 28-px image) the compiled gradient would be
    silently wrong. Inductor is told to call the eager kernel for that op instead; where that
    is not possible, a model with such a pool runs eagerly. For such a model the on-disk graph
    cache is bypassed: its key does not see the fallback, so it could hand back a graph compiled
    without it. Other models (ResNets pool with a max pool and an adaptive average) use the
    cache, so a second process compiles the same step in seconds.
    """
    global _POOL_FALLBACK
    pools = any(isinstance(m, (nn.AvgPool1d, nn.AvgPool2d)) and m.ceil_mode for m in model.modules())
    if not _POOL_FALLBACK:
        try:
            from torch._inductor import lowering
            lowering.make_fallback(torch.ops.aten.avg_pool2d_backward, warn=False)
            _POOL_FALLBACK = True
        except Exception as exc:  # an internal API: it may move in another torch version
            if pools:
                warnings.warn(f"compile is off for this teacher: its ceil_mode average pooling has a wrong "
                              f"compiled gradient in this torch, and the workaround failed ({exc})")
                return fn
    options = {"fx_graph_cache": False} if pools else {}
    if cuda_graphs:
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets
    return torch.compile(fn, dynamic=False, options=options or None)


_POOL_FALLBACK = False


def recover(state: RecoverState, teachers: Sequence[FrozenTeacher], cfg: DistillConfig,
            device: str | torch.device = "cpu", on_step: Callable[[int], None] | None = None) -> RecoverState:
    """Run every remaining stage."""
    while not state.done:
        run_stage(state, teachers, cfg, device, on_step)
    return state


@torch.no_grad()
def final_images(state: RecoverState, teachers: Sequence[FrozenTeacher],
                 device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 images (G*B, C, D, D), per-image CE and per-image (group) BN loss of the result.

    The losses are measured on the un-augmented output in fp32, averaged over the teachers.
    """
    device = torch.device(device)
    mean = torch.tensor(state.mean).view(1, -1, 1, 1)
    std = torch.tensor(state.std).view(1, -1, 1, 1)
    images = ((state.x.cpu() * std + mean).clamp(0, 1) * 255).round().to(torch.uint8)
    x = ((images.float() / 255.0 - mean) / std).to(device)
    labels = state.labels.to(device)
    ce = torch.zeros(x.shape[0], device=device)
    bn = torch.zeros(state.groups, device=device)
    for teacher in teachers:
        logits, bn_t = teacher(x, state.groups)
        ce += F.cross_entropy(logits.float(), labels, reduction="none")
        bn += bn_t
    n = len(teachers)
    per_image_bn = (bn / n).repeat_interleave(x.shape[0] // state.groups)
    return images, (ce / n).cpu(), per_image_bn.cpu()


# --------------------------------------------------------------------------- pieces
def augment(x: torch.Tensor, groups: int, gens: Sequence[torch.Generator], out_size: int,
            scale_min: float, flip: bool, jitter: int) -> torch.Tensor:
    """One RandomResizedCrop, one flip decision and one roll per group (docs/method.md section 3)."""
    views = []
    for chunk, gen in zip(x.chunk(groups), gens):
        top, left, h, w = crop_box(chunk.shape[-2], chunk.shape[-1], scale_min, gen)
        v = F.interpolate(chunk[:, :, top:top + h, left:left + w], size=(out_size, out_size),
                          mode="bilinear", align_corners=False)
        if torch.rand((), generator=gen) < 0.5 and flip:
            v = v.flip(3)
        dy, dx = (int(d) for d in torch.randint(0, jitter + 1, (2,), generator=gen))
        if dy or dx:
            v = torch.roll(v, shifts=(dy, dx), dims=(2, 3))
        views.append(v)
    return torch.cat(views)


def cosine(base_lr: float, t: int, total: int) -> float:
    """One cosine schedule over all T iterations, no warm-up (docs/method.md section 3)."""
    return 0.5 * base_lr * (1 + math.cos(math.pi * t / max(total, 1)))


def cda_scale_min(final_min: float, t: int, total: int) -> float:
    """CDA's curriculum: the crop-scale lower bound anneals from 1.0 to `final_min` by cosine."""
    return final_min + (1.0 - final_min) * 0.5 * (1 + math.cos(math.pi * t / max(total, 1)))


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear resampling of a batch to `size` x `size`, the one resampling of stage changes and
    ARC merges (section 4); a batch already at that size is returned as it is."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def low_precision_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast computes in at `precision` (None for fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def held_dtype(cfg: DistillConfig) -> torch.dtype | None:
    """The dtype a stage holds its teachers' weights in (`FrozenTeacher.weights_in`): the autocast
    dtype on the eager path; none on the compiled one, whose graph casts them itself (Inductor's
    backward of a linear layer mixes dtypes when given low-precision weights under an autocast
    entered outside the graph: torch 2.14 on a CPU, bf16)."""
    return None if cfg.compile else low_precision_dtype(cfg.precision)


def mixed_precision(precision: str, device: torch.device):
    """MPT (docs/method.md section 4): autocast for forward/backward; images and Adam stay fp32."""
    if precision == "fp32":
        return nullcontext, None
    if precision == "fp16":
        if device.type != "cuda":
            raise InputError("precision fp16 needs a CUDA device; use bf16 (or fp32) on the CPU")
        return (lambda: torch.autocast("cuda", dtype=torch.float16)), torch.amp.GradScaler("cuda")
    if precision == "bf16":
        return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), None
    raise ValueError(f"precision must be fp32, bf16 or fp16 once resolved, got {precision!r}")
