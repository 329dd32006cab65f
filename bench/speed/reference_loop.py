"""The reference side of bench.speed.engine_vs_reference, and the measure both sides' images get.

`reference_recover` is the published recover loop's per-iteration work (SRe2L's recover
script, which FADRM's builds on; docs/method.md sections 3-4): fp32, one batch of one image per
class at a time, the teacher in eval mode with every parameter frozen (`requires_grad = False`,
so the backward computes the input gradient only), one random-resized crop, flip and roll of the
batch, BN statistics taken in forward hooks the way the published `BNFeatureHook` takes them
(channel mean, and the variance of the input permuted and reshaped to (C, N*H*W)), Adam and the
clamp to the valid pixel range. Torch's global generator draws the augmentation. It shares no
code with `fadrm_ray.recover` on purpose: it is what the engine's speed-up is measured against,
and what tests/test_speed.py checks lowers the loss like the engine.

`image_losses` scores finished uint8 images the same way for both sides (the teacher's CE and
BN-statistics loss), so the speed comparison can say whether the faster images are as good.
"""
from __future__ import annotations

import math
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F


def reference_recover(model: nn.Module, patches: torch.Tensor, labels: torch.Tensor, cfg, mean, std,
                      seed: int, device: str = "cpu") -> torch.Tensor:
    """The published loop for one batch (one image per class), as the module docstring says.

    `patches`: uint8 (B, C, D, D); `cfg`: a resolved DistillConfig. Returns the final images,
    normalized, float32 (B, C, D, D). The random crop/flip/roll come from torch's global
    generator seeded with `seed`, so the draws differ from the engine's (same distribution).
    The teacher is frozen here, as the published script freezes it.
    """
    model.eval()
    for p in model.parameters():
        p.requires_grad = False
    torch.manual_seed(seed)
    mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=device).view(1, -1, 1, 1)
    lo, hi = (0 - mean) / std, (1 - mean) / std
    labels = labels.to(device)
    patch = (patches.to(device).float() / 255 - mean) / std
    budgets, resolutions = list(cfg.stage_iterations), list(cfg.stage_resolutions)
    total = sum(budgets)

    bn_inputs = []
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    hooks = [bn.register_forward_hook(lambda m, inp, out: bn_inputs.append((m, inp[0]))) for bn in bns]

    def resize(img, size):
        return img if img.shape[-1] == size else F.interpolate(img, size=(size, size), mode="bilinear", align_corners=False)

    x = resize(patch, resolutions[0])
    t = 0
    try:
        for s, (budget, res) in enumerate(zip(budgets, resolutions)):
            x = x.detach().clone().requires_grad_(True)
            opt = torch.optim.Adam([x], lr=cfg.lr, betas=(0.5, 0.9))
            for _ in range(budget):
                opt.param_groups[0]["lr"] = 0.5 * cfg.lr * (1 + math.cos(math.pi * t / total))
                top, left, h, w = _random_resized_crop_box(x.shape[-1], cfg.crop_scale_min)
                view = F.interpolate(x[:, :, top:top + h, left:left + w], size=(res, res), mode="bilinear",
                                     align_corners=False)
                if cfg.flip and torch.rand(1).item() < 0.5:
                    view = torch.flip(view, dims=[3])
                dy, dx = torch.randint(0, cfg.jitter + 1, (2,)).tolist()
                view = torch.roll(view, shifts=(dy, dx), dims=(2, 3))
                bn_inputs.clear()
                logits = model(view)
                ce = F.cross_entropy(logits, labels)
                bn_loss = 0.0
                for i, (m, a) in enumerate(bn_inputs):
                    weight = cfg.first_bn_weight if i == 0 else 1.0
                    channels = a.shape[1]
                    mean = a.mean([0, 2, 3])
                    var = a.permute(1, 0, 2, 3).contiguous().reshape([channels, -1]).var(1, unbiased=False)
                    bn_loss = bn_loss + weight * (torch.norm(m.running_var.data - var, 2)
                                                  + torch.norm(m.running_mean.data - mean, 2))
                loss = ce + cfg.r_bn * bn_loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    x.copy_(torch.max(torch.min(x, hi), lo))
                t += 1
            if s < len(budgets) - 1:  # resample to the next stage's size; ARC merge with the patch
                nxt = resolutions[s + 1]
                x = resize(x.detach(), nxt)
                if cfg.k > 0 and cfg.alpha < 1:
                    x = cfg.alpha * x + (1 - cfg.alpha) * resize(patch, nxt)
    finally:
        for h in hooks:
            h.remove()
    return x.detach()


def _random_resized_crop_box(size: int, scale_min: float) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box on a square image: area fraction in [scale_min, 1], aspect ratio
    log-uniform in [3/4, 4/3]; the whole image after 10 misses."""
    area = size * size
    for _ in range(10):
        target = area * (scale_min + (1 - scale_min) * torch.rand(1).item())
        aspect = math.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * torch.rand(1).item())
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= size and 0 < h <= size:
            return torch.randint(0, size - h + 1, (1,)).item(), torch.randint(0, size - w + 1, (1,)).item(), h, w
    return 0, 0, size, size


# --------------------------------------------------------------------------- measuring images
@torch.no_grad()
def image_losses(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, batch: int,
                 first_bn_weight: float = 10.0) -> dict:
    """The teacher's CE per image and the BN-statistics loss per batch of `batch` images (one
    image per class), fp32, on uint8 images: the same measure for both sides."""
    mean_t = torch.tensor(mean).view(1, -1, 1, 1)
    std_t = torch.tensor(std).view(1, -1, 1, 1)
    x = (images.float() / 255 - mean_t) / std_t
    device = next(model.parameters()).device
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    seen = []
    hooks = [bn.register_forward_hook(lambda m, inp, out: seen.append((m, inp[0]))) for bn in bns]
    ce, bn = [], []
    try:
        for chunk, y in zip(x.split(batch), labels.split(batch)):
            seen.clear()
            ce.append(F.cross_entropy(model(chunk.to(device)), y.to(device), reduction="none").cpu())
            bn.append(sum((first_bn_weight if i == 0 else 1.0)
                          * (torch.norm(a.mean(dim=(0, 2, 3)) - m.running_mean)
                             + torch.norm(a.var(dim=(0, 2, 3), unbiased=False) - m.running_var))
                          for i, (m, a) in enumerate(seen)).item())
    finally:
        for h in hooks:
            h.remove()
    ce = torch.cat(ce)
    return {"ce_mean": ce.mean().item(), "ce_median": ce.median().item(), "bn_mean": statistics.fmean(bn)}


def to_uint8(x: torch.Tensor, mean, std) -> torch.Tensor:
    mean_t = torch.tensor(mean).view(1, -1, 1, 1)
    std_t = torch.tensor(std).view(1, -1, 1, 1)
    return ((x.cpu() * std_t + mean_t).clamp(0, 1) * 255).round().to(torch.uint8)
