"""bench.speed.side_by_side: the published recover loop and ours, each in its own process, on one device.

The published code is not part of this project: tests/data/published-standin is a stand-in with
the names the worker imports from it (a few lines each), so the published contender runs on
every CI run; with a checkout of the real code in $FADRM_OFFICIAL, its loop runs beside ours too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "data" / "published-standin"


def side_by_side(*flags: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.speed.side_by_side", "--device", "cpu", "--size", "16", "--batch", "4",
                          "--steps", "8", "--rounds", "2", "--json", *flags], cwd=ROOT, check=True,
                         stdout=subprocess.PIPE, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_published_code_is_asked_for_by_name():
    bad = subprocess.run([sys.executable, "-m", "bench.speed.side_by_side", "--official", str(ROOT / "tests")], cwd=ROOT,
                         stderr=subprocess.PIPE, text=True)
    assert bad.returncode == 2 and "recover/utils_recover.py" in bad.stderr


def test_the_published_contender_runs_beside_ours_through_the_standin():
    """The path a GPU run takes (bench/gpu_check.sh with the published code present): the
    published loop, like for like (no antialias, cuDNN autotuning asked for), beside ours; per-step
    figures and one whole schedule each."""
    out = side_by_side("--official", str(STANDIN), "--published", "official-like", "--ours", "ours-eager-pack1",
                       "--schedule", "16")
    assert out["official_ms"] is None and out["ratio_pack1"] is None  # `official` (as released) did not run
    official, ours = out["contenders"]["official-like"], out["contenders"]["ours-eager-pack1"]
    for row in (official, ours):
        assert row["pack"] == 1 and row["finite"] and len(row["rounds_ms"]) == 2 and row["ms_per_step"] > 0
        assert row["seconds_per_image_at_T2000"] == pytest.approx(row["ms_per_step"] / 1000 * 2000 / 4)
        assert row["schedule"]["steps"] == 16
        assert row["schedule"]["seconds_per_image"] == pytest.approx(row["schedule"]["seconds"] / 4)
    assert out["published_best"] == "official-like" and out["published_best_ms"] == official["ms_per_step"]
    assert out["ratios"]["official-like"]["ours-eager-pack1"] == pytest.approx(official["ms_per_step"] / ours["ms_per_step"])
    assert out["ours_pack1_ms"] == out["ours_best_ms"] == ours["ms_per_step"]
    assert out["device"] == "cpu" and out["torch"] and out["cpu"]


@pytest.mark.skipif(not os.environ.get("FADRM_OFFICIAL"), reason="no checkout of the published code in $FADRM_OFFICIAL")
def test_the_published_loop_runs_beside_ours():
    out = side_by_side("--official", os.environ["FADRM_OFFICIAL"], "--ours", "ours-eager-pack1")
    assert out["official_ms"] > 0 and out["contenders"]["official"]["finite"]
    assert out["ratio_pack1"] == pytest.approx(out["official_ms"] / out["ours_pack1_ms"])
