"""What moves FADRM's accuracy at small scale: one knob at a time, against the two baselines.

    python -m experiments.ablation [--setting mnist-sample|digits|mnist32] [--protocol short|published]
                             [--ipc 10] [--only NAME ...] [--jobs N] [--teacher PATH] [--json]

Each row is a variant of the fadrm preset (docs/method.md sections 2-4) distilled into one store
and evaluated by `evaluate_run` with the same student, protocol, seeds and soft labels as
bench.accuracy (whose grid runner this is); the table adds random real images and each
variant's own starting patches, and the mean absolute pixel change from those patches.

Settings:
- mnist-sample: 28 px, bench.accuracy's convnet-bn teacher t1, budget T = 500;
- digits: 8 px, the same teacher architecture, T = 1000;
- mnist32: mnist-sample resized to 32 px with a resnet18-cifar teacher (15 epochs, the squeeze
  defaults), T = 200 as 4 stages of 50 iterations, alpha 0.5, lr 0.25, r_bn 0.01, jitter 4.

Writes DIR/ablation.json and DIR/ablation.md and prints the table. Every distillation and
evaluation is cached (the store, and each run's evaluations), so a rerun only computes what is new.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.accuracy import STUDENT_STEPS, Grid, bench_dataset, method_config, run_grid
from fadrm_ray.evaluation.baselines import baseline_configs
from fadrm_ray.recipes import RECIPES, SMALL_IMAGE, auto_recipe
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.config import EvalConfig
from fadrm_ray.store import open_run

# The published recover settings, explicit (the fadrm preset's defaults depend on the image size).
# the published recover settings, with the "easy" patches these rows were measured with
PUBLISHED = {**RECIPES[auto_recipe(SMALL_IMAGE, 1)].values, "patch_selection": "easy"}
WHOLE = {"patch_crop_scale": [1.0, 1.0], "patch_crops": 1}   # lowest-CE whole images
SMALL = {"lr": 0.05, "crop_scale_min": 0.5}                    # gentler steps, larger crops
DEFAULTS = dict(RECIPES[auto_recipe(SMALL_IMAGE - 1, 1)].values)  # the small-image defaults
# name -> overrides of PUBLISHED: the published settings first, then one change at a time.
VARIANTS = {
    "published settings": {},
    "+ flip": {"flip": True},
    "+ whole patches": WHOLE,
    "lr 0.05, crops >= 0.5": SMALL,
    "lr 0.02, crops >= 0.5": {"lr": 0.02, "crop_scale_min": 0.5},
    "lr 0.05, crops >= 0.8": {"lr": 0.05, "crop_scale_min": 0.8},
    "lr 0.05, crops >= 0.5, r_bn 0": {**SMALL, "r_bn": 0.0},
    "lr 0.05, crops >= 0.5, first BN x1": {**SMALL, "first_bn_weight": 1.0},
    "lr 0.05, crops >= 0.5, medium patches": {**SMALL, "patch_selection": "medium"},
    "lr 0.05, crops >= 0.5, whole patches": {**SMALL, **WHOLE},
    "lr 0.05, crops >= 0.5, random whole images": {**SMALL, "patch_selection": "whole"},
    "lr 0.05, crops >= 0.5, whole patches, alpha 0.3": {**SMALL, **WHOLE, "alpha": 0.3},
    "lr 0.05, crops >= 0.5, whole patches, r_bn 0": {**SMALL, **WHOLE, "r_bn": 0.0},
    "lr 0.05, crops >= 0.8, whole patches": {"lr": 0.05, "crop_scale_min": 0.8, **WHOLE},
    "lr 0.01, crops >= 0.5, whole patches (small-image defaults)": DEFAULTS,
    "small-image defaults, medium patches": {**DEFAULTS, "patch_selection": "medium"},
    "small-image defaults, alpha 0.3": {**DEFAULTS, "alpha": 0.3},
}
SETTINGS = {
    "mnist-sample": {"dataset": "mnist-sample", "image_size": None, "teacher_model": None, "teacher_epochs": None,
                     "t": 500, "fixed": {}},
    "digits": {"dataset": "digits", "image_size": None, "teacher_model": None, "teacher_epochs": None, "t": 1000,
               "fixed": {}},
    "mnist32": {"dataset": "mnist-sample", "image_size": 32, "teacher_model": "resnet18-cifar", "teacher_epochs": 15,
                "t": 200, "fixed": {"alpha": 0.5, "k": 3, "jitter": 4, "r_bn": 0.01}},
}


def pixel_change(run_dir: str, cfg, dataset, teacher: Path, store: Path) -> float | None:
    """Mean absolute change (in [0, 1] pixel units) of a run's images from its starting patches."""
    patches_cfg = baseline_configs(cfg).get("starting_patches")
    if patches_cfg is None or cfg.iterations == 0:
        return None
    spec = ExecutionSpec(local=True, progress=False)
    job, parts = prepare_job(patches_cfg.model_copy(update={"ipc_per_unit": cfg.ipc, "pack": cfg.ipc}), dataset,
                             dataset.name, [teacher], store, device_type=execute.device_type(spec))
    start = execute.run(job, spec, parts)
    after, _, _ = open_run(run_dir).read()
    before, _, _ = open_run(start.run_dir).read()
    return round(float((after.float() - before.float()).abs().mean() / 255), 4)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=list(SETTINGS), default="mnist-sample")
    parser.add_argument("--protocol", choices=["short", "published"], default="short")
    parser.add_argument("--ipc", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="a variant to run (repeatable; default: all)")
    parser.add_argument("--teacher", default=None, help="a checkpoint to use instead of training the setting's teacher")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--out", default=None, help="default: bench-results/ablation-<setting>")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    setting = SETTINGS[args.setting]
    names = args.only or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    # Every row takes the setting's budget T, whatever its values (a recipe's values include one).
    variants = {n: ("fadrm", {**PUBLISHED, **setting["fixed"], **VARIANTS[n], "iterations": setting["t"]})
                for n in names}
    out = Path(args.out or f"bench-results/ablation-{args.setting}")
    evaluation = EvalConfig(seeds=args.seeds, protocol=args.protocol)
    jobs = args.jobs or os.cpu_count() or 1
    started = time.perf_counter()
    grid = run_grid(out, Grid(datasets=[setting["dataset"]], ipcs=[args.ipc], methods=["random-real"] + names,
                              evaluation=evaluation, jobs=jobs, variants=variants, image_size=setting["image_size"],
                              teacher=args.teacher, teacher_model=setting["teacher_model"],
                              teacher_epochs=setting["teacher_epochs"]))
    dataset = bench_dataset(setting["dataset"], setting["image_size"])
    teacher = Path(grid["teachers"][setting["dataset"]]["t1"]["path"])
    by_name = {r["method"]: r for r in grid["results"]}
    patches_grid = Grid(datasets=[setting["dataset"]], ipcs=[args.ipc], methods=[f"patches of {n}" for n in names],
                        evaluation=evaluation, jobs=jobs,
                        variants={f"patches of {n}": ("rded", {k: v for k, v in variants[n][1].items()
                                                               if k.startswith("patch_")}) for n in names},
                        image_size=setting["image_size"], teacher=str(teacher))
    patches_rows = run_grid(out, patches_grid)["results"]
    patches = {r["method"].removeprefix("patches of "): r for r in patches_rows}
    rows = []
    real = by_name["random-real"]
    for n in names:
        r = by_name[n]
        cfg = method_config(n, args.ipc, setting["t"], {}, variants)
        change = pixel_change(str(out / "store" / r["run_id"]), cfg, dataset, teacher, out / "store")
        rows.append({"variant": n, "top1_mean": r["top1_mean"], "top1_std": r["top1_std"],
                     "patches_top1_mean": patches[n]["top1_mean"], "vs_patches": round(r["top1_mean"] - patches[n]["top1_mean"], 2),
                     "vs_random_real": round(r["top1_mean"] - real["top1_mean"], 2), "pixel_change": change,
                     "run_id": r["run_id"]})
    steps = f"{STUDENT_STEPS['full']} student steps" if args.protocol == "short" else "the published student schedule"
    lines = [f"{args.setting}, IPC {args.ipc}, {args.seeds} seeds, {steps}; random real images: "
             f"{real['top1_mean']:.2f} ± {real['top1_std']:.2f}", "",
             "| variant | top-1 | its starting patches | vs patches | vs random real | pixel change |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        change = "-" if row["pixel_change"] is None else f"{row['pixel_change']:.3f}"
        lines.append(f"| {row['variant']} | {row['top1_mean']:.2f} ± {row['top1_std']:.2f} | "
                     f"{row['patches_top1_mean']:.2f} | {row['vs_patches']:+.2f} | {row['vs_random_real']:+.2f} | {change} |")
    table = "\n".join(lines)
    report = {"setting": args.setting, "protocol": args.protocol, "ipc": args.ipc, "seeds": args.seeds,
              "random_real": real, "rows": rows, "teachers": grid["teachers"], "table": table,
              "seconds": round(time.perf_counter() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps(report, indent=2))
    (out / "ablation.md").write_text(table + "\n")
    print(json.dumps(report) if args.json else table)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
