"""What a sweep's wall time goes to, and what sharing work across its trials saves.

    python -m bench.sweep [--dataset digits] [--teacher PATH] [--trials 4] [--ipc 10]
                          [--iterations 40] [--epochs 30] [--concurrent 2] [--out DIR] [--json]

Runs the same sweep of `--trials` alpha values twice through `tune.sweep.run_sweep`, each into
a fresh folder and store (so nothing is served from a cache):

- shared: as `fadrm tune` runs, the dataset and teachers put into the object store once and the
  real patches scored once for the sweep;
- per trial: every trial loads the dataset and reads the teachers itself and scores its own
  patches (`SweepRequest.share=False`).

Both without the confirmation of the best trials (`confirm_seeds=0`), the same in either, so
that the difference is the trials'.

For each it prints the wall time of the command (Ray start included), the trials' working time
(each trial's seconds from its start to its last report) and the utilization: the working time
over the wall time times the trial slots (`--concurrent`), for the whole command and for the
trial phase alone (first trial start to last trial end); the patches scored and the seconds
spent on them; and the difference of the two runs. Without --teacher, a convnet-bn teacher is
trained on the dataset once (cached in DIR/teacher).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def measure(args, teacher: str, share: bool) -> dict:
    from tune import SweepRequest, run_sweep

    out = Path(args.out) / ("shared" if share else "per-trial")
    shutil.rmtree(out, ignore_errors=True)
    alphas = [round(0.2 + 0.7 * i / max(1, args.trials - 1), 3) for i in range(args.trials)]
    request = SweepRequest(dataset=args.dataset, teachers=[teacher], out=str(out), ipc=args.ipc,
                           params=[f"alpha={','.join(map(str, alphas))}", f"iterations={args.iterations}",
                                   "precision=fp32"],
                           seeds=1, epochs=args.epochs, scheduler="fifo", max_concurrent=args.concurrent,
                           cpus_per_trial=1.0, share=share, progress=False, confirm_seeds=0)
    summary = run_sweep(request)
    if summary.interrupted:  # Tune caught a SIGINT and ended the fit: a partial sweep measures nothing
        raise KeyboardInterrupt
    rows = summary.rows
    events = _events(out)
    starts = [e["t"] for e in events if e["event"] == "trial_started"]
    ends = [e["t"] for e in events if e["event"] == "evaluated"]
    working = sum(r["trial_seconds"] for r in rows)
    phase = max(ends) - min(starts)
    wall = summary.wall_seconds
    return {
        "share": share, "trials": len(rows), "wall_seconds": wall, "trial_phase_seconds": round(phase, 2),
        "working_seconds": round(working, 2), "slots": args.concurrent,
        "utilization_command": round(working / (wall * args.concurrent), 3),
        "utilization_trial_phase": round(working / (phase * args.concurrent), 3),
        "distill_seconds_mean": round(statistics.fmean(r["distill_seconds"] for r in rows), 3),
        "trial_seconds_mean": round(statistics.fmean(r["trial_seconds"] for r in rows), 3),
        "patches_scored": summary.patches["scored"] + sum(r["patches_scored"] for r in rows),
        "patch_seconds_driver": round(summary.patches["seconds"], 3),
        "top1": {r["alpha"]: r["top1"] for r in rows},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--teacher", default=None)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--ipc", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--out", default="bench-sweep")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    teacher = args.teacher
    if teacher is None:
        from fadrm_ray.data import get_dataset
        from fadrm_ray.config import SqueezeConfig
        from fadrm_ray.squeeze import ensure_teacher

        teacher = str(ensure_teacher(get_dataset(args.dataset), SqueezeConfig(epochs=10),
                                     Path(args.out) / "teacher", progress=False).path)
    runs = [measure(args, teacher, share=True), measure(args, teacher, share=False)]
    shared, alone = runs
    saved = {"wall_seconds": round(alone["wall_seconds"] - shared["wall_seconds"], 2),
             "working_seconds": round(alone["working_seconds"] - shared["working_seconds"], 2),
             "per_trial_seconds": round(alone["trial_seconds_mean"] - shared["trial_seconds_mean"], 3),
             "patch_scorings": alone["patches_scored"] - shared["patches_scored"]}
    result = {"dataset": args.dataset, "ipc": args.ipc, "iterations": args.iterations, "student_epochs": args.epochs,
              "runs": runs, "saved_by_sharing": saved}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.trials}-trial sweep of alpha on {args.dataset}, IPC {args.ipc}, T = {args.iterations}, "
          f"student {args.epochs} epochs x 1 seed, {args.concurrent} trials at once, 1 CPU each")
    print("| sharing | wall s | trial phase s | working s | utilization (command) | utilization (trials) | "
          "distill s/trial | trial s/trial | patch classes scored |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {'shared' if r['share'] else 'per trial'} | {r['wall_seconds']:.1f} | {r['trial_phase_seconds']:.1f} | "
              f"{r['working_seconds']:.1f} | {r['utilization_command']:.0%} | {r['utilization_trial_phase']:.0%} | "
              f"{r['distill_seconds_mean']:.2f} | {r['trial_seconds_mean']:.2f} | {r['patches_scored']} |")
    print(f"saved by sharing: {saved['wall_seconds']:.1f} s of wall time, {saved['working_seconds']:.1f} s of trial "
          f"time ({saved['per_trial_seconds']:.2f} s per trial), {saved['patch_scorings']} class scorings")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
