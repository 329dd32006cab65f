"""Real-patch selection: the images FADRM starts from and merges back to (docs/method.md section 2).

RDED-style: for class c, cut a few random square crops from each candidate image, score every
crop by the teacher's cross-entropy for c, keep each image's best crop, rank the images by that
score and take them in rank order ("easy": lowest CE first; "medium": from the middle of the
ranking outwards; "grouped": the best of each small group of shuffled images; "spread": the
class's best image first, then as grouped). "random" takes one random crop of a random image,
"whole" a random whole image (the random-real baseline). With `mosaic` f > 1 (RDED's stitched
images), each image is an f x f grid of the next f * f patches in that order, each resized to a
cell of about D / f, so one image carries several real views of its class.

The patch of (class c, IPC index i) is a function of the dataset, the teacher(s), the config and
the seed only: not of the IPC asked for, nor of the worker that computes it. So a run can grow
from IPC 10 to 20 without touching indices 0-9, and any worker that needs a patch computes the
same one.

Scoring is the expensive part (every crop of every candidate through the teacher), and its
result is small: the ranked candidates and the box of each one's best crop. `score_class`
returns that as a `ClassSelection` (a run file, `store.run_files`), which a run computes once
per class and shares (on Ray the worker pool sends it to every worker; the run directory keeps it
for later requests, `store.selections`);
`class_patch_images` then cuts the patches of any IPC indices from it without the teacher.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Sequence

import torch
import torch.nn.functional as F

from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.data.parallel import prefetch
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.seeding import seeded_generator
from fadrm_ray.errors import InputError
from fadrm_ray.store.run_files import ClassSelection

Box = tuple[int, int, int]  # (top, left, side) of a square crop
SCORED = ("easy", "medium", "grouped", "spread")  # the selections that rank the candidates by teacher CE

# Input pixels per scoring forward (512 crops of 32 px on a CPU): large batches keep the device
# busy; the cap keeps the activations of large images within memory.
_SCORE_PIXELS = {"cpu": 1 << 19, "cuda": 1 << 22}
# Candidates decoded per chunk while scoring (at least one scoring batch's worth): enough to keep
# the decode threads busy, few enough that a class of ImageNet is never held whole.
_DECODE_CHUNK = 64


def scored(cfg: DistillConfig) -> bool:
    """Whether a resolved config's patches come from teacher scores (easy, medium, grouped, spread),
    the costly kind."""
    return cfg.init == "real" and cfg.patch_selection in SCORED


def _candidates(dataset: ImageDataset, label: int, cfg: DistillConfig) -> tuple[torch.Tensor, torch.Generator]:
    """The class's shuffled candidate images, and the generator that goes on to draw their crops."""
    gen = seeded_generator("patches", cfg.seed, label)  # a function of (seed, class) only
    candidates = dataset.train.indices_of_class(label)
    if candidates.numel() == 0:
        raise InputError(f"class {label} ({dataset.class_names[label]}) has no training images")
    candidates = candidates[torch.randperm(candidates.numel(), generator=gen)]
    if cfg.patch_candidates:
        candidates = candidates[: cfg.patch_candidates]
    return candidates, gen


def draw_boxes(gen: torch.Generator, count: int, scale: tuple[float, float], h: int, w: int) -> list[Box]:
    """`count` random square crop boxes, drawn one after the other (three uniforms each): area a
    uniform fraction of the image in `scale`, position uniform."""
    boxes = []
    for _ in range(count):
        u = torch.rand(3, generator=gen).tolist()
        frac = scale[0] + (scale[1] - scale[0]) * u[0]
        side = max(1, min(h, w, int(round(math.sqrt(frac * h * w)))))
        boxes.append((int(u[1] * (h - side + 1)), int(u[2] * (w - side + 1)), side))
    return boxes


