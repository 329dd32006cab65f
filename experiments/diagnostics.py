"""The paper's claims about ARC, at small scale (docs/method.md sections 4 and 6).

    python -m experiments.diagnostics [--dataset digits] [--budgets 0,100,300,1000,3000] [--set KEY=VALUE] [--quick] [--json]

1. Information vanishing: student top-1 against the total recover budget, with ARC (fadrm) and
   without (sre2l++ at the same precision), IPC 10, the same teacher, student and protocol as
   bench.accuracy (1000 student steps, 3 seeds).
2. What each ARC merge does: the cosine similarity of the teacher's features before and after
   the merge, the teacher's top-1 on the images, and their feature cosine to the real patch.

The teacher is bench.accuracy's t1 (trained here when missing, cached in --out). Writes
information_vanishing.{json,png} and arc_merges.{json,png} to --out and prints both tables.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.accuracy import BUDGETS, STUDENT_STEPS, TEACHER_EPOCHS, bench_teacher
from experiments.arc_diagnostics import arc_merge_effect, information_vanishing
from fadrm_ray.config import ConfigError, make_config, parse_overrides
from fadrm_ray.data import get_dataset
from fadrm_ray.evaluation.eval_job import EvalJob
from fadrm_ray.evaluation.training import epochs_for_steps
from fadrm_ray.config import EvalConfig


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--ipc", type=int, default=10)
    parser.add_argument("--budgets", default=None, help="comma-separated total recover budgets "
                        "(default 0,100,300,1000,3000; quick 0,100,400)")
    parser.add_argument("--seeds", type=int, default=None, help="student seeds (default 3; quick 2)")
    parser.add_argument("--quick", action="store_true", help="three budgets, two seeds, 300 student steps")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a recover config override for every run (e.g. crop_scale_min=0.5)")
    parser.add_argument("--out", default="bench-results/diagnostics")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    mode = "quick" if args.quick else "full"
    try:
        overrides = parse_overrides(args.overrides)
        make_config("fadrm", overrides=overrides)  # reject a bad key or value before any work
    except ConfigError as exc:
        parser.error(str(exc))
    budgets = [int(b) for b in (args.budgets or ("0,100,400" if args.quick else "0,100,300,1000,3000")).split(",") if b]
    seeds = args.seeds or (2 if args.quick else 3)
    out = Path(args.out)
    torch.set_num_threads(1)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    dataset = get_dataset(args.dataset)
    teacher, teacher_top1 = bench_teacher(dataset, out, "t1", TEACHER_EPOCHS[mode][dataset.name], log)
    epochs = epochs_for_steps(dataset.num_classes * args.ipc, STUDENT_STEPS[mode])
    vanishing = information_vanishing(dataset, teacher, EvalJob(config=EvalConfig(epochs=epochs, seeds=seeds)),
                                      budgets=budgets, ipc=args.ipc, out_dir=out, overrides=overrides)
    merges = arc_merge_effect(dataset, teacher, ipc=min(args.ipc, 4), iterations=BUDGETS[mode][dataset.name],
                              overrides=overrides, out_dir=out)
    report = {"dataset": dataset.name, "teacher_top1": teacher_top1, "student_epochs": epochs, "overrides": overrides,
              "information_vanishing": vanishing, "arc_merges": merges}
    if args.json:
        print(json.dumps(report, default=str))
        return report
    print(f"Information vanishing: {dataset.name}, IPC {args.ipc}, {seeds} seeds, teacher top-1 {teacher_top1:.2f}"
          + (f", recover overrides {overrides}" if overrides else ""))
    print("| budget | " + " | ".join(str(b) for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for key, label in (("arc", "with ARC (fadrm)"), ("no_arc", "without ARC (sre2l++)")):
        print(f"| {label} | " + " | ".join(f"{r['top1_mean']:.2f} ± {r['top1_std']:.2f}" for r in vanishing[key]) + " |")
    print(f"\nARC merges ({dataset.name}, T={BUDGETS[mode][dataset.name]}):")
    print("| merge | feature cosine before/after | teacher top-1 before -> after | cosine to patch before -> after |")
    print("|---|---|---|---|")
    for m in merges["merges"]:
        print(f"| stage {m['stage']} (after it. {m['after_iteration']}) | {m['cosine_mean']:.3f} (min {m['cosine_min']:.3f}) "
              f"| {m['acc_before']:.1f} -> {m['acc_after']:.1f} | {m['patch_cosine_before']:.3f} -> "
              f"{m['patch_cosine_after']:.3f} |")
    print(f"\nplots: {vanishing['png']}, {out / 'arc_merges.png'}")
    return report


if __name__ == "__main__":
    main()
