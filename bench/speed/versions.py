"""This checkout's recover step and student epoch against another checkout's, on this CPU.

    python -m bench.speed.versions --other DIR [--rounds 3] [--steps 40] [--json]

DIR is another checkout of this project (e.g. `git worktree add /tmp/old COMMIT`). Each round runs
one fresh process per checkout, taking turns, so a change of load hits both; each process times:

- the eager recover step at pack 1 of the side-by-side setting (bench.speed.side_by_side: a random
  torchvision ResNet-18, 32 px, MRO 29/32, 10 classes, as a run configures it on this CPU, bf16
  where the CPU has it), `--steps` steps after a warm-up of every stage shape, `init_state` outside
  the timed window; and its operator calls per step, counted by torch.profiler (every recorded
  call, nested ones included) over 20 steps; each checkout's own loop, timed and profiled by this
  checkout's bench/speed/timing.py;
- a student epoch (`bench.speed.students`'s: a ResNet-18 student, 100 random images of 32 px, 10
  classes, the teacher's soft labels, AdamW, batch 16; the first epoch a warm-up).

Prints the median over rounds of each figure for both checkouts, and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run in each checkout's own process (PYTHONPATH: that checkout), with that checkout's loop (its
# bench.speed.contender, or bench.side_by_side_worker from before bench/speed/) and student epoch,
# timed and profiled by this checkout's bench/speed/timing.py, loaded by path: one clock for both.
_WORKER = r"""
import importlib.util, json, sys, tempfile
from pathlib import Path
import torch

steps, timing_file = int(sys.argv[1]), sys.argv[2]
spec = importlib.util.spec_from_file_location("this_checkouts_timing", timing_file)
timing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timing)
from fadrm_ray.recover import init_state, recover

with tempfile.TemporaryDirectory() as tmp:
    try:
        from bench.speed.contender import ContenderSetup, OurLoop, inputs
        setup = ContenderSetup(contender="ours-eager-pack1", device="cpu", size=32, batch=10, steps=steps, jitter=4,
                               overrides={"pack": 1, "compile": False}, **inputs(Path(tmp), 32, 10))
    except ModuleNotFoundError:  # a checkout from before bench/speed/
        from bench.side_by_side import OURS, Setting, _inputs
        from bench.side_by_side_worker import OurLoop
        setup = {**_inputs(Setting(device="cpu", size=32, batch=10, steps=steps), Path(tmp)),
                 "overrides": dict(OURS["ours-eager-pack1"]), "contender": "ours-eager-pack1"}
    loop = OurLoop(setup, torch.device("cpu"))

    def state(n):
        cfg = loop.config(n, pack=1, ipc=1)
        return cfg, init_state(cfg, loop.classes, [0], loop.patches.unsqueeze(0).contiguous(), loop.size, 3,
                               [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    cfg, s = state(8)
    recover(s, [loop.teacher], cfg, "cpu")  # every stage shape once
    cfg, s = state(steps)
    seconds = timing.timed(lambda: recover(s, [loop.teacher], cfg, "cpu"), "cpu")[0]
    cfg, s = state(20)
    ops = timing.profile(lambda: recover(s, [loop.teacher], cfg, "cpu"), "cpu", 20)["op_calls_per_step"]
    precision = cfg.precision

try:
    from bench.speed.students import epoch_seconds
except ModuleNotFoundError:
    from bench.student_speed import epoch_seconds
epoch = epoch_seconds("cpu", "resnet18", 32, 100, 10, 3)["seconds_per_epoch"]
print(json.dumps({"step_ms": 1000 * seconds / steps, "ops_per_step": ops, "epoch_s": epoch, "precision": precision}))
"""


def measure(tree: Path, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", _WORKER, str(steps), str(ROOT / "bench" / "speed" / "timing.py")],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{tree}: the worker failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.versions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", required=True, help="another checkout of this project")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed recover steps per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    other = Path(args.other).resolve()
    if not (other / "fadrm_ray" / "recover.py").is_file():
        parser.error(f"--other {other}: not a checkout of this project")
    trees = {"this": ROOT, "other": other}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            runs[name].append(measure(trees[name], args.steps))
            print(f"  round {r + 1} {name}: {json.dumps(runs[name][-1])}", file=sys.stderr, flush=True)
    from bench.decode import cpu_name

    summary = {"cpu": cpu_name(), "rounds": args.rounds, "other": str(other), "runs": runs}
    for key in ("step_ms", "ops_per_step", "epoch_s"):
        summary[key] = {name: statistics.median(r[key] for r in rows) for name, rows in runs.items()}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{summary['cpu']}, {args.rounds} rounds taking turns (median), precision {runs['this'][0]['precision']}")
    for key, what in (("step_ms", "recover step at pack 1, ms"), ("ops_per_step", "operator calls per step"),
                      ("epoch_s", "student epoch, s")):
        this, old = summary[key]["this"], summary[key]["other"]
        print(f"  {what:<28} this {this:9.2f}   other {old:9.2f}   this / other {this / old:.3f}")


if __name__ == "__main__":
    main()
