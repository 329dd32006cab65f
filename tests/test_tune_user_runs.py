"""Sweeps as users run them: a relative dataset path from another folder, trials that all fail,
Ctrl-C at every stage (Ray starting, the patches, a trial, the confirmation, the writing of the
results), only fadrm's own lines on the terminal, and the best config judged against its noise."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.cli import main
from tests.ray_helpers import ray_or_tune_lines
from tune.session import PAUSE_ENV

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--ipc", "1", "--param", "iterations=4", "--param", "precision=fp32", "--seeds", "1", "--epochs", "4",
        "--scheduler", "fifo"]


def _shapes(root: Path, classes: int = 3, per_class: int = 10) -> Path:
    """Grey 8 px PNGs, one folder per class (no test split: 20% of each class is held out)."""
    import torch
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for c in range(classes):
        folder = root / f"c{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            x = (torch.rand(8, 8, generator=gen) * 80 + 60 * c).clamp(0, 255).byte()
            Image.fromarray(x.numpy()).save(folder / f"{i}.png")
    return root


@pytest.mark.ray
def test_a_relative_imagefolder_path_from_another_folder_finishes_its_trials(tmp_path, monkeypatch, capsys,
                                                                              one_thread):
    """Trials run in a working folder of Ray Tune's and the driver in OUT: the relative
    `imagefolder:data/shapes` and `--teacher` name the user's folder all the same, and the same
    sweep named by absolute paths is the same sweep."""
    from fadrm_ray.config import SqueezeConfig
    from fadrm_ray.data import get_dataset
    from fadrm_ray.squeeze import squeeze

    work = tmp_path / "work"
    _shapes(work / "data" / "shapes")
    squeeze(get_dataset(f"imagefolder:{work / 'data' / 'shapes'}"), SqueezeConfig(epochs=1), out_dir=work / "t",
            progress=False)
    monkeypatch.chdir(work)
    args = ["tune", "--dataset", "imagefolder:data/shapes", "--teacher", "t/teacher.pt", *TINY,
            "--param", "alpha=0.3,0.7", "--confirm-seeds", "0", "--out", "sweep", "--json"]
    assert main(args) == 0, capsys.readouterr().err[-3000:]
    out, err = capsys.readouterr()
    assert ray_or_tune_lines(out + err) == []  # in the sweep's ray.log instead
    summary = json.loads(out)
    assert summary["states"]["done"] == 2 and not summary["failed"], summary["rows"]
    assert summary["ray_session"] == str(work / "sweep" / "ray")  # the sweep's Ray session and logs under OUT
    assert list((work / "sweep" / "ray").glob("session_*/logs"))
    assert summary["ray_log"] == str(work / "sweep" / "ray.log")
    assert "Configuration for experiment" in (work / "sweep" / "ray.log").read_text()
    saved = json.loads((work / "sweep" / "sweep.json").read_text())["identity"]
    assert saved["dataset"] == f"imagefolder:{work / 'data' / 'shapes'}"
    monkeypatch.chdir(tmp_path)  # the same sweep, named from elsewhere by absolute paths, resumes
    again = ["tune", "--dataset", f"imagefolder:{work / 'data' / 'shapes'}", "--teacher", str(work / "t" / "teacher.pt"),
             *TINY, "--param", "alpha=0.3,0.7", "--confirm-seeds", "0", "--out", str(work / "sweep"), "--json"]
    assert main(again) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["resumed"] and resumed["states"]["done"] == 2


@pytest.mark.ray
def test_a_sweep_whose_every_trial_fails_exits_1_with_the_reason_in_one_line(digits_teacher, tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["tune", "--dataset", "digits", "--teacher", str(digits_teacher[0]), *TINY, "--param", "alpha=0.5",
                 "--student", "nosuchnet", "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 1
    [said] = [line for line in stderr.splitlines() if line.startswith("fadrm tune: error:")]
    assert said.startswith("fadrm tune: error: no trial finished: 1 of 1 trials failed") and \
        "ModelError: unknown model 'nosuchnet'" in said, said
    assert "error: ModelError: unknown model 'nosuchnet'" in stdout
    md = (out / "results.md").read_text()
    [line] = [x for x in md.splitlines() if x.startswith("- trial ")]
    assert "ModelError: unknown model 'nosuchnet'" in line and line.endswith("error.txt)")
    assert "\x1b" not in md + stdout + said and "Traceback" not in md
    log = Path(line.rsplit("(", 1)[1].rstrip(")"))
    assert "in create_model" in log.read_text()  # the traceback stays in the trial's log
    assert not (out / "best.yaml").exists()


def _interrupt_when(command: list[str], *moments, timeout: float = 300, env: dict | None = None,
                    ignoring: bool = False) -> subprocess.CompletedProcess:
    """Run `command` in its own process group, send SIGINT to the group (as Ctrl-C in a terminal
    does) once each of `moments()` in turn, and return what it did. `ignoring`: started with
    SIGINT ignored, as a script's background job is (`cmd &`), which signals sent to it later
    must still stop."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignoring else None)
    try:
        deadline = time.monotonic() + timeout
        for ready in moments:
            while not ready():
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the sweep did not get there in time"
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.mark.ray
@pytest.mark.parametrize("moment", ["sweep.json", "experiment"])  # Ray starting; Tune made the trials
def test_ctrl_c_before_any_trial_started_exits_130_with_an_interrupted_results_md(moment, digits_teacher,
                                                                                  tmp_path):
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "actors.cli", "tune", "--dataset", "digits", "--teacher", str(digits_teacher[0]),
               *TINY, "--param", "alpha=0.3,0.7", "--confirm-seeds", "0", "--out", str(out)]
    done = _interrupt_when(command, lambda: (out / moment).exists())
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["states"]["done"] == 0 and summary["trials"] == 2
    assert (out / "results.md").read_text().startswith("**Interrupted**")
    assert not (out / "best.yaml").exists()
    if moment == "experiment":  # the same command resumes it
        again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads((out / "summary.json").read_text())["states"]["done"] == 2


