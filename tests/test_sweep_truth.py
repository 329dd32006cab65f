"""`fadrm tune` says what happened: bad commands refused in one line before anything heavy loads,
interrupted sweeps marked and resumable, pruned trials drawn, and results written wherever the
driver started."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from actors.cli import main
from fadrm_ray.settings import ConfigError
from tune.plots import colour_range, heatmap_cells, key_figure
from tune.results import TrialRow, not_made
from tune.space import parse_space, split_space
from tune.prepare import trial_count
from tune.request import SweepRequest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--ipc", "1", "--param", "iterations=8", "--param", "precision=fp32", "--seeds", "1", "--epochs", "8"]


def sweep_args(teacher, out, *extra):
    return ["--dataset", "digits", "--teacher", str(teacher), *TINY, "--out", str(out), *extra]


def events(out: Path, name: str) -> list[dict]:
    path = out / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name] if path.is_file() else []


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# --------------------------------------------------------------------------- the request
@pytest.mark.parametrize("flags, message", [
    (["--samples", "0"], "--samples must be an integer >= 1, got 0"),
    (["--cpus-per-trial", "0"], "--cpus-per-trial must be a number > 0, got 0.0"),
    (["--gpus-per-trial", "-1"], "--gpus-per-trial must be a number >= 0, got -1.0"),
    (["--workers-per-trial", "0"], "--workers-per-trial must be an integer >= 1, got 0"),
    (["--max-concurrent", "0"], "--max-concurrent must be an integer >= 1, got 0"),
    (["--ipc", "0"], "--ipc must be an integer >= 1, got 0"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--seeds", "0"], "--seeds must be an integer >= 1, got 0"),
    (["--confirm-seeds", "2"], "--confirm-seeds must be 0 (the best compared on the trials' own seeds) or at least "
                               "3: the standard error of 2 seeds is not usable, got 2"),
])
def test_a_bad_flag_is_refused_in_one_line_naming_the_flag(flags, message, tmp_path, capsys, digits_teacher):
    code = main(["tune", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--out", str(tmp_path / "o"),
                 *flags])
    assert code == 2
    assert one_error_line(capsys) == f"fadrm tune: error: {message}"
    assert not (tmp_path / "o").exists()


def test_request_errors_name_the_flag_the_cli_uses():
    base = {"dataset": "digits", "teachers": ["t.pt"], "out": "o"}
    with pytest.raises(ConfigError, match=r"^--search must be one of grid, random, optuna, got 'x'$"):
        SweepRequest(**base, search="x")
    with pytest.raises(ConfigError, match=r"^--protocol must be one of short, published, got 'long'$"):
        SweepRequest(**base, protocol="long")
    with pytest.raises(ConfigError, match=r"^--teacher must be"):
        SweepRequest(**{**base, "teachers": "t.pt"})
    with pytest.raises(ConfigError, match=r"^--classes must not repeat"):
        SweepRequest(**base, classes=[1, 1])
    with pytest.raises(ConfigError, match="unknown sweep setting"):
        SweepRequest(**base, alpha=0.5)
    request = SweepRequest(**base)
    with pytest.raises(ValidationError, match="frozen"):  # a request is what was asked, not a scratch pad
        request.samples = 3


def test_the_identity_of_a_request_is_what_saved_sweeps_hold():
    """sweep.json of sweeps made before keeps this mapping; a rerun resumes only if it is equal."""
    request = SweepRequest(dataset="digits", teachers=["t.pt"], out="o", ipc=2, classes=[0, 3], seed=1,
                           params=["alpha=0.3,0.5"], samples=2, seeds=2, eval_set=["lr=0.01"], cpus_per_trial=2)
    assert json.loads(json.dumps(request.identity())) == {
        "dataset": "digits", "teachers": ["t.pt"], "preset": "fadrm", "ipc": 2, "classes": [0, 3], "seed": 1,
        "params": ["alpha=0.3,0.5"], "space_file": None, "samples": 2, "search": "grid", "scheduler": "asha",
        "metric": "top1", "student": None, "seeds": 2, "epochs": None, "protocol": None, "eval_set": ["lr=0.01"]}


@pytest.mark.parametrize("uri", ["s3://bucket/x", "gs://b/sweeps", "file:///tmp/x"])
def test_a_uri_for_out_is_refused_and_creates_nothing(uri, tmp_path, capsys, digits_teacher, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["tune", *sweep_args(digits_teacher[0], uri)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("fadrm tune: error: --out must be a local or mounted folder") and uri in line
    assert list(tmp_path.iterdir()) == []  # no folder named "s3:"


# --------------------------------------------------------------------------- the space
@pytest.mark.parametrize("params, text", [
    (["alpha=0.3,0.3"], "--param alpha: the value 0.3 is given twice"),
    (["alpha=0.3,0.30"], "--param alpha: the value 0.3 is given twice"),
    (["stage_resolutions=[6,8],[6,8]"], "the value [6, 8] is given twice"),
    (["r_bn=choice(0.01,0.01)"], "--param r_bn: the value 0.01 is given twice"),
    (["alpha=0.3", "alpha=0.5"], "--param alpha is given twice"),
])
def test_repeated_values_and_keys_are_refused(params, text):
    with pytest.raises(ConfigError) as caught:
        parse_space(params)
    assert text in str(caught.value) and "\n" not in str(caught.value)


def test_a_repeated_param_is_refused_by_the_command_in_one_line(tmp_path, capsys, digits_teacher):
    code = main(["tune", *sweep_args(digits_teacher[0], tmp_path / "o", "--param", "alpha=0.3", "--param",
                                     "alpha=0.5")])
    assert code == 2 and "--param alpha is given twice" in one_error_line(capsys)


def test_a_space_file_reads_a_string_as_the_command_line_does(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("alpha: 0.3,0.5\nstage_resolutions: '[6,8],[8,8]'\ninit: real\nlr: loguniform(0.01, 0.3)\n")
    fixed, swept = split_space(parse_space([], space))
    _, same = split_space(parse_space(["alpha=0.3,0.5", "stage_resolutions=[6,8],[8,8]", "lr=loguniform(0.01,0.3)"]))
    assert swept == same and fixed == {"init": "real"}
    space.write_text("alpha: 0.3,0.3\n")
    with pytest.raises(ConfigError, match="given twice"):
        parse_space([], space)


def test_the_trial_count_covers_the_whole_sweep():
    _, swept = split_space(parse_space(["alpha=0.3,0.5,0.7", "k=1,2", "lr=uniform(0.01,0.1)"]))
    assert trial_count(swept, "grid", 1) == 6
    assert trial_count(swept, "grid", 2) == 12
    assert trial_count(swept, "random", 10) == 10


def test_trials_tune_has_not_made_yet_are_pending_rows():
    _, swept = split_space(parse_space(["alpha=0.3,0.5", "k=1,2"]))
    made = [TrialRow(trial="a", values={"alpha": 0.3, "k": 1}, state="done"),
            TrialRow(trial="b", values={"alpha": 0.5, "k": 1}, state="interrupted")]
    pending = [r.flat() for r in not_made(made, swept, "grid", 1)]
    assert sorted((r["alpha"], r["k"]) for r in pending) == [(0.3, 2), (0.5, 2)]
    assert all(r["state"] == "pending" and r["trial"] == "" and r["top1"] is None for r in pending)
    assert len(not_made(made, swept, "grid", 2)) == 8 - 2
    assert len(not_made(made, swept, "random", 5)) == 3


def test_trials_that_said_they_started_are_interrupted_not_pending(tmp_path):
    """When the SIGINT comes just after trials started, Tune's controller (or the state it saved)
    may still call them pending and keep no config: the line each wrote as it started says
    otherwise, and gives its values."""
    from types import SimpleNamespace

    from fadrm_ray.events import append_event
    from tune.prepare import check
    from tune.results import collect_rows
    from tune.settings import EVENTS, TrialStarted

    teacher = tmp_path / "t.pt"
    teacher.write_bytes(b"")
    p = check(SweepRequest(dataset="digits", teachers=[str(teacher)], out=str(tmp_path / "sweep"),
                           params=["alpha=0.3,0.5", "k=1,2"]))
    p.out.mkdir()
    for trial, alpha in (("x_00000", 0.3), ("x_00001", 0.5)):
        said = TrialStarted(trial=trial, values={"alpha": alpha, "k": 1}, node_id="n", host="h")
        append_event(p.out / EVENTS, said.event, **said.model_dump(exclude={"event"}))
    append_event(p.out / EVENTS, "distilled", trial="x_00000")  # another event: not a start
    # Tune's results of two trials that never reported (what a ResultGrid holds of them).
    grid = [SimpleNamespace(metrics={}, config=None, error=None, path=str(p.out / "experiment" / f"trial_{t}"))
            for t in ("x_00000", "x_00001")]
    progress = SimpleNamespace(statuses={"x_00000": "PENDING", "x_00001": "PENDING"}, configs={})
    rows = [(r.trial, r.values, r.state) for r in collect_rows(grid, p, progress)]
    assert rows == [("x_00000", {"alpha": 0.3, "k": 1}, "interrupted"),
                    ("x_00001", {"alpha": 0.5, "k": 1}, "interrupted"),
                    ("", {"alpha": 0.3, "k": 2}, "pending"), ("", {"alpha": 0.5, "k": 2}, "pending")]


def test_a_bad_space_is_refused_before_torch_or_the_dataset_loads(tmp_path, digits_teacher):
    """`prepare` in a fresh interpreter: an unknown key and an out-of-range value both fail
    before torch is imported (the dataset load would import it)."""
    code = f"""
