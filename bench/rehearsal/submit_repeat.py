"""`ray job submit` of one small sweep N times on a 2-node Ray cluster on 127.0.0.1.

The cluster is the one of `tests/test_deploy_rehearsal.py` (a head and a worker started with the
README's `ray start` lines, each with its own --temp-dir, a private HOME, token authentication),
and each submission is the README's sweep command with a tiny budget and the default scheduler
(ASHA), from a copy of this checkout without .git, checkpoints and caches (`--working-dir .`
there). Each job gets its own --out under one folder and its own store. A submission counts as
kept when `ray job submit` exits 0 and its --out holds results.csv (one row per trial) and
best.yaml.

    python -m bench.rehearsal.submit_repeat --teacher TEACHER.pt [--runs 10] [--root DIR]

Prints one line per submission and, last, a JSON summary (runs, kept, failures with the tail of
their log). Every process it starts is stopped by its id at the end.
"""
from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.rehearsal.deploy import REPO, Rehearsal, after_double_dash, readme_command, replace_flags

COPY_IGNORES = (".git", "*.pt", ".hypothesis", "__pycache__", "*.egg-info", ".pytest_cache", "*.parquet")


def submission(cluster: Rehearsal, teacher: Path, out: Path) -> list[str]:
    words = readme_command("sweep", "ray")
    job = replace_flags(after_double_dash(words),
                        {"--dataset": "digits", "--teacher": str(teacher), "--ipc": "1",
                         "--param": ["alpha=0.3,0.7"], "--cpus-per-trial": "1", "--gpus-per-trial": None,
                         "--out": str(out)},
                        ["--param", "iterations=8", "--param", "precision=fp32", "--seeds", "1", "--epochs", "8",
                         "--max-concurrent", "2"])
    head = [w.replace("$RAY_ADDRESS", cluster.env["RAY_ADDRESS"]) for w in words[:words.index("--") + 1]]
    return head + job


def kept(out: Path) -> str | None:
    """None when OUT holds the finished sweep, else what is missing."""
    if not (out / "results.csv").is_file():
        return "no results.csv"
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if len(rows) != 2 or not {r["state"] for r in rows} <= {"done", "stopped"}:
        return f"results.csv rows: {[r.get('state') for r in rows]}"
    if not (out / "best.yaml").is_file():
        return "no best.yaml"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--root", type=Path, default=None, help="default: a new temp folder")
    args = parser.parse_args(argv)
    root = (args.root or Path(tempfile.mkdtemp(prefix="submit-repeat-"))).absolute()
    root.mkdir(parents=True, exist_ok=True)
    copy = root / "checkout"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(*COPY_IGNORES), dirs_exist_ok=True)
    cluster = Rehearsal(Path(tempfile.mkdtemp(prefix="cluster-", dir=root)))
    results, failures = [], []
    try:
        cluster.start()
        for i in range(args.runs):
            out = root / "sweeps" / f"run-{i:02d}"
            started = time.perf_counter()
            done = subprocess.run(submission(cluster, args.teacher.absolute(), out), cwd=copy, env=cluster.env,
                                  capture_output=True, text=True, timeout=900)
            missing = kept(out) if done.returncode == 0 else f"ray job submit exited {done.returncode}"
            seconds = round(time.perf_counter() - started, 1)
            results.append({"run": i, "rc": done.returncode, "seconds": seconds, "missing": missing})
            print(f"run {i}: rc {done.returncode}, {seconds} s, {'kept' if missing is None else missing}", flush=True)
            if missing is not None:
                failures.append({"run": i, "missing": missing, "log": (done.stdout + done.stderr)[-3000:]})
    finally:
        left = cluster.close()
    print(json.dumps({"runs": args.runs, "kept": sum(r["missing"] is None for r in results), "results": results,
                      "failures": failures, "left_processes": left}))
    return 0 if not failures and not left and len(results) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
