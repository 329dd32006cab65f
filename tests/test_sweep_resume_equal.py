"""A sweep interrupted with SIGINT and resumed by the same command ends with the results of the
same sweep run without a stop: per trial, the same run in the store and the same top-1."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_sweep_truth import ROOT, interrupt_sweep, sweep_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GRID = ["--param", "alpha=0.3,0.5,0.7,0.9", "--scheduler", "fifo", "--max-concurrent", "1"]


def sweep(teacher, out: Path) -> list[str]:
    return [sys.executable, "-m", "tune.sweep", *sweep_args(teacher, out, *GRID)]


def by_alpha(out: Path) -> dict[float, tuple[str, float, str]]:
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert len(rows) == 4
    return {float(r["alpha"]): (r["run_id"], r["top1"], r["state"]) for r in rows}


def test_the_rerun_after_sigint_equals_a_sweep_that_was_not_stopped(digits_teacher, tmp_path):
    teacher = digits_teacher[0]
    stopped = tmp_path / "stopped"  # each sweep its own store (OUT/store): nothing is shared
    code, err = interrupt_sweep(sweep(teacher, stopped), stopped)
    assert code == 130, err[-3000:]
    states = json.loads((stopped / "summary.json").read_text())["states"]
    assert states["done"] < 4 and states["interrupted"] + states["pending"] >= 1, states

    again = subprocess.run(sweep(teacher, stopped), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]

    whole = tmp_path / "whole"
    straight = subprocess.run(sweep(teacher, whole), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    resumed, uninterrupted = by_alpha(stopped), by_alpha(whole)
    assert all(state == "done" for _, _, state in [*resumed.values(), *uninterrupted.values()])
    assert resumed == uninterrupted
    best = [json.loads((out / "summary.json").read_text())["best"] for out in (stopped, whole)]
    assert best[0]["top1"] == best[1]["top1"] and best[0]["run_id"] == best[1]["run_id"]