STAGES = {"patches": "before any trial started", "trial": "during the trials",
          "confirmation": "during the confirmation of the best trials", "results": "while the results were written"}


@pytest.mark.ray
@pytest.mark.parametrize("stage", list(STAGES))
def test_ctrl_c_at_every_stage_exits_130_with_no_best_yaml_and_only_fadrms_lines(stage, digits_teacher, tmp_path):
    """SIGINT to a sweep started as a script's background job (SIGINT ignored as it starts), at a
    moment of each stage it reaches for certain (FADRM_TUNE_PAUSE: the patches' task, the trial
    and the confirmation's task wait for it; the driver waits after writing best.yaml)."""
    out, marker = tmp_path / "sweep", tmp_path / "paused"
    command = [sys.executable, "-m", "actors.cli", "tune", "--dataset", "digits", "--teacher", str(digits_teacher[0]),
               *TINY, "--param", "alpha=0.5", "--confirm-seeds", "0", "--out", str(out)]
    done = _interrupt_when(command, marker.exists, env={**os.environ, PAUSE_ENV: f"{stage}:{marker}"}, ignoring=True)
    assert done.returncode == 130, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.stdout == "" and all(line.startswith("fadrm tune: ") for line in lines), lines  # fadrm's own
    assert f"fadrm tune: interrupted {STAGES[stage]}: " in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["interrupted_during"] == STAGES[stage]
    assert (out / "results.md").read_text().startswith(f"**Interrupted** {STAGES[stage]}")
    assert not (out / "best.yaml").exists() and summary["best"] is None
    states = {s: n for s, n in summary["states"].items() if n}
    assert states == {"patches": {"pending": 1}, "trial": {"interrupted": 1}, "confirmation": {"done": 1},
                      "results": {"done": 1}}[stage]
    assert "Started a local Ray instance" in (out / "ray.log").read_text()


