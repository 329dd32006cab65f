"""`fadrm evaluate` says its whole plan before it trains: each set, its students (kept ones read
back), its estimated seconds and the flag that skips it, and the total; and at the end what the
planned sets took."""
from __future__ import annotations

import json
import re

import pytest

from fadrm_ray.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _evaluate(capsys, run, *flags) -> tuple[dict, list[str], str]:
    assert main(["evaluate", "--run", str(run), "--seeds", "2", "--epochs", "2", "--set", "reference_steps=10",
                 "--quiet", "--json", *flags]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), [line for line in err.splitlines() if line.startswith("fadrm evaluate:")], err


def test_evaluate_says_its_plan_first_and_what_the_planned_sets_took(run_copy, capsys):
    said, lines, err = _evaluate(capsys, run_copy)
    # The plan comes before anything else it says, one line per set with its cost and its flag.
    assert re.match(r"fadrm evaluate: plan: 8 convnet-bn students in 5 sets, about [\d.]+ s ", lines[0]), lines
    sets = {s["name"]: s for s in said["plan"]["sets"]}
    assert list(sets) == ["the run", "random real images", "its starting patches", "DD-Ranking's full-data reference",
                          "DD-Ranking's hard-label students on the run's images"]
    assert [sets[n]["students"] for n in sets] == [2, 2, 2, 0, 2]
    assert "the teacher's recorded test top-1 stands in" in sets["DD-Ranking's full-data reference"]["detail"]
    assert all(s["seconds"] > 0 for s in said["plan"]["sets"] if s["students"])
    for line, planned in zip(lines[1:6], said["plan"]["sets"]):
        assert line.startswith(f"fadrm evaluate:   {planned['name']}: ") and re.search(r"; --[a-z-]+ ", line), line
    assert "distilled first" in sets["random real images"]["first"]
    assert said["planned_sets_seconds"] > 0 and said["seconds"] >= said["planned_sets_seconds"]
    # The notes that used to announce each set as it started are not said again.
    assert not any(line.startswith("fadrm evaluate: baselines:") for line in lines)
    # Asked again: everything is kept, and the plan says so (nothing to train).
    again, lines, _ = _evaluate(capsys, run_copy)
    assert [(s["students"], s["kept"]) for s in again["plan"]["sets"]] == [(0, 2), (0, 2), (0, 2), (0, 0), (0, 2)]
    assert "distilled already" in again["plan"]["sets"][1]["first"]
    assert again["top1_per_seed"] == said["top1_per_seed"]
    # Without the baselines (and so without DD-Ranking's scores), one set.
    alone, lines, _ = _evaluate(capsys, run_copy, "--no-baselines", "--seeds", "3")
    assert [(s["name"], s["students"], s["kept"]) for s in alone["plan"]["sets"]] == [("the run", 1, 2)]
