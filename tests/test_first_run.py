"""A new user's first run on their own data: nothing silently wrong, nothing slow unasked, every
message true.

- a training folder named beside its val/ is refused, naming the parent; a split made here is
  said by the command that makes it and recorded in the run;
- bad input is refused before any Ray process starts, on the default (Ray) door;
- DD-Ranking's full-data reference says its cost first, has its own progress line, keeps to a
  step budget (the teachers' recorded top-1 stands in beyond it) and never loads a whole
  training split;
- the hard-label line says what is so in both directions; `fadrm info` shows the run's IPC;
- the loss plot's trend follows each stage.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fadrm_ray.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _png_folder(root: Path, layout: dict[str, int], classes: int = 3, size: int = 8) -> Path:
    """Grey PNGs under root/<split>/<class>/ for each split of `layout` ("" for a flat folder)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, count in layout.items():
        for c in range(classes):
            folder = root / split / f"c{c}" if split else root / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                x = (torch.rand(size, size, generator=gen) * 80 + 60 * c).clamp(0, 255).byte()
                Image.fromarray(x.numpy()).save(folder / f"{i}.png")
    return root


def test_a_training_folder_beside_its_val_folder_is_refused_naming_the_parent(tmp_path, capsys):
    from fadrm_ray.data import get_dataset
    from fadrm_ray.data.base import DatasetError

    data = _png_folder(tmp_path / "inet", {"train": 4, "val": 2})
    with pytest.raises(DatasetError, match=f"name the parent, imagefolder:{data}"):
        get_dataset(f"imagefolder:{data / 'train'}")
    assert main(["squeeze", "--dataset", f"imagefolder:{data / 'train'}", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"imagefolder:{data}" in err and "val/" in err
    assert get_dataset(f"imagefolder:{data}").split_note() is None  # its own val/ is the test split


def test_a_split_made_here_is_said_by_each_command_and_recorded_in_the_run(tmp_path, capsys, one_thread):
    from fadrm_ray.store import open_run

    data = f"imagefolder:{_png_folder(tmp_path / 'flat', {'': 10})}"
    assert main(["squeeze", "--dataset", data, "--epochs", "1", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "note: imagefolder:flat has no test split of its own: its test images are 6 of its 30 images" in err
    assert main(["distill", "--local", "--dataset", data, "--teacher", str(tmp_path / "t" / "teacher.pt"), "--ipc", "1",
                 "--set", "iterations=2", "--out", str(tmp_path / "store"), "--quiet", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "no test split of its own" in err
    recorded = open_run(json.loads(out)["run_dir"]).provenance.dataset.test_split
    assert recorded.startswith("held out per class by a fixed stratified split (20% of each class)")


def _refused_before_ray(*argvs: list[str]) -> list[tuple[int, str, bool]]:
    """Each command line through `fadrm`'s main in turn, in one fresh process: its status, what it
    wrote to stderr, and whether Ray had been imported by then."""
    code = textwrap.dedent("""
        import contextlib, io, json, sys
        from actors.cli import main
        said = []
        for argv in json.loads(sys.argv[1]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main(argv)
            said.append({'rc': rc, 'err': err.getvalue(), 'ray': 'ray' in sys.modules})
        print(json.dumps(said))
    """)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return [(s["rc"], s["err"], s["ray"]) for s in json.loads(proc.stdout.strip().splitlines()[-1])]


def test_bad_input_is_refused_before_any_ray_process_starts(digits_teacher, tmp_path):
    """The default door is Ray: a typo'd dataset path and classes the dataset has not are refused
    in one line with status 2, and Ray is never even imported."""
    teacher = str(digits_teacher[0])
    (rc, err, ray), (rc2, err2, ray2) = _refused_before_ray(
        ["distill", "--dataset", f"imagefolder:{tmp_path / 'nope'}", "--teacher", teacher, "--out",
         str(tmp_path / "store"), "--quiet"],
        ["distill", "--dataset", "digits", "--teacher", teacher, "--classes", "3,12", "--out", str(tmp_path / "store"),
         "--quiet"])
    assert (rc, ray) == (2, False) and "image folder not found" in err and len(err.strip().splitlines()) == 1
    assert (rc2, ray2) == (2, False) and "classes must be in [0, 9]" in err2 and len(err2.strip().splitlines()) == 1


def _loads_at_most(split):
    """The split, recording how many images each call of its loader asked for."""
    asked: list[int] = []
    load = split.load

    def counted(indices):
        asked.append(len(indices))
        return load(indices)

    split.load = counted
    return asked


def test_the_full_data_reference_says_its_cost_streams_its_split_and_keeps_to_its_budget(digits, tmp_path, one_thread,
                                                                                         monkeypatch):
    from dataclasses import replace

    from fadrm_ray.evaluation import ranking
    from fadrm_ray.evaluation.ranking import FULL_DATA_BATCH, full_data_student
    from fadrm_ray.config import EvalConfig

    monkeypatch.setattr(ranking, "FULL_DATA_STEPS", 40)  # a short reference student: still over 10 steps

    train = replace(digits.train)
    asked = _loads_at_most(train)
    data = replace(digits, train=train)
    notes: list[str] = []
    cfg = EvalConfig(epochs=2, seeds=1)
    # Over the budget: nothing trains, the teachers' recorded top-1 stands in, and it says so.
    ref = full_data_student(data, cfg.model_copy(update={"reference_steps": 10}), tmp_path / "refs",
                            teacher_top1=[91.5, 88.0], on_note=notes.append)
    assert ref.top1 == 91.5 and ref.source.startswith("the teacher's recorded test top-1") and not asked
    assert "over the budget of 10 steps" in notes[-1] and "91.50%" in notes[-1]
    with pytest.raises(ValueError, match="no teacher records a test top-1"):
        full_data_student(data, cfg.model_copy(update={"reference_steps": 10}), tmp_path / "refs", teacher_top1=[])
    # Within it: the cost is said first, then the student trains on batches, never the whole split.
    ref = full_data_student(data, cfg, tmp_path / "refs", on_note=notes.append)
    assert "DD-Ranking's full-data reference: a convnet-bn trained with hard labels" in notes[-1]
    assert "--no-ranking skips it" in notes[-1] and ref.source.endswith(f"(kept in {tmp_path / 'refs'})")
    assert asked and max(asked) <= 2 * FULL_DATA_BATCH < len(train)
    # Kept: asked again, nothing trains and nothing is said.
    before = (len(asked), len(notes))
    assert full_data_student(data, cfg, tmp_path / "refs", on_note=notes.append).top1 == ref.top1
    assert (len(asked), len(notes)) == before


def test_the_hard_label_line_says_what_is_so_in_both_directions():
    from fadrm_ray.evaluation.ranking import hard_label_line
    from fadrm_ray.evaluation.scores import Ranking

    below = hard_label_line(Ranking(hard_top1_per_seed=[40.0, 42.0]), soft_top1=60.0)
    assert "19.00 points below the soft-label top-1" in below and "need the teacher's soft labels" in below
    above = hard_label_line(Ranking(hard_top1_per_seed=[100.0]), soft_top1=60.0)
    assert "40.00 points at or above" in above and "need the teacher" not in above
    assert hard_label_line(Ranking(), soft_top1=60.0) is None


def test_info_shows_the_runs_ipc(small_run, capsys):
    assert main(["info", "--run", str(small_run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ipc"] == 3 and set(info["images_per_class"].values()) == {3}


def test_the_loss_trend_follows_each_stage_and_keeps_the_merges_jumps():
    from fadrm_ray.evaluation.report import trend

    steps = np.concatenate([np.linspace(10, 5, 100) + np.sin(np.arange(100)), np.linspace(8, 2, 100)])
    smooth = trend(steps, [(0, 100, 28), (100, 200, 32)])
    assert np.isfinite(smooth).all()
    assert abs(smooth[50] - 7.5) < 0.3 and abs(smooth[150] - 5.0) < 0.2
    assert smooth[101] - smooth[98] > 1.5  # the jump of the merge stays a jump