def cut(images: torch.Tensor, boxes: Sequence[Box], size: int | tuple[int, int], per_image: int = 1) -> torch.Tensor:
    """uint8 crops (len(boxes), C, H, W), (H, W) = `size` (an int: square): box j cut from
    images[j // per_image] and resized (bilinear, antialiased), rounded to uint8. Crops of one side
    are resized in one call; the resize treats every image on its own, so a crop is the same
    whether it is cut alone or with others."""
    h, w = (size, size) if isinstance(size, int) else size
    out = torch.empty((len(boxes), images.shape[1], h, w), dtype=torch.uint8)
    by_side: dict[int, list[int]] = {}
    for j, (_, _, side) in enumerate(boxes):
        by_side.setdefault(side, []).append(j)
    for side, rows in by_side.items():
        batch = torch.stack([images[j // per_image, :, boxes[j][0]:boxes[j][0] + side, boxes[j][1]:boxes[j][1] + side]
                             for j in rows]).float()
        if (side, side) != (h, w):
            batch = F.interpolate(batch, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
        out[rows] = batch.round().clamp(0, 255).to(torch.uint8)
    return out


def mosaic_edges(size: int, factor: int) -> list[int]:
    """Where the cells of a `factor` x `factor` mosaic of `size` px begin and end along one axis:
    `factor` + 1 edges, the cells as even as whole pixels allow (32 px in 3: 11, 10, 11)."""
    return [round(size * j / factor) for j in range(factor + 1)]


def tile(images: torch.Tensor, boxes: Sequence[Box], size: int, factor: int) -> torch.Tensor:
    """uint8 (len(boxes) // factor**2, C, size, size): each run of factor**2 sources (box j of
    images[j]) stitched into one image, row by row, each source cut and resized (bilinear,
    antialiased) straight to its cell, so a cell is one resampling of the real pixels."""
    edges, per = mosaic_edges(size, factor), factor * factor
    out = torch.empty((len(boxes) // per, images.shape[1], size, size), dtype=torch.uint8)
    for r in range(factor):
        for c in range(factor):
            j = r * factor + c
            out[:, :, edges[r]:edges[r + 1], edges[c]:edges[c + 1]] = cut(
                images[j::per], boxes[j::per], (edges[r + 1] - edges[r], edges[c + 1] - edges[c]))
    return out


def score_class(dataset: ImageDataset, label: int, cfg: DistillConfig, teachers: Sequence[FrozenTeacher],
                device: str | torch.device = "cpu") -> ClassSelection:
    """Score `patch_crops` crops of every candidate of class `label` and rank the candidates by
    their best crop (a stable sort). `cfg` must be resolved (its precision is the scoring's)."""
    if not teachers:
        raise InputError(f"patch_selection {cfg.patch_selection!r} scores crops with the teacher; none was given")
    cfg = cfg.sized(dataset.image_size, dataset.channels)
    candidates, gen = _candidates(dataset, label, cfg)
    n, m, size = candidates.numel(), cfg.patch_crops, dataset.image_size
    batch = score_batch_size(size, torch.device(device))
    # The candidates are decoded a chunk at a time, the next chunk while the teacher scores this
    # one; the crops are scored in the same batches of `batch` crops as if all were cut at once.
    chunk = max(-(-batch // m), _DECODE_CHUNK)
    boxes: list[Box] = []
    waiting = torch.empty((0, dataset.channels, size, size), dtype=torch.uint8)  # cut, not yet scored
    parts, done = [], 0
    for idx, images in prefetch(dataset.train.load, candidates.split(chunk)):
        if not boxes:
            boxes = draw_boxes(gen, n * m, cfg.patch_crop_scale, images.shape[-2], images.shape[-1])  # image by image
        crops = cut(images, boxes[done:done + idx.numel() * m], size, per_image=m)
        done += crops.shape[0]
        waiting = torch.cat([waiting, crops])
        ready = waiting.shape[0] // batch * batch
        if ready:
            parts.append(crop_scores(waiting[:ready], label, dataset, teachers, device, cfg.precision,
                                     cfg.channels_last, batch_size=batch))
            waiting = waiting[ready:]
    if waiting.shape[0]:
        parts.append(crop_scores(waiting, label, dataset, teachers, device, cfg.precision, cfg.channels_last,
                                 batch_size=batch))
    scores = torch.cat(parts).view(n, m)
    best = scores.argmin(dim=1)
    ranking = scores.min(dim=1).values.argsort(stable=True).tolist()
    return ClassSelection(label=label, ranked=tuple(int(candidates[r]) for r in ranking),
                          boxes=tuple(boxes[r * m + int(best[r])] for r in ranking))


def rank_position(selection: str, i: int, n: int) -> int:
    """The rank IPC index `i` takes among `n` ranked images. easy: i itself. medium: the middle
    rank, then alternately the ranks just below and above it, so that any IPC takes a window
    centred in the ranking and a larger IPC only adds ranks at its two ends. Past n the order
    starts over (a class with fewer images than the IPC reuses them)."""
    i %= n
    if selection == "easy":
        return i
    return n // 2 + (i // 2 if i % 2 == 0 else -(i + 1) // 2)


def grouped_order(selection: ClassSelection, shuffled: Sequence[int], group: int,
                  best_first: bool = False) -> list[int]:
    """The rank each IPC index takes for patch_selection = grouped: the shuffled candidates are cut
    into consecutive groups of `group`; index i takes the best-ranked image of group i, and once
    every group has given its best, the second best of each group follows, and so on. The groups
    come from the (seed, class) shuffle, so the patches are as varied as random images while each
    is the most typical of a few.

    `best_first` (patch_selection = spread): index 0 takes the class's best image (rank 0) and the
    others follow in grouped order without it. One image per class is best spent on the most
    typical; more are best spent on variety."""
    rank = {index: r for r, index in enumerate(selection.ranked)}
    groups = [sorted(rank[c] for c in shuffled[start:start + group]) for start in range(0, len(shuffled), group)]
    order = [g[level] for level in range(group) for g in groups if level < len(g)]
    return [0] + [r for r in order if r != 0] if best_first else order


def class_patch_images(dataset: ImageDataset, label: int, ipc_indices: Sequence[int], cfg: DistillConfig,
                       selection: ClassSelection | None = None) -> torch.Tensor:
    """uint8 (len(ipc_indices), C, D, D): the patches of these IPC indices of class `label`.

    With `mosaic` f > 1, IPC index i is an f x f mosaic (`tile`) of the patches the selection
    would give the indices i * f * f to i * f * f + f * f - 1 (as a function of i alone, as every
    patch is). Scored modes need the class's `selection`; "random" and "whole" need nothing but
    the data.
    """
    size = dataset.image_size
    cfg = cfg.sized(size, dataset.channels)
    per = cfg.mosaic * cfg.mosaic
    sources = [int(i) * per + j for i in ipc_indices for j in range(per)]
    images, boxes = _patch_sources(dataset, label, sources, cfg, selection)
    if cfg.mosaic > 1:
        return tile(images, boxes or [(0, 0, size)] * len(sources), size, cfg.mosaic)
    return images if boxes is None else cut(images, boxes, size)


def _patch_sources(dataset: ImageDataset, label: int, indices: list[int], cfg: DistillConfig,
                   selection: ClassSelection | None) -> tuple[torch.Tensor, list[Box] | None]:
    """The real images of the patches of these selection indices of class `label` and the box of
    each (None: the whole images, `whole`), for a config `sized` for the data."""
    if cfg.patch_selection in SCORED:
        if selection is None:
            raise ValueError(f"patch_selection {cfg.patch_selection!r} needs the class's scores (score_class)")
        n = len(selection.ranked)
        if cfg.patch_selection in ("grouped", "spread"):
            order = grouped_order(selection, _candidates(dataset, label, cfg)[0].tolist(), cfg.patch_group,
                                  best_first=cfg.patch_selection == "spread")
            positions = [order[i % n] for i in indices]
        else:
            positions = [rank_position(cfg.patch_selection, i, n) for i in indices]
        images = dataset.train.load(torch.tensor([selection.ranked[p] for p in positions], dtype=torch.long))
        return images, [selection.boxes[p] for p in positions]
    candidates, gen = _candidates(dataset, label, cfg)
    n = candidates.numel()
    images = dataset.train.load(candidates[[i % n for i in indices]])
    if cfg.patch_selection == "whole":
        return images, None
    # random: index i gets the i-th box drawn after the shuffle, whatever else is asked for.
    boxes = draw_boxes(gen, max(indices) + 1 if indices else 0, cfg.patch_crop_scale, images.shape[-2], images.shape[-1])
    return images, [boxes[i] for i in indices]


def select_patches(dataset: ImageDataset, classes: Sequence[int], ipc_indices: Sequence[int],
                   cfg: DistillConfig, teachers: Sequence[FrozenTeacher] = (),
                   device: str | torch.device = "cpu", cache: dict | None = None) -> torch.Tensor:
    """uint8 (G, B, C, D, D): the patch of each (IPC index, class) of a unit.

    `cache` (label -> ClassSelection, a dict the caller keeps) saves re-scoring a class for every
    unit that needs it; classes scored here are added to it.
    """
    cfg = cfg.sized(dataset.image_size, dataset.channels)
    per_class = []
    for label in classes:
        selection = None
        if cfg.patch_selection in SCORED:
            selection = None if cache is None else cache.get(label)
            if selection is None:
                selection = score_class(dataset, label, cfg, teachers, device)
                if cache is not None:
                    cache[label] = selection
        per_class.append(class_patch_images(dataset, label, ipc_indices, cfg, selection))
    return torch.stack(per_class, dim=1)


def score_batch_size(image_size: int, device: torch.device) -> int:
    budget = _SCORE_PIXELS["cuda" if device.type == "cuda" else "cpu"]
    return max(16, min(4096, budget // (image_size * image_size)))


def _autocast(precision: str, device: torch.device):
    """The recover loop's mixed precision (MPT) for the scoring forward: no gradients here, so
    fp16 needs no scaler."""
    if precision == "fp16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()  # not inference_mode: relaying the weights out here must leave them usable by recover
def crop_scores(crops: torch.Tensor, label: int, dataset: ImageDataset, teachers: Sequence[FrozenTeacher],
                device: str | torch.device = "cpu", precision: str = "fp32", channels_last: bool = False,
                batch_size: int | None = None) -> torch.Tensor:
    """The teachers' mean cross-entropy for `label` on each uint8 crop (lower = more typical of
    the class), in batches, under the run's precision and memory format; the BatchNorm-statistics
    hooks of recover stay idle (`FrozenTeacher.logits`)."""
    device = torch.device(device)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    for t in teachers:
        t.set_memory_format(memory_format)
    scores = []
    for chunk in crops.split(batch_size or score_batch_size(crops.shape[-1], device)):
        x = dataset.normalize(chunk).to(device).contiguous(memory_format=memory_format)
        target = torch.full((x.shape[0],), label, dtype=torch.long, device=device)
        with _autocast(precision, device):
            ce = sum(F.cross_entropy(t.logits(x).float(), target, reduction="none") for t in teachers) / len(teachers)
        scores.append(ce.float().cpu())
    return torch.cat(scores)
