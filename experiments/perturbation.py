"""Does the direction of recover's change matter, or only its size?

    python -m experiments.perturbation --run STORE/RUN_ID [--ipc 1] [--seeds 5] [--protocol published]

With P the run's starting patches (its config at zero iterations, distilled beside it as
`fadrm evaluate` does) and d = x - P what recover added to each image, four sets are scored by
the same students (same seeds, soft labels from the run's teachers):

- patches: P;
- recovered: P + d, the run itself;
- reversed: P - d, recover's change undone the other way;
- another class's change: P + d', where d' is the change recover made to the next class's image
  at the same IPC index (as structured as d, but aimed at another class).

Each is given with its gain over the patches seed by seed (baselines.paired_gain). If the
recovered set beats the patches and the two controls do not, recover's direction is what helps;
if all three land alike, the differences are what any change of that size does to a student.
Prints a Markdown table; `--out FILE` also writes the numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fadrm_ray.evaluation.baselines import baseline_configs, distill_baseline, gain_text, paired_gain
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.evaluation.evaluate import evaluate_images, open_for_evaluation
from fadrm_ray.runs.reopen import load_run_teachers, run_teachers
from fadrm_ray.config import EvalConfig
from fadrm_ray.settings import ConfigError
from fadrm_ray.store import open_run


def perturbed_sets(patches: torch.Tensor, recovered: torch.Tensor, labels: torch.Tensor,
                   ipc_index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The four uint8 image sets from the patches and the recovered images (same order: by label,
    then IPC index, as `RunReader.read` gives them)."""
    p, x = patches.float(), recovered.float()
    d = x - p
    classes = sorted(set(labels.tolist()))
    # For each image: the index of the image of the next class (cyclically) at the same IPC index.
    position = {(int(c), int(i)): n for n, (c, i) in enumerate(zip(labels.tolist(), ipc_index.tolist()))}
    following = {c: classes[(k + 1) % len(classes)] for k, c in enumerate(classes)}
    other = torch.tensor([position[(following[int(c)], int(i))] for c, i in zip(labels.tolist(), ipc_index.tolist())])
    return {"patches": patches, "recovered": recovered,
            "reversed": (p - d).clamp(0, 255).round().to(torch.uint8),
            "another class's change": (p + d[other]).clamp(0, 255).round().to(torch.uint8)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="STORE/RUN_ID of a run distilled from real patches")
    parser.add_argument("--ipc", type=int, default=None, help="read the run at this IPC (default: all it holds)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--protocol", choices=["short", "published"], default="published")
    parser.add_argument("--epochs", type=int, default=None, help="student epochs (default: the protocol's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per student (1, as bench.accuracy: the float rounding, and so each "
                             "student, depends on it)")
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    try:
        cfg = EvalConfig(seeds=args.seeds, protocol=args.protocol, epochs=args.epochs)
    except ConfigError as exc:
        parser.error(str(exc))

    job, spec = EvalJob(config=cfg, ipc=args.ipc), EvalSpec(threads=args.threads, progress=False)
    run = open_for_evaluation(args.run, job, spec)
    reader = run.reader
    baselines = baseline_configs(reader.config, args.ipc)
    if "starting_patches" not in baselines:
        parser.error(f"{args.run} starts from noise: it has no patches to compare with")
    dataset, teachers = run.dataset, run_teachers(reader.run_dir, reader.provenance)
    own = load_run_teachers(reader.run_dir, reader.provenance, device=spec.on_device())
    patches_run = distill_baseline(run, baselines["starting_patches"], own, job, spec)
    patches, plabels, pindex = open_run(patches_run.run_dir, ipc=patches_run.ipc).read()
    recovered, labels, index = run.images, run.labels, run.ipc_index
    if not (torch.equal(plabels, labels) and torch.equal(pindex, index)):
        parser.error("the run and its starting patches hold different images")  # not expected: same classes and IPC
    sets = perturbed_sets(patches, recovered, labels, index)
    change = {name: round(float((s.float() - patches.float()).abs().mean() / 255), 4) for name, s in sets.items()}

    # The patches and the run are store runs: their students come from (and go to) the runs'
    # evaluation caches, shared with `fadrm evaluate` and bench.accuracy. The two controls are not.
    stored = {"patches": (patches_run.run_dir, patches_run.ipc), "recovered": (reader.run_dir, args.ipc)}
    job, parts = EvalJob(config=cfg, teacher_paths=teachers), EvalParts(dataset=dataset)
    results = {}
    for name, images in sets.items():
        print(f"scoring {name} ...", file=sys.stderr, flush=True)
        if name in stored:
            run_dir, ipc = stored[name]
            ev = evaluate_store_run(run_dir, job.model_copy(update={"ipc": ipc}), spec, parts=parts).evaluation
        else:
            ev = evaluate_images(images, labels, job, spec, parts)
        results[name] = ev.top1_per_seed
    lines = ["| set | pixel change | top-1 | minus the patches, seed by seed |", "|---|---|---|---|"]
    for name, per_seed in results.items():
        gain = "" if name == "patches" else gain_text(paired_gain(per_seed, results["patches"]))
        lines.append(f"| {name} | {change[name]:.4f} | {sum(per_seed) / len(per_seed):.2f} | {gain} |")
    table = "\n".join(lines)
    print(table)
    report = {"run": str(reader.run_dir), "ipc": args.ipc, "threads": args.threads,
              "evaluation": cfg.model_dump(mode="json"), "pixel_change": change, "top1_per_seed": results,
              "table": table}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
