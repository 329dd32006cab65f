"""A sweep's result files (tune.outputs) replaced whole when they are written again (a resumed or
rerun sweep): a reader holding the old file keeps it intact, and the new one is complete."""
from __future__ import annotations

import os

import yaml

from tune.request import SweepRequest
from tune.results import TrialRow
from tune.prepare import check

FILES = ("results.csv", "results.md", "best.yaml")


def _rows(top1: dict[float, float]) -> list[TrialRow]:
    return [TrialRow(trial=f"t{i}", values={"alpha": alpha}, state="done", top1=score, top1_std=0.0,
                     top1_per_seed=[score]) for i, (alpha, score) in enumerate(top1.items())]


def test_result_files_are_replaced_whole_not_rewritten_in_place(tmp_path):
    from tune.outputs import write_results

    teacher = tmp_path / "teacher.pt"
    teacher.write_bytes(b"a checkpoint")
    p = check(SweepRequest(dataset="digits", teachers=[str(teacher)], out=str(tmp_path / "out"),
                           params=["alpha=0.3,0.5", "iterations=8"], seeds=1))
    write_results(p, _rows({0.3: 40.0, 0.5: 60.0}))
    held = {}
    for name in FILES:  # what a reader has open, as a second name of the same file
        os.link(p.out / name, tmp_path / name)
        held[name] = (tmp_path / name).read_bytes()
    write_results(p, _rows({0.3: 70.0, 0.5: 50.0}))
    for name in FILES:
        assert (tmp_path / name).read_bytes() == held[name], name  # the old file untouched
        assert not (p.out / name).samefile(tmp_path / name), name
    best = (p.out / "best.yaml").read_text()  # the new best (trial t0, alpha 0.3), whole
    assert best.startswith("# best trial t0 ") and yaml.safe_load(best)["alpha"] == 0.3
    assert (p.out / "results.csv").read_text().count("\n") == 3
    assert not [f for f in os.listdir(p.out) if f.startswith(".")]  # no temporary file left
