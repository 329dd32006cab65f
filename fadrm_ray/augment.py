"""The boxes of the random augmentations, shared by the phases that draw them.

Each phase keeps its own draws (what it takes from which generator, in which order), because
its stored results depend on that order; what they share is the arithmetic that turns draws
into a box. `crop_box` is the RandomResizedCrop of recover's views (docs/method.md section 3)
and of the student's views (relabel, section 6); `cutmix_box` is the CutMix box of the
teacher's training (squeeze, section 1) and of the student's views.
"""
from __future__ import annotations

import math

import torch


def crop_box(height: int, width: int, scale_min: float, gen: torch.Generator,
             scale_max: float = 1.0, ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """A RandomResizedCrop box (top, left, h, w) drawn from `gen`: area in [scale_min, scale_max]
    of the image, log-uniform aspect ratio, centre crop after 10 failed tries."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        u = torch.rand(4, generator=gen).tolist()
        target = area * (scale_min + (scale_max - scale_min) * u[0])
        aspect = math.exp(log_lo + (log_hi - log_lo) * u[1])
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(u[2] * (height - h + 1)), int(u[3] * (width - w + 1)), h, w
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side, side


def cutmix_box(height: int, width: int, lam: float, cy: int, cx: int) -> tuple[tuple[int, int, int, int], float]:
    """The CutMix box (y0, y1, x0, x1) for a drawn lambda and centre, clipped to the image, and
    the lambda that box really gives (1 - box area / image area), so that the mixing weight of
    the labels is the share of pixels each image keeps. An empty box is (0, 0, 0, 0), lambda 1."""
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(height * cut), int(width * cut)
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, height)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, width)
    if y1 <= y0 or x1 <= x0:
        return (0, 0, 0, 0), 1.0
    return (y0, y1, x0, x1), 1.0 - (y1 - y0) * (x1 - x0) / float(height * width)
