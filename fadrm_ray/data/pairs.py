"""`pairs10`: a colour dataset drawn here, offline, whose classes no crop can tell apart.

    python -m fadrm_ray.data.pairs --out DIR [--train-per-class 200] [--test-per-class 60]

writes `DIR/train/<class>/<i>.png` and `DIR/val/<class>/<i>.png` (32 x 32 RGB), which
`imagefolder:DIR` reads. Each image holds two shapes, one near its top-left corner and one near
its bottom-right; a class is the ordered pair (disc then square, square then disc...), so the
pairs that swap their shapes differ only in where each shape is. Everything else varies within
a class: three background styles (flat, gradient, speckled), the shapes' colours, sizes and
places, two small distractor blobs and pixel noise. A teacher that sees whole images learns it
easily; a crop that keeps one corner keeps half of the answer. It stands for the data where
teacher-picked crops lose to random real images (docs/benchmarks/accuracy.md, "The pilot").
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 32
SHAPES = ("disc", "square", "triangle", "ring", "cross")
# Ordered pairs (top-left, bottom-right): five swapped pairs.
PAIRS = ((0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1), (3, 4), (4, 3), (3, 0), (0, 3))
CLASS_NAMES = [f"{SHAPES[a]}-{SHAPES[b]}" for a, b in PAIRS]


def _colour(rng: np.random.Generator, low: int, high: int) -> tuple[int, int, int]:
    return tuple(int(v) for v in rng.integers(low, high, 3))


def _shape(pen: ImageDraw.ImageDraw, kind: int, box: tuple[int, int, int, int], colour) -> None:
    x0, y0, x1, y1 = box
    if kind == 0:
        pen.ellipse(box, fill=colour)
    elif kind == 1:
        pen.rectangle(box, fill=colour)
    elif kind == 2:
        pen.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=colour)
    elif kind == 3:
        pen.ellipse(box, outline=colour, width=3)
    else:
        w = max(2, (x1 - x0) // 3)
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        pen.rectangle((cx - w // 2, y0, cx + w // 2, y1), fill=colour)
        pen.rectangle((x0, cy - w // 2, x1, cy + w // 2), fill=colour)


def draw(label: int, rng: np.random.Generator) -> Image.Image:
    """One image of class `label`, every nuisance drawn from `rng`."""
    style = int(rng.integers(0, 3))
    if style == 0:
        base = np.broadcast_to(np.array(_colour(rng, 120, 256), dtype=np.float32), (SIZE, SIZE, 3)).copy()
    elif style == 1:
        a, b = np.array(_colour(rng, 100, 256), np.float32), np.array(_colour(rng, 100, 256), np.float32)
        t = np.linspace(0, 1, SIZE, dtype=np.float32)[:, None, None]
        base = np.broadcast_to(a * (1 - t) + b * t, (SIZE, SIZE, 3)).copy()
    else:
        base = np.array(_colour(rng, 130, 230), np.float32) + rng.normal(0, 25, (SIZE, SIZE, 3)).astype(np.float32)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    pen = ImageDraw.Draw(image)
    for _ in range(2):  # distractors
        x, y = (int(v) for v in rng.integers(0, SIZE - 3, 2))
        pen.ellipse((x, y, x + 3, y + 3), fill=_colour(rng, 0, 256))
    for kind, corner in zip(PAIRS[label], (0, 1)):
        side = int(rng.integers(9, 14))
        offset = rng.integers(1, 6, 2)
        x0, y0 = (int(v) for v in (offset if corner == 0 else SIZE - 1 - side - offset))
        _shape(pen, kind, (x0, y0, x0 + side, y0 + side), _colour(rng, 0, 110))
    noisy = np.asarray(image, np.float32) + rng.normal(0, 6, (SIZE, SIZE, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def write(out: str | Path, train_per_class: int = 200, test_per_class: int = 60, seed: int = 0,
          classes: int = len(PAIRS)) -> Path:
    """Write the folder (train/ and val/) of the first `classes` classes; returns it. The same
    arguments write the same pixels."""
    out = Path(out)
    for split, count, offset in (("train", train_per_class, 0), ("val", test_per_class, 1)):
        for label, name in enumerate(CLASS_NAMES[:classes]):
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            rng = np.random.default_rng([seed, offset, label])
            for i in range(count):
                draw(label, rng).save(folder / f"{i:04d}.png")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-per-class", type=int, default=200)
    parser.add_argument("--test-per-class", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--classes", type=int, default=len(PAIRS), help=f"the first N classes (default {len(PAIRS)})")
    args = parser.parse_args(argv)
    path = write(args.out, args.train_per_class, args.test_per_class, args.seed, args.classes)
    print(f"imagefolder:{path.resolve()}")


if __name__ == "__main__":
    main()
