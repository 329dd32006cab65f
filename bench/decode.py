"""Decoding speed of an ImageNet-like folder through the project's own loader.

    python -m bench.decode [--images 400] [--workers 1,2,...] [--repeat 3] [--dir DIR] [--json]

Writes a folder of JPEGs like ImageNet's photos (500x375, quality 90: a smooth colour field,
a dozen flat shapes and a fine texture, about 100 KB each), `train/<class>/*.JPEG` in 10 classes,
once under DIR (default: a temporary folder, removed at the end), opens it as
`imagefolder:DIR` and times `Split.load` of every image in batches of 256, the way patch
scoring and `sample_stats` read: files read, decoded and resized to 224 px (shorter side, center
crop). Each worker count (FADRM_DECODE_WORKERS; default 1, 2, 4, ... up to the CPUs here) runs
with one torch thread, so that N workers use N cores; the files are in the page cache (read
once before timing), so this is decoding, not the disk. Best of `--repeat` passes, the worker
counts taking turns.

Prints images/s per worker count (and images per CPU-second of the process: on a machine shared
with other work, where N workers cannot get N cores, it shows what the threads cost), the CPU,
and the projected time of the decoding in one ImageNet-1K patch-scoring pass (every one of the
1,281,167 training images decoded once) on a 16-core node, assuming linear scaling from the
measured one-worker (per-core) rate.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

IMAGENET_TRAIN = 1_281_167
NODE_CORES = 16
BATCH = 256
CLASSES = 10


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def photo_jpeg(rng, width: int = 500, height: int = 375, quality: int = 90) -> bytes:
    """JPEG bytes of a photo-like image: a smooth colour field, flat shapes, a fine texture."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    field = rng.random((12, 16, 3))
    image = Image.fromarray((field * 255).astype(np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = [x0, y0, x0 + int(rng.integers(10, 200)), y0 + int(rng.integers(10, 200))]
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    noise = np.clip(128 + 40 * rng.normal(size=(height, width, 3)), 0, 255).astype(np.uint8)
    texture = np.asarray(Image.fromarray(noise).filter(ImageFilter.GaussianBlur(0.8)), dtype=np.float32) - 128
    pixels = np.clip(np.asarray(image, dtype=np.float32) + 1.5 * texture, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def write_folder(root: Path, images: int, seed: int = 0) -> list[Path]:
    """`images` JPEGs in train/<class>/ (and one per class in val/<class>/); existing files are kept."""
    import numpy as np

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(images + CLASSES):
        split, k = ("train", i) if i < images else ("val", i - images)
        path = root / split / f"c{k % CLASSES:02d}" / f"img_{i:06d}.JPEG"
        data = photo_jpeg(rng)  # drawn even for a file that exists, so the folder is the same either way
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        paths.append(path)
    return paths


def time_load(split) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to load every image of `split` in batches of BATCH."""
    import torch

    started, cpu = time.perf_counter(), time.process_time()
    for chunk in torch.arange(len(split)).split(BATCH):
        split.load(chunk)
    return time.perf_counter() - started, time.process_time() - cpu


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=400, help="training images to write and time (default 400)")
    parser.add_argument("--workers", default="", help="worker counts, e.g. 1,2,4 (default 1, 2, 4, ... up to the CPUs)")
    parser.add_argument("--repeat", type=int, default=3, help="passes per worker count; the best is kept")
    parser.add_argument("--dir", default="", help="where to write the images (kept); default a temporary folder")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)

    import torch

    from fadrm_ray.data import get_dataset
    from fadrm_ray.data.parallel import WORKERS_ENV
    from fadrm_ray.runtime import available_cpus

    cpus = available_cpus()
    if args.workers:
        counts = [int(w) for w in args.workers.split(",") if w.strip()]
    else:
        counts = [1]
        while counts[-1] * 2 <= cpus:
            counts.append(counts[-1] * 2)
        if counts[-1] != cpus:
            counts.append(cpus)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fadrm-decode-"))
    load_before = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    saved_env = os.environ.get(WORKERS_ENV)
    try:
        log(f"writing {args.images} JPEGs under {root} ...")
        paths = write_folder(root, args.images)
        sizes = [p.stat().st_size for p in paths]
        torch.set_num_threads(1)
        dataset = get_dataset(f"imagefolder:{root}", image_size=224)
        for p in paths:  # into the page cache
            p.read_bytes()
        best = {workers: (float("inf"), 0.0) for workers in counts}
        for _ in range(args.repeat):  # the worker counts take turns, so a busy moment does not hit one alone
            for workers in counts:
                os.environ[WORKERS_ENV] = str(workers)
                best[workers] = min(best[workers], time_load(dataset.train))
        rows = []
        for workers, (seconds, cpu_seconds) in best.items():
            rows.append({"workers": workers, "seconds": seconds, "images_per_s": len(dataset.train) / seconds,
                         "images_per_cpu_s": len(dataset.train) / cpu_seconds})
            log(f"  {workers} worker(s): {rows[-1]['images_per_s']:.1f} images/s")
    finally:
        if saved_env is None:
            os.environ.pop(WORKERS_ENV, None)
        else:
            os.environ[WORKERS_ENV] = saved_env
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    one = next((r["images_per_s"] for r in rows if r["workers"] == 1), None)
    for r in rows:
        r["per_worker"] = r["images_per_s"] / r["workers"]
        r["speedup"] = r["images_per_s"] / one if one else None
    per_core = one if one else max(r["per_worker"] for r in rows)
    projected = IMAGENET_TRAIN / (per_core * NODE_CORES)
    result = {"cpu": cpu_name(), "cpus": cpus, "images": len(dataset.train), "mean_kb": sum(sizes) / len(sizes) / 1024,
              "image_size": 224, "torch_threads": 1, "load_before": load_before,
              "load_after": "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), "rows": rows, "per_core_images_per_s": per_core,
              "projection": {"images": IMAGENET_TRAIN, "cores": NODE_CORES, "seconds": projected,
                             "assumes": "linear scaling from the measured one-worker rate"}}
    print(json.dumps(result) if args.json else report(result))
    return result


def report(result: dict) -> str:
    lines = [f"CPU: {result['cpu']} ({result['cpus']} CPUs available), {result['images']} JPEGs of 500x375 "
             f"(quality 90, {result['mean_kb']:.0f} KB on average), decoded and resized to 224 px, 1 torch thread; "
             f"load average {result['load_before']} before, {result['load_after']} after",
             "", "| workers | images/s | per worker | speed-up | images per CPU-second |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(f"| {r['workers']} | {r['images_per_s']:.1f} | {r['per_worker']:.1f} | {speedup} | "
                     f"{r['images_per_cpu_s']:.1f} |")
    p = result["projection"]
    lines += ["", f"One ImageNet-1K patch-scoring pass decodes {p['images']:,} images: "
              f"{p['seconds'] / 60:.1f} min of decoding on a {p['cores']}-core node of this CPU, "
              f"assuming linear scaling from {result['per_core_images_per_s']:.1f} images/s per core."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
