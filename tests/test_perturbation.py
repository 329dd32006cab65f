"""experiments.perturbation: the reversed and the swapped change of recover, scored beside the run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from experiments.perturbation import main, perturbed_sets
from fadrm_ray.config import make_config
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_sets_reverse_the_change_and_borrow_the_next_class_change():
    labels, index = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    patches = torch.tensor([10, 20, 30, 250], dtype=torch.uint8).view(4, 1, 1, 1)
    recovered = torch.tensor([14, 18, 31, 255], dtype=torch.uint8).view(4, 1, 1, 1)  # d = 4, -2, 1, 5
    sets = perturbed_sets(patches, recovered, labels, index)
    assert sets["reversed"].flatten().tolist() == [6, 22, 29, 245]
    # class 0 takes class 1's change at the same IPC index and class 1 takes class 0's: 10+1, 20+5, 30+4, 250-2
    assert sets["another class's change"].flatten().tolist() == [11, 25, 34, 248]
    assert torch.equal(sets["patches"], patches) and torch.equal(sets["recovered"], recovered)
    clamped = perturbed_sets(torch.tensor([2], dtype=torch.uint8).view(1, 1, 1, 1),
                             torch.tensor([9], dtype=torch.uint8).view(1, 1, 1, 1), torch.tensor([0]), torch.tensor([0]))
    assert clamped["reversed"].item() == 0 and clamped["another class's change"].item() == 9  # its own class


def test_the_bench_scores_all_four_sets_with_the_same_students(digits, digits_teacher, tmp_path, capsys):
    teacher = tmp_path / "teacher.pt"
    shutil.copy(digits_teacher[0], teacher)
    cfg = make_config("fadrm", overrides={"ipc": 2, "iterations": 8, "classes": [0, 1, 2], "precision": "fp32"})
    spec = ExecutionSpec(local=True, progress=False)
    job, parts = prepare_job(cfg, digits, "digits", [teacher], tmp_path / "store", device_type=execute.device_type(spec))
    run = execute.run(job, spec, parts)
    report = main(["--run", str(run.run_dir), "--seeds", "2", "--protocol", "short", "--epochs", "1",
                   "--out", str(tmp_path / "p.json")])
    assert list(report["top1_per_seed"]) == ["patches", "recovered", "reversed", "another class's change"]
    assert all(len(v) == 2 for v in report["top1_per_seed"].values())
    change = report["pixel_change"]
    assert change["patches"] == 0 and change["recovered"] > 0 and 0 < change["reversed"] <= change["recovered"]
    assert json.loads((tmp_path / "p.json").read_text())["pixel_change"] == change
    table = capsys.readouterr().out
    assert "| reversed |" in table and "higher on" in table