import sys
from fadrm_ray.settings import ConfigError
from tune.prepare import prepare
from tune.request import SweepRequest
for params in (["nosuch=1"], ["alpha=0.5,2"]):
    try:
        prepare(SweepRequest(dataset="digits", teachers=[{str(digits_teacher[0])!r}], out={str(tmp_path / 'o')!r},
                             params=params))
    except ConfigError as exc:
        print(str(exc).split(":")[0], "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[:2] == ["--param nosuch False", "--param alpha False"], done.stderr


# --------------------------------------------------------------------------- pictures
def _rows():
    """A 3 x 2 alpha x k sweep as ASHA leaves it: two finished trials, the rest stopped."""
    rows = []
    for i, (alpha, k, state, top1) in enumerate([(0.3, 1, "done", 52.0), (0.5, 1, "stopped", 24.1),
                                                 (0.7, 1, "stopped", 23.8), (0.3, 2, "stopped", 24.5),
                                                 (0.5, 2, "done", 51.2), (0.7, 2, "interrupted", 30.0)]):
        rows.append({"trial": str(i), "alpha": alpha, "k": k, "state": state, "top1": top1, "top1_std": 0.0,
                     "student_pct": 100.0 if state == "done" else 50.0})
    return rows


def test_pruned_and_interrupted_trials_are_drawn_and_marked_apart():
    from fadrm_ray.evaluation.report import pyplot

    plt = pyplot()
    _, swept = split_space(parse_space(["alpha=0.3,0.5,0.7", "k=1,2"]))
    fig = key_figure(plt, "alpha", swept["alpha"], _rows(), seeds=1)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "finished trial (1 student seed)" in labels and not any("std" in label for label in labels)
    assert "stopped by the scheduler (last top-1)" in labels and "interrupted (last top-1)" in labels
    dots = [x for line in ax.lines if line.get_marker() == "o" for x in line.get_xdata()]
    drawn = sorted(float(x) for x in dots + [x for c in ax.collections for x, _ in c.get_offsets()])
    assert drawn == [0.3, 0.3, 0.5, 0.5, 0.7, 0.7]  # every trial that reported, not only the finished
    plt.close(fig)
    fig = key_figure(plt, "alpha", swept["alpha"], _rows(), seeds=3)
    assert "finished trial (mean ± std over 3 student seeds)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)


def test_the_plots_draw_random_real_images_integer_ticks_and_a_range_wider_than_the_noise():
    from fadrm_ray.evaluation.report import pyplot

    plt = pyplot()
    _, swept = split_space(parse_space(["alpha=0.3,0.5,0.7", "k=1,2"]))
    rows = [dict(r, top1=50.0 + 0.2 * i, top1_std=0.5, state="done") for i, r in enumerate(_rows())]
    fig = key_figure(plt, "k", swept["k"], rows, seeds=3, random_real=[47.0, 48.0, 49.0])
    ax = fig.axes[0]
    assert [t for t in ax.get_xticks()] == [1, 2]  # no tick at 1.2 or 1.4
    [level] = [line for line in ax.lines if line.get_label().startswith("random real images")]
    assert set(level.get_ydata()) == {48.0} and "± 1.0 std over 3 seeds" in level.get_label()
    low, high = ax.get_ylim()
    assert high - low >= 10.0 and low <= 47.0 and high >= 51.5  # the 1-point spread of the trials is not magnified
    assert any(c.__class__.__name__ == "LineCollection" for c in ax.collections)  # the seeds' error bars
    plt.close(fig)


def test_the_heat_map_keeps_every_column_and_marks_the_stopped_cells():
    xs, ys, grid, marks = heatmap_cells(_rows(), "alpha", "k")
    assert xs == [0.3, 0.5, 0.7] and ys == [1, 2]  # no collapse to the columns of finished trials
    assert grid[0] == [52.0, 24.1, 23.8] and marks[0] == ["", "stopped", "stopped"]
    assert marks[1] == ["stopped", "", "interrupted"]


@pytest.mark.parametrize("values", [[24.1, 24.4], [0.5, 1.0], [99.0, 99.5], [20.0, 60.0]])
def test_the_colour_scale_is_never_narrower_than_a_few_points(values):
    low, high = colour_range(values)
    assert high - low >= 5.0 - 1e-9 and 0 <= low <= min(values) and max(values) <= high <= 100


def test_the_plots_are_written_with_pruned_trials(tmp_path):
    from tune.plots import plot_results

    _, swept = split_space(parse_space(["alpha=0.3,0.5,0.7", "k=1,2"]))
    files = plot_results(tmp_path, _rows(), swept, seeds=1)
    assert set(files) == {"plot_alpha", "plot_k", "heatmap"}
    assert all(Path(f).stat().st_size > 0 for f in files.values())


# --------------------------------------------------------------------------- on Ray
def _wait(proc, out: Path, until, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not until(out):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the sweep did not get there in time"
        time.sleep(0.2)


def interrupt_sweep(command: list[str], out: Path) -> tuple[int, str]:
    """Run the sweep `command` (writing to `out`), send SIGINT once a trial is evaluated and the
    next has started, and return its exit code and stderr."""
    # Its own session, so that the signal reaches the driver and the Ray it started, as Ctrl-C in
    # a terminal reaches the foreground process group.
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait(proc, out, lambda o: events(o, "evaluated") and len(events(o, "trial_started")) >= 2)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


@pytest.mark.ray
def test_sigint_mid_sweep_is_marked_interrupted_exits_130_and_the_same_command_resumes(digits_teacher, tmp_path):
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "tune.sweep", *sweep_args(digits_teacher[0], out, "--param", "alpha=0.3,0.5,0.7,0.9",
                                                               "--scheduler", "fifo", "--max-concurrent", "1")]
    code, err = interrupt_sweep(command, out)
    assert code == 130, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    states = summary["states"]
    assert summary["interrupted"] is True and "same command" in summary["resume"]
    assert summary["trials"] == summary["trials_total"] == 4 and sum(states.values()) == 4
    assert states["done"] >= 1 and states["interrupted"] == 1 and states["pending"] >= 1 and states["stopped"] == 0
    assert summary["best"] is None and not (out / "best.yaml").exists()
    assert (out / "results.md").read_text().startswith("**Interrupted**")
    progress = [line for line in err.splitlines() if line.startswith("fadrm tune: ") and " trial " in line]
    assert progress and all(line.split()[2].endswith("/4") for line in progress)  # the whole sweep, from the start
    assert "fadrm tune: interrupted during the trials:" in err
    finished = {r["trial"]: r["top1"] for r in summary["rows"] if r["state"] == "done"}

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed"] and not summary["interrupted"] and summary["states"]["done"] == 4
    assert (out / "best.yaml").is_file() and not (out / "results.md").read_text().startswith("**Interrupted**")
    rows = {r["trial"]: r["top1"] for r in summary["rows"]}
    assert all(rows[t] == top1 for t, top1 in finished.items())  # kept, not run again
    started = [e["trial"] for e in events(out, "trial_started")]
    assert all(started.count(t) == 1 for t in finished)


@pytest.mark.ray
@pytest.mark.slow
def test_the_sweep_finishes_when_the_folder_it_started_in_is_deleted(digits_teacher, tmp_path):
    """As when `ray job submit` deletes the job's working_dir: the driver started there, with
    `''` (the current folder) on its import path and the teacher named relative to it."""
    import shutil

    start = tmp_path / "working_dir"
    start.mkdir()
    shutil.copy(digits_teacher[0], start / "teacher.pt")
    out = tmp_path / "sweep"
    code = ("import sys; from tune.sweep import main; "
            f"sys.exit(main({sweep_args('teacher.pt', out, '--param', 'alpha=0.3,0.7', '--scheduler', 'fifo', '--max-concurrent', '1', '--quiet')!r}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=start, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait(proc, out, lambda o: events(o, "distilled"))  # the first trial loaded its teacher
    shutil.rmtree(start)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert {"results.csv", "results.md", "best.yaml", "summary.json", "top1_vs_alpha.png"} <= {
        p.name for p in out.iterdir()}
    assert json.loads((out / "summary.json").read_text())["states"]["done"] == 2


@pytest.mark.ray
@pytest.mark.slow
def test_an_unexpected_failure_after_the_checks_shows_its_traceback(digits_teacher, tmp_path, capsys):
    """OUT/patches is a file: the checks pass, then keeping the scored patches fails."""
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "patches").write_text("not a folder")
    assert main(["tune", *sweep_args(digits_teacher[0], out, "--param", "alpha=0.3,0.7", "--quiet")]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "FileExistsError" in err
    said = [line for line in err.splitlines() if line.startswith("fadrm tune: error:")]
    assert len(said) == 1 and said[0].startswith("fadrm tune: error: the sweep failed after its checks: "
                                                 "FileExistsError") and str(out / "patches") in said[0]
    assert err.index("Traceback") < err.index(said[0])  # the traceback, then what to do


def test_every_choice_flag_accepts_what_the_request_accepts():
    """An optional Literal field (`protocol`) offers its values, not the type: `--protocol
    published` parses, as every other choice of the sweep's request does."""
    import argparse

    from tune.sweep_command import add_parser

    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    base = ["--dataset", "clipart10", "--teacher", "t.pt", "--out", "o"]
    for flag, values in {"--protocol": ["short", "published"], "--search": ["grid", "random", "optuna"],
                         "--scheduler": ["asha", "fifo"], "--metric": ["top1"]}.items():
        for value in values:
            assert getattr(parser.parse_args([*base, flag, value]), flag[2:]) == value
    assert "clipart10" in parser.format_help() and "fashion-mnist" in parser.format_help()
