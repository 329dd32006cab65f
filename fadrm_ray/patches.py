"""Real-patch selection: the images FADRM starts from and merges back to (docs/method.md section 2).

RDED-style: for class c, cut a few random square crops from each candidate image, score every
crop by the teacher's cross-entropy for c, keep each image's best crop, rank the images by that
score and take them in rank order ("easy": lowest CE first; "medium": from the middle of the
ranking). "random" takes one random crop of a random image, "whole" a random whole image (the
random-real baseline).

The patch of (class c, IPC index i) is a function of the dataset, the teacher(s), the config and
the seed only, so every worker that needs it computes the same one.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.recover import FrozenTeacher
from fadrm_ray.seeding import seeded_generator


def class_patches(dataset: ImageDataset, label: int, cfg: DistillConfig,
                  teachers: Sequence[FrozenTeacher] = (), device: str | torch.device = "cpu",
                  batch_size: int = 256) -> torch.Tensor:
    """uint8 (cfg.ipc, C, D, D): the patches of every IPC index of class `label`, in order.

    When the class has fewer candidate images than IPC, the ranking is reused from the top
    (a 10-image class at IPC 20 yields each image's best crop twice).
    """
    gen = seeded_generator("patches", cfg.seed, label)  # a function of (seed, class) only
    candidates = dataset.train.indices_of_class(label)
    if candidates.numel() == 0:
        raise ValueError(f"class {label} ({dataset.class_names[label]}) has no training images")
    candidates = candidates[torch.randperm(candidates.numel(), generator=gen)]
    if cfg.patch_candidates:
        candidates = candidates[: cfg.patch_candidates]
    n, size = candidates.numel(), dataset.image_size
    picks = [i % n for i in range(cfg.ipc)]

    if cfg.patch_selection == "whole":
        return dataset.train.load(candidates[picks])
    if cfg.patch_selection == "random":
        images = dataset.train.load(candidates[picks])
        return random_crops(images, 1, cfg.patch_crop_scale, size, gen)
    if not teachers:
        raise ValueError(f"patch_selection {cfg.patch_selection!r} scores crops with the teacher; none was given")

    images = dataset.train.load(candidates)
    crops = random_crops(images, cfg.patch_crops, cfg.patch_crop_scale, size, gen)  # (n * m, C, D, D)
    scores = crop_scores(crops, label, dataset, teachers, device, batch_size)
    best = scores.view(n, cfg.patch_crops).argmin(dim=1)
    best_crops = crops.view(n, cfg.patch_crops, *crops.shape[1:])[torch.arange(n), best]
    ranking = scores.view(n, cfg.patch_crops).min(dim=1).values.argsort(stable=True)
    start = 0 if cfg.patch_selection == "easy" else max(0, (n - cfg.ipc) // 2)
    order = ranking[[(start + p) % n for p in picks]]
    return best_crops[order]


def select_patches(dataset: ImageDataset, classes: Sequence[int], ipc_indices: Sequence[int],
                   cfg: DistillConfig, teachers: Sequence[FrozenTeacher] = (),
                   device: str | torch.device = "cpu", cache: dict | None = None) -> torch.Tensor:
    """uint8 (G, B, C, D, D): the patch of each (IPC index, class) of a unit.

    `cache` (a dict the caller keeps) saves re-scoring a class for every unit that needs it.
    """
    per_class = []
    for label in classes:
        if cache is not None and label in cache:
            patches = cache[label]
        else:
            patches = class_patches(dataset, label, cfg, teachers, device)
            if cache is not None:
                cache[label] = patches
        per_class.append(patches[list(ipc_indices)])
    return torch.stack(per_class, dim=1)


def random_crops(images: torch.Tensor, per_image: int, scale: tuple[float, float], size: int,
                 gen: torch.Generator) -> torch.Tensor:
    """`per_image` random square crops of each uint8 image, resized to `size` x `size`."""
    out = []
    _, _, h, w = images.shape
    for image in images:
        for _ in range(per_image):
            u = torch.rand(3, generator=gen).tolist()
            frac = scale[0] + (scale[1] - scale[0]) * u[0]
            side = max(1, min(h, w, int(round(math.sqrt(frac * h * w)))))
            top, left = int(u[1] * (h - side + 1)), int(u[2] * (w - side + 1))
            crop = image[:, top:top + side, left:left + side].float().unsqueeze(0)
            if side != size:
                crop = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
            out.append(crop.round().clamp(0, 255).to(torch.uint8))
    return torch.cat(out)


@torch.no_grad()
def crop_scores(crops: torch.Tensor, label: int, dataset: ImageDataset, teachers: Sequence[FrozenTeacher],
                device: str | torch.device, batch_size: int) -> torch.Tensor:
    """The teachers' mean cross-entropy for `label` on each crop (lower = more typical of the class)."""
    scores = []
    for chunk in crops.split(batch_size):
        x = dataset.normalize(chunk).to(device)
        target = torch.full((x.shape[0],), label, dtype=torch.long, device=device)
        ce = sum(F.cross_entropy(t(x)[0].float(), target, reduction="none") for t in teachers) / len(teachers)
        scores.append(ce.cpu())
    return torch.cat(scores)
