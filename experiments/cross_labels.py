"""Are recovered images worse in themselves, or only under the teacher that recovered them?

    python -m experiments.cross_labels --grids DIR_A,DIR_B [--ipc 10] [--methods random-real,patches,fadrm]
                                 [--seeds 5] [--protocol published] [--out DIR] [--json]

Each DIR is the output folder of a `bench.accuracy` run (its accuracy.json, store/ and t1
teacher), typically the same grid run with two different teachers (`--teacher`). Every image set
of every grid (the rows of `--methods` at `--ipc`) is evaluated with the soft labels of every
grid's t1 teacher, with the same student, protocol and seeds. If recover only fooled the teacher
it optimized against, its images would lose under that teacher's labels and not under another's.

Beside each top-1, the teacher's mean probability of the true class on student views (random
resized crops of the student's crop scale, no CutMix; 20 views of every image) says how much more
recognizable recover made the images for that teacher.

Evaluations are cached in the runs (`evaluate_store_run`), so the cells a `bench.accuracy` run already
computed with the same protocol and seeds are read, not trained again.
Writes DIR/cross_labels.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.evaluation.relabel import AugmentSpec, SoftLabeler, apply_plan, draw_plan, to_unit
from fadrm_ray.seeding import seeded_generator
from fadrm_ray.config import EvalConfig
from fadrm_ray.store import open_run

VIEWS = 20


def grid_runs(grid: Path, methods: list[str], ipc: int) -> tuple[dict[str, Path], Path]:
    """The run folders of `methods` at `ipc` in a bench.accuracy output folder, and its t1 teacher."""
    summary = json.loads((grid / "accuracy.json").read_text())
    runs = {r["method"]: grid / "store" / r["run_id"] for r in summary["results"]
            if r["ipc"] == ipc and r["method"] in methods}
    missing = [m for m in methods if m not in runs]
    if missing:
        raise SystemExit(f"{grid}/accuracy.json has no IPC {ipc} result for {', '.join(missing)}")
    (dataset,) = summary["datasets"]
    return runs, Path(summary["teachers"][dataset]["t1"]["path"])


def class_probability(run: Path, ipc: int, teacher: Path, crop_scale: tuple[float, float]) -> float:
    """Mean softmax probability of each image's own class over VIEWS student views of it."""
    images, labels, _ = open_run(run, ipc=ipc).read()
    labeler = SoftLabeler.from_paths([teacher])
    spec = AugmentSpec(out_size=images.shape[-1], crop_scale=crop_scale, cutmix_prob=0.0)
    gen = seeded_generator("cross-labels", 0)
    unit, total = to_unit(images), 0.0
    for _ in range(VIEWS):
        plan = draw_plan(torch.arange(len(images)), images.shape[-2], images.shape[-1], spec, gen)
        probs = labeler(apply_plan(unit, plan, spec.out_size)).softmax(1)
        total += float(probs.gather(1, labels.view(-1, 1)).mean())
    return total / VIEWS


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grids", required=True, help="comma-separated bench.accuracy output folders")
    parser.add_argument("--methods", default="random-real,patches,fadrm")
    parser.add_argument("--ipc", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--protocol", choices=["short", "published"], default="published")
    parser.add_argument("--out", default="bench-results/cross-labels")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    grids = [Path(g) for g in args.grids.split(",") if g]
    methods = [m for m in args.methods.split(",") if m]
    cfg = EvalConfig(seeds=args.seeds, protocol=args.protocol)
    found = {g.name: grid_runs(g, methods, args.ipc) for g in grids}
    teachers = {name: teacher for name, (_, teacher) in found.items()}

    rows = []
    for source, (runs, _) in found.items():
        for method, run in runs.items():
            for labels_by, teacher in teachers.items():
                print(f"  {source} {method} with {labels_by}'s labels", file=sys.stderr, flush=True)
                result = evaluate_store_run(run, EvalJob(config=cfg, teacher_paths=[teacher], ipc=args.ipc),
                                            EvalSpec(threads=1, progress=False)).evaluation
                rows.append({"images_from": source, "method": method, "labels_by": labels_by, "run": str(run),
                             "top1_mean": result.top1_mean, "top1_std": result.top1_std,
                             "top1_per_seed": result.top1_per_seed,
                             "class_probability": round(class_probability(run, args.ipc, teacher, cfg.crop_scale), 4)})

    header = "| images from | labels by | " + " | ".join(methods) + " | p(class) on views: " + ", ".join(methods) + " |"
    lines = [header, "|" + "---|" * (3 + len(methods))]
    for source in found:
        for labels_by in teachers:
            cells = {r["method"]: r for r in rows if r["images_from"] == source and r["labels_by"] == labels_by}
            accs = [f"{cells[m]['top1_mean']:.2f} ± {cells[m]['top1_std']:.2f}" for m in methods]
            probs = [f"{cells[m]['class_probability']:.3f}" for m in methods]
            lines.append(f"| {source} | {labels_by} | " + " | ".join(accs) + " | " + ", ".join(probs) + " |")
    table = "\n".join(lines)
    summary = {"grids": [str(g) for g in grids], "ipc": args.ipc, "seeds": args.seeds, "protocol": args.protocol,
               "teachers": {k: str(v) for k, v in teachers.items()}, "rows": rows, "table": table}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cross_labels.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary) if args.json else table)
    return summary


if __name__ == "__main__":
    main()
