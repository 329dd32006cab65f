"""What the commands say about a run, and that it is so: a named recipe is the user's, `fadrm info`
shows the run's IPC and survives a pipe that closes early, a cluster job names its relative
paths, the loss plot's trend follows each stage."""
from __future__ import annotations

import json
import sys

import numpy as np

from fadrm_ray.cli import main
from tests.folder_helpers import colour_folder, squeezed_teacher


def test_a_named_recipe_is_said_to_be_the_users(tmp_path, capsys, one_thread):
    from fadrm_ray.recipes import recipe_reason

    assert recipe_reason("cifar", 32, 3, given=True).startswith("cifar, as set (auto takes cifar for 3-channel")
    assert "auto's choice" not in recipe_reason("cifar", 32, 3, given=True)
    data = colour_folder(tmp_path / "c", 3, per_class=5)
    squeezed_teacher(data, tmp_path)
    assert main(["distill", "--local", "--dataset", f"imagefolder:{data}", "--teacher", str(tmp_path / "t" / "teacher.pt"),
                 "--ipc", "1", "--set", "recipe=cifar", "--set", "iterations=2", "--out", str(tmp_path / "store"),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if text.startswith("recipe:"))
    assert line.startswith("recipe: cifar, as set") and "auto's choice" not in line
    run_dir = next(p for p in (tmp_path / "store").iterdir() if (p / "config.yaml").is_file())
    assert main(["info", "--run", str(run_dir)]) == 0
    assert "cifar, as set" in capsys.readouterr().out


def test_info_shows_the_runs_ipc(small_run, capsys):
    assert main(["info", "--run", str(small_run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ipc"] == 3 and set(info["images_per_class"].values()) == {3}


def test_info_in_a_pipe_that_closes_early_is_not_an_error(small_run, monkeypatch, capsys):
    """`fadrm info | head -1`: the reader leaves, the next write fails with EPIPE."""
    import io

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["info", "--run", str(small_run)]) == 0
    monkeypatch.undo()
    assert "Broken pipe" not in capsys.readouterr().err


def test_a_cluster_job_names_its_relative_paths():
    from actors.job import relative_paths

    argv = ["distill", "--dataset", "imagefolder:data/x", "--teacher", "/abs/t.pt", "--teacher", "t2.pt",
            "--out", "store", "--dataset", "cifar100"]
    assert relative_paths(argv) == ["--dataset imagefolder:data/x", "--teacher t2.pt", "--out store"]


def test_the_loss_trend_follows_each_stage_and_keeps_the_merges_jumps():
    from fadrm_ray.evaluation.report import trend

    steps = np.concatenate([np.linspace(10, 5, 100) + np.sin(np.arange(100)), np.linspace(8, 2, 100)])
    smooth = trend(steps, [(0, 100, 28), (100, 200, 32)])
    assert np.isfinite(smooth).all()
    assert abs(smooth[50] - 7.5) < 0.3 and abs(smooth[150] - 5.0) < 0.2
    assert smooth[101] - smooth[98] > 1.5  # the jump of the merge stays a jump