@pytest.mark.ray
def test_a_ctrl_c_as_the_sweep_ends_changes_nothing_and_a_second_one_loses_nothing(digits_teacher, tmp_path):
    """Ctrl-C is often pressed twice, or late. A finished sweep that gets a SIGINT as it leaves Ray
    (its files written) stays finished, best.yaml and all. The same command again (it resumes the
    finished sweep), interrupted once as Ray starts and once more while it reads Tune's saved
    experiment, is written as interrupted all the same: its finished trial in the results, and
    the best.yaml of the first run removed."""
    out, leaving, reading = tmp_path / "sweep", tmp_path / "leaving", tmp_path / "reading"
    command = [sys.executable, "-m", "actors.cli", "tune", "--dataset", "digits", "--teacher", str(digits_teacher[0]),
               *TINY, "--param", "alpha=0.5", "--confirm-seeds", "0", "--out", str(out)]
    done = _interrupt_when(command, leaving.exists, env={**os.environ, PAUSE_ENV: f"shutdown:{leaving}"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["states"]["done"] == 1 and summary["best"] is not None
    assert (out / "best.yaml").is_file()

    first = (out / "sweep.json").stat().st_ino  # rewritten whole once the pilot is done, before Ray starts
    again = _interrupt_when(command, lambda: (out / "sweep.json").stat().st_ino != first, reading.exists,
                            env={**os.environ, PAUSE_ENV: f"saved:{reading}"})
    assert again.returncode == 130, again.stderr[-3000:]
    assert "fadrm tune: interrupted while Ray started: 1 of 1 trials finished" in again.stderr, again.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["interrupted_during"] == "while Ray started"
    assert summary["states"]["done"] == 1 and summary["best"] is None
    assert (out / "results.md").read_text().startswith("**Interrupted** while Ray started")
    assert not (out / "best.yaml").exists()


# --------------------------------------------------------------------------- no Ray
def test_a_pause_at_a_stage_the_sweep_does_not_have_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    """FADRM_TUNE_PAUSE with a misspelt stage (or no FILE) would wait for a pause that never
    comes: refused in one line, exit 2, before anything is made."""
    for value in (f"result:{tmp_path / 'paused'}", "trial"):
        monkeypatch.setenv(PAUSE_ENV, value)
        code = main(["tune", "--dataset", "digits", "--teacher", str(tmp_path / "t.pt"), "--param", "alpha=0.5",
                     "--out", str(tmp_path / "sweep")])
        assert code == 2
        assert capsys.readouterr().err == (f"fadrm tune: error: {PAUSE_ENV}={value!r}: give STAGE:FILE, STAGE one of "
                                           f"patches, trial, confirmation, results, shutdown, saved; or unset it\n")
    assert not (tmp_path / "sweep").exists()


def test_a_trials_error_is_one_line_without_colours_or_traceback():
    from ray.tune.error import TuneError

    from tune.results import error_line

    text = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n\x1b[36mray::run_trial()\x1b[39m "
            "(pid=1, ip=127.0.0.1)\n  File \"y.py\", line 2, in g\nfadrm_ray.data.base.DatasetError: cannot read "
            "image file data/c0/5.png: [Errno 2] No such file or directory\n")
    assert error_line(TuneError(text)) == ("DatasetError: cannot read image file data/c0/5.png: [Errno 2] No such "
                                          "file or directory")
    assert error_line(ValueError("alpha\nmust be > 0")) == "ValueError: alpha must be > 0"
    assert error_line(None) is None


def _rows(*trials):
    from tune.results import TrialRow

    return [TrialRow(trial=t, values={"alpha": a}, state="done", top1=top1, top1_per_seed=[top1], run_id=f"r{t}")
            for t, a, top1 in trials]


def _again(trial, seeds, top1, random=None):
    from tune.settings import Reevaluated

    return Reevaluated(trial=trial, run_id=f"r{trial}", seeds=seeds, top1_per_seed=top1, random_real_per_seed=random)


def test_the_best_is_judged_on_new_seeds_against_the_runner_up_and_random_real_images():
    from types import SimpleNamespace

    from tune.confirm import judge
    from tune.space import parse_space, split_space

    p = SimpleNamespace(swept=split_space(parse_space(["alpha=0.3,0.5,0.7"]))[1])
    done = _rows(("a", 0.3, 70.0), ("b", 0.5, 69.0), ("c", 0.7, 60.0))
    again = {"a": _again("a", [0, 1, 2, 3], [70.0, 60.0, 62.0, 61.0], [50.0, 50.5, 51.0, 52.0]),
             "b": _again("b", [0, 1, 2, 3], [69.0, 61.5, 61.0, 62.0]),
             "c": _again("c", [0, 1, 2, 3], [60.0, 55.0, 55.5, 56.0])}
    c = judge(p, done, done, again, [0], [1, 2, 3], shared=True)
    assert c.best == "b" and c.seeds == [1, 2, 3] and c.new_seeds  # ahead on the seeds that did not pick it
    assert c.random_real_per_seed == [50.5, 51.0, 52.0]
    assert not c.vs_runner_up.clearly_above and c.vs_random.clearly_above
    text = "\n".join(c.lines)
    assert "Trial a led on the trials' own seeds; on these seeds trial b is ahead." in text
    assert "level with the runner-up (within two standard errors)" in text
    assert "above random real images by more than two standard errors" in text


def test_two_seeds_give_no_standard_error_and_no_verdict():
    """`--confirm-seeds 0` on trials of two seeds: the comparisons are on those two seeds, whose
    standard error rests on one difference; none is written ("± 0.00 s.e." on two seeds that agree
    would read as certain), and nothing is called above, below or level."""
    from types import SimpleNamespace

    from tune.confirm import judge
    from tune.space import parse_space, split_space

    p = SimpleNamespace(swept=split_space(parse_space(["alpha=0.3,0.5"]))[1])
    done = [row.model_copy(update={"top1_per_seed": seeds}) for row, seeds in
            zip(_rows(("a", 0.3, 70.0), ("b", 0.5, 69.0)), ([70.0, 70.0], [69.0, 69.0]))]
    again = {"a": _again("a", [0, 1], [70.0, 70.0], [60.0, 60.0])}
    c = judge(p, done, done[:1], again, [0, 1], [], shared=True)
    assert c.best == "a" and not c.new_seeds and c.trials[0].stderr is None
    text = "\n".join(c.lines)
    assert "±" not in text and "two standard errors" not in text and "no usable s.e. on 2 seeds" in text
    assert "2 seeds give no usable standard error, so the seeds cannot tell it from the runner-up" in text
    assert "2 seeds give no usable standard error, so the seeds cannot tell it from random real images" in text
