"""What `fadrm distill` estimates before it starts, against what it took.

    python -m bench.estimates --dataset SPEC --teacher PATH --out STORE [--ipc 10] [--cache DIR] [--json]
                              [-- DISTILL FLAGS]

Runs `fadrm distill --dataset SPEC --teacher PATH --ipc N --out STORE --json` as a user does (a
process of its own, the `fadrm` command's environment), into a store that must not hold the run
yet, with a fadrm cache of its own (the estimates are of a first run: a fresh folder's pilot,
then the run from nothing), and
prints, from the command's own JSON: the pilot's estimate against the seconds it took (and each
of its sets'), the run's estimate at the recipe the pilot chose against the seconds the run took,
and each ratio. Name the CPU of any figure: both estimates come from steps timed on this machine
as it was at the time, other work on it included (the load averages are printed beside them).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.decode import cpu_name
from fadrm_ray.pilot_record import PilotRecord


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--out", required=True, help="the store (the run must not be in it yet)")
    parser.add_argument("--ipc", type=int, default=10)
    parser.add_argument("--cache", default=None,
                        help="the fadrm cache the run uses (default: a new one under --out, so that no pilot of the "
                             "data is found: a first run)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="more `fadrm distill` flags, after --")
    args = parser.parse_args(argv)
    extra = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    command = [sys.executable, "-m", "actors.cli", "distill", "--dataset", args.dataset, "--teacher",
               str(Path(args.teacher).resolve()), "--ipc", str(args.ipc), "--out", str(Path(args.out).resolve()),
               "--json", *extra]
    load_before = os.getloadavg()
    started = time.perf_counter()
    cache = Path(args.cache or Path(args.out) / ".bench-cache").resolve()
    env = {**os.environ, "FADRM_CACHE": str(cache)}
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"fadrm distill exited {done.returncode}")
    said = json.loads(done.stdout)
    pilot = PilotRecord.model_validate(said["pilot"]["record"]) if "pilot" in said else None
    measured = pilot if pilot is not None and pilot.seconds else None
    rows = [] if measured is None else [r for r in [measured.random_real, *measured.rows] if r is not None]
    out = {"cpu": cpu_name(), "cpus": os.cpu_count(), "load_average_before": [round(v, 2) for v in load_before],
           "load_average_after": [round(v, 2) for v in os.getloadavg()], "dataset": args.dataset, "ipc": args.ipc,
           "flags": extra, "command_seconds": round(wall, 1),
           "pilot": None if measured is None else {
               "estimated": measured.estimated_seconds, "took": measured.seconds,
               "ratio": round(measured.seconds / measured.estimated_seconds, 3),
               "share_of_run": round(measured.estimated_seconds / measured.run_estimate_seconds, 3)
               if measured.run_estimate_seconds else None,
               "sets": {r.recipe: {"estimated": r.estimated_seconds, "took": r.seconds} for r in rows}},
           "run": None if said.get("estimated_seconds") is None else {
               "recipe": None if pilot is None else pilot.chosen, "estimated": said["estimated_seconds"],
               "took": round(said["seconds"], 1),
               "ratio": round(said["seconds"] / said["estimated_seconds"], 3)},
           "notes": [line for line in done.stderr.splitlines() if line.startswith("fadrm: note:")]}
    if args.json:
        print(json.dumps(out))
        return out
    print(f"{out['cpu']} ({out['cpus']} CPUs), load average {out['load_average_before'][0]} before, "
          f"{out['load_average_after'][0]} after; {args.dataset} at IPC {args.ipc} {' '.join(extra)}")
    print("| what | estimated s | took s | took / estimated |")
    print("|---|---|---|---|")
    if out["pilot"]:
        p = out["pilot"]
        print(f"| pilot (its estimate {p['share_of_run']}x the run's at the size's recipe) | {p['estimated']:.0f} | "
              f"{p['took']:.0f} | {p['ratio']:.2f} |")
        for name, s in p["sets"].items():
            if s["estimated"] is not None:
                ratio = s["took"] / s["estimated"]
                print(f"| pilot set {name} | {s['estimated']:.0f} | {s['took']:.0f} | {ratio:.2f} |")
    if out["run"]:
        r = out["run"]
        print(f"| run at recipe {r['recipe']} | {r['estimated']:.0f} | {r['took']:.0f} | {r['ratio']:.2f} |")
    print(f"whole command: {wall:.0f} s")
    return out


if __name__ == "__main__":
    main()
