"""Does the image representation decide how far recover moves images from their patches?

    python -m experiments.representation [--variants paper,defaults] [--quick] [--out DIR] [--json]

The published 32-px digits run fed 3-channel copies of the digits normalized with CIFAR-10's
mean and std and scored its images after conversion to grey; this project optimizes one grey
channel normalized with the data's own statistics. This benchmark distills mnist-sample (IPC 10,
T = 500, the fadrm preset with each variant's recover settings) in three representations:

- grey: the dataset as shipped (mean/std of the data);
- grey-cifar: the same grey images with CIFAR-10's mean/std;
- rgb-cifar: 3-channel copies with CIFAR-10's mean/std; the images are converted to grey
  (ITU-R 601 weights, as PIL's "L") before they are scored.

Each representation gets its own convnet-bn teacher (squeeze, 8 epochs) for recover and patch
scoring. Every image set, the recovered images and their starting patches (the same config at
zero iterations), is scored in grey by bench.accuracy's t1 teacher with the short protocol and
3 student seeds. "pixel change" is the mean absolute change of the grey images from their
patches, in [0, 1] units.

Writes DIR/representation.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.accuracy import STUDENT_STEPS, TEACHER_EPOCHS, bench_teacher
from fadrm_ray.config import EvalConfig, SqueezeConfig, make_config
from fadrm_ray.recipes import RECIPES, SMALL_IMAGE, auto_recipe
from fadrm_ray.data import get_dataset
from fadrm_ray.data.base import ImageDataset, Split
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.training import epochs_for_steps
from fadrm_ray.evaluation.evaluate import evaluate_images
from fadrm_ray.squeeze import ensure_teacher
from fadrm_ray.store import open_run

CIFAR10 = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
GREY_WEIGHTS = (0.299, 0.587, 0.114)
VARIANTS = {
    # The published recover settings, explicit (the preset's defaults depend on the image size).
    "paper": {**RECIPES[auto_recipe(SMALL_IMAGE, 1)].values, "patch_selection": "easy"},
    "defaults": {},
}


def representations(grey: ImageDataset) -> dict[str, ImageDataset]:
    def three(split: Split) -> Split:
        return Split.in_memory(split.load(torch.arange(len(split))).repeat(1, 3, 1, 1), split.labels)

    common = {"class_names": grey.class_names, "image_size": grey.image_size, "hflip": False, "info": {}}
    return {
        "grey": grey,
        "grey-cifar": ImageDataset(name=f"{grey.name}-grey-cifar", channels=1, mean=CIFAR10[0][:1],
                                   std=CIFAR10[1][:1], train=grey.train, test=grey.test, **common),
        "rgb-cifar": ImageDataset(name=f"{grey.name}-rgb-cifar", channels=3, mean=CIFAR10[0], std=CIFAR10[1],
                                  train=three(grey.train), test=three(grey.test), **common),
    }


def to_grey(images: torch.Tensor) -> torch.Tensor:
    if images.shape[1] == 1:
        return images
    w = torch.tensor(GREY_WEIGHTS).view(1, 3, 1, 1)
    return (images.float() * w).sum(1, keepdim=True).round().clamp(0, 255).to(torch.uint8)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="paper,defaults")
    parser.add_argument("--quick", action="store_true", help="tiny budgets, to check the benchmark works")
    parser.add_argument("--out", default="bench-results/representation")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    torch.set_num_threads(1)
    mode = "quick" if args.quick else "full"
    iterations, teacher_epochs = (8 if args.quick else 500), TEACHER_EPOCHS[mode]["mnist-sample"]
    grey = get_dataset("mnist-sample")
    judge, _ = bench_teacher(grey, out, "t1", teacher_epochs, log=lambda *a: None)
    evaluation = EvalConfig(epochs=epochs_for_steps(10 * grey.num_classes, STUDENT_STEPS[mode]), seeds=3)

    rows = []
    for rep_name, ds in representations(grey).items():
        teacher = ensure_teacher(ds, SqueezeConfig(model="convnet-bn", model_kwargs={"width": 64, "depth": 3},
                                                   epochs=teacher_epochs, seed=0),
                                 out / "teachers" / rep_name, progress=False)
        for variant in args.variants.split(","):
            overrides = {"ipc": 10, "ipc_per_unit": 10, "pack": 10, **VARIANTS[variant]}
            images = {}
            for t in (0, iterations):
                cfg = make_config("fadrm", overrides={**overrides, "iterations": t})
                spec = ExecutionSpec(local=True, progress=False)
                distill_job, parts = prepare_job(cfg, ds, ds.name, [teacher.path], out / "store",
                                                 device_type=execute.device_type(spec))
                run = execute.run(distill_job, spec, parts)
                x, labels, _ = open_run(run.run_dir).read()
                images[t] = (to_grey(x), labels)
            job, quiet = EvalJob(config=evaluation, teacher_paths=[judge]), EvalSpec(progress=False)
            scores = {t: evaluate_images(x, labels, job, quiet, EvalParts(dataset=grey))
                      for t, (x, labels) in images.items()}
            change = float((images[iterations][0].float() - images[0][0].float()).abs().mean() / 255)
            rows.append({"representation": rep_name, "variant": variant,
                         "patches": scores[0].top1_mean, "patches_std": scores[0].top1_std,
                         "recovered": scores[iterations].top1_mean, "recovered_std": scores[iterations].top1_std,
                         "pixel_change": round(change, 4)})
    lines = ["| representation | variant | starting patches | recovered | change | pixel change |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['representation']} | {r['variant']} | {r['patches']:.2f} ± {r['patches_std']:.2f} | "
                     f"{r['recovered']:.2f} ± {r['recovered_std']:.2f} | {r['recovered'] - r['patches']:+.2f} | "
                     f"{r['pixel_change']:.3f} |")
    report = {"iterations": iterations, "rows": rows, "table": "\n".join(lines)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "representation.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report) if args.json else report["table"])
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
