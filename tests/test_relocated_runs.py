"""A run is read, evaluated and repaired from any directory: it records its data by a spec that
reopens it anywhere and its teachers by absolute path (the run id depends on neither), a run
recorded before that still works where it was made, `--dataset`/`--teacher` say where moved
data and teachers are now (checked by fingerprint and sha256), and every message that suggests
a flag names one its command has."""
import argparse
import ast
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from torchvision.io import encode_png, write_file

from fadrm_ray.runs import execute as distill
from fadrm_ray.cli import build_parser
from fadrm_ray.config import make_config
from fadrm_ray.data import get_dataset
from fadrm_ray.runs.job import make_run_id
from fadrm_ray.runs.job import build_job
from fadrm_ray.models import load_teacher
from fadrm_ray.store import open_run
from bench import fault_inject
from tests.test_integrity import one_line, run_cli

PER_CLASS = 12  # digits images per class folder: 80/20 split, one IPC of patches to pick from
DISTILL = ["--preset", "fadrm", "--ipc", "1", "--set", "iterations=8", "--set", "precision=fp32",
           "--out", "STORE", "--local", "--device", "cpu", "--threads", "1", "--json", "--quiet"]
EVALUATE = ["--epochs", "1", "--seeds", "1", "--no-baselines", "--threads", "1", "--json", "--quiet"]


@pytest.fixture(scope="module")
def pngs(digits, tmp_path_factory):
    """A folder of PNGs, one subfolder per digit, from the digits training images."""
    root = tmp_path_factory.mktemp("pngs") / "imgs"
    images, labels = digits.train.load(torch.arange(len(digits.train))), digits.train.labels.tolist()
    written: dict[int, int] = {}
    for image, label in zip(images, labels):
        if written.get(label, 0) < PER_CLASS:
            written[label] = written.get(label, 0) + 1
            (root / str(label)).mkdir(parents=True, exist_ok=True)
            write_file(str(root / str(label) / f"{written[label]:02d}.png"), encode_png(image))
    return root


@pytest.fixture
def work(pngs, digits_teacher, tmp_path, one_thread):
    """tmp_path/work with data/imgs (the folder) and t/teacher.pt; tmp_path/elsewhere beside it."""
    shutil.copytree(pngs, tmp_path / "work" / "data" / "imgs")
    (tmp_path / "work" / "t").mkdir()
    shutil.copy(digits_teacher[0], tmp_path / "work" / "t" / "teacher.pt")
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "work"


def distill_here(capsys, dataset_spec: str, teacher: str, store: str) -> dict:
    argv = ["distill", "--dataset", dataset_spec, "--teacher", teacher,
            *[store if a == "STORE" else a for a in DISTILL]]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    return json.loads(out)


def test_a_run_is_evaluated_from_anywhere_and_follows_its_moved_data_and_teacher(work, monkeypatch, capsys):
    monkeypatch.chdir(work)
    made = distill_here(capsys, "imagefolder:data/imgs", "t/teacher.pt", "../store")
    prov = open_run(made["run_dir"]).provenance
    assert prov.dataset.spec == f"imagefolder:{work / 'data' / 'imgs'}"
    assert prov.dataset.name == "imagefolder:imgs"  # the name (and so the fingerprint) as before
    assert [t.path for t in prov.teachers] == [str(work / "t" / "teacher.pt")]

    monkeypatch.chdir(work.parent / "elsewhere")
    run = Path("..") / "store" / made["run_id"]
    # The same data and teacher named from here are the same run: nothing is computed again.
    again = distill_here(capsys, "imagefolder:../work/data/imgs", str(work / "t" / "teacher.pt"), "../store")
    assert again["run_id"] == made["run_id"] and again["units_run"] == [] and again["units_skipped"]
    code, out, err = run_cli(capsys, "info", "--run", run, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["dataset"]["spec"] == prov.dataset.spec and info["teachers"][0]["path"] == str(work / "t" / "teacher.pt")
    code, out, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE)
    assert code == 0, err
    assert json.loads(out)["dataset"] == "imagefolder:imgs"
    code, out, err = run_cli(capsys, "verify", "--run", run, "--json")
    assert code == 0 and json.loads(out)["ok"], err
    images = open_run(run).read()
    fault_inject.replace_png(run, label=3)
    code, out, err = run_cli(capsys, "verify", "--run", run, "--repair", "--json", "--quiet", "--threads", "1")
    assert code == 0 and json.loads(out)["ok"] and json.loads(out)["repaired"], err
    assert all(torch.equal(a, b) for a, b in zip(open_run(run).read(), images))  # bit-identical

    # The data and the teacher move; the run still names where they were.
    (work.parent / "moved").mkdir()
    shutil.move(work / "data" / "imgs", work.parent / "moved" / "imgs")
    shutil.move(work / "t" / "teacher.pt", work.parent / "moved" / "teacher.pt")
    code, _, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE)
    assert code == 2 and "cannot be reopened here" in one_line(err) and "--dataset SPEC" in err, err
    moved_data = ["--dataset", "imagefolder:../moved/imgs"]
    code, _, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE, *moved_data)
    assert code == 2 and "does not exist here" in one_line(err) and "--teacher PATH" in err, err
    moved = [*moved_data, "--teacher", "../moved/teacher.pt"]
    code, out, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE, *moved)
    assert code == 0, err
    # The baselines are distilled with the moved teacher too (none is reported unavailable).
    code, out, err = run_cli(capsys, "evaluate", "--run", run, *moved, "--epochs", "1", "--seeds", "1",
                             "--no-ranking", "--threads", "1", "--json", "--quiet")
    assert code == 0, err
    baselines = json.loads(out)["baselines"]
    assert set(baselines) == {"random_real", "starting_patches"}
    assert all(b["error"] is None for b in baselines.values()), baselines

    # Other content is refused in one line, before any student is trained.
    code, _, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE, "--dataset", "digits",
                           "--teacher", "../moved/teacher.pt")
    assert code == 2 and "is not the data the run was distilled from" in one_line(err), err
    other = work.parent / "other.pt"
    other.write_bytes((work.parent / "moved" / "teacher.pt").read_bytes() + b"\0")
    code, _, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE, *moved_data, "--teacher", other)
    assert code == 2 and "is not one the run was distilled with" in one_line(err), err

    # Repair finds them the same way.
    fault_inject.replace_png(run, label=5)
    code, _, err = run_cli(capsys, "verify", "--run", run, "--repair", "--quiet", "--threads", "1")
    assert code == 2 and "--dataset SPEC" in one_line(err), err
    code, out, err = run_cli(capsys, "verify", "--run", run, "--repair", *moved, "--json", "--quiet", "--threads", "1")
    assert code == 0 and json.loads(out)["ok"], err
    assert all(torch.equal(a, b) for a, b in zip(open_run(run).read(), images))


def test_a_run_recorded_by_relative_paths_works_where_it_was_made(work, monkeypatch, capsys):
    made_by = distill.provenance

    def recorded_before(job, dataset):  # what runs recorded before the spec and absolute paths
        prov = made_by(job, dataset)
        return prov.model_copy(update={
            "format_version": 1, "dataset": prov.dataset.model_copy(update={"spec": None}),
            "teachers": [t.model_copy(update={"path": os.path.relpath(t.path)}) for t in prov.teachers]})

    monkeypatch.setattr(distill, "provenance", recorded_before)
    monkeypatch.chdir(work / "data")  # where `imagefolder:imgs`, the name the run records, reopens
    made = distill_here(capsys, "imagefolder:imgs", "../t/teacher.pt", "../../store")
    prov = open_run(made["run_dir"]).provenance
    assert prov.dataset.spec_from_name and prov.teachers[0].path == os.path.join("..", "t", "teacher.pt")
    code, _, err = run_cli(capsys, "evaluate", "--run", made["run_dir"], *EVALUATE)
    assert code == 0, err

    monkeypatch.chdir(work.parent / "elsewhere")
    run = Path("..") / "store" / made["run_id"]
    code, _, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE)
    line = one_line(err)
    assert code == 2 and "'imagefolder:imgs'" in line and "records its name only" in line and "--dataset SPEC" in line
    data = ["--dataset", f"imagefolder:{work / 'data' / 'imgs'}"]
    code, _, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE, *data)
    line = one_line(err)
    assert code == 2 and "relative to the directory the run was distilled in" in line and "--teacher PATH" in line
    code, _, err = run_cli(capsys, "evaluate", "--run", run, *EVALUATE, *data, "--teacher", work / "t" / "teacher.pt")
    assert code == 0, err
    code, out, err = run_cli(capsys, "info", "--run", run, "--json")
    assert code == 0 and json.loads(out)["dataset"]["spec"] == "imagefolder:imgs", err


def test_the_run_id_depends_on_neither_paths_nor_the_directory(work, monkeypatch):
    cfg = make_config("fadrm", overrides={"ipc": 1, "iterations": 8})
    monkeypatch.chdir(work)
    relative = build_job(cfg, get_dataset("imagefolder:data/imgs"), "imagefolder:data/imgs",
                         [load_teacher("t/teacher.pt")[1]], "store")
    monkeypatch.chdir(work.parent / "elsewhere")
    absolute = build_job(cfg, get_dataset(f"folder:{work / 'data' / 'imgs'}"), f"folder:{work / 'data' / 'imgs'}",
                         [load_teacher(work / "t" / "teacher.pt")[1]], "store")
    assert relative.run_id == absolute.run_id == make_run_id(
        relative.config, relative.dataset_fingerprint, [t.sha256 for t in relative.teachers])
    assert relative.dataset_spec == absolute.dataset_spec == f"imagefolder:{work / 'data' / 'imgs'}"
    assert relative.teacher_paths == absolute.teacher_paths == [str(work / "t" / "teacher.pt")]
    digits = get_dataset("digits")
    assert build_job(cfg, digits, "digits", [load_teacher(work / "t" / "teacher.pt")[1]], "s").dataset_spec == "digits"


# --------------------------------------------------------------------------- flags in messages
LIBRARY = Path(__file__).resolve().parents[1] / "fadrm_ray"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
NAMED_COMMAND = re.compile(r"`fadrm ([a-z][a-z-]*)([^`]*)`")  # `fadrm verify --run RUN --repair`
# Modules (by their path in the library) whose messages reach the user under these subcommands
# only: runs.reopen's run_dataset and run_teachers are raised under `fadrm evaluate` and
# `fadrm verify --repair` alike.
RAISED_UNDER = {"runs/reopen.py": ("evaluate", "verify"), "repair.py": ("verify",),
                "evaluation/baselines.py": ("evaluate",), "evaluation/ranking.py": ("evaluate",)}


def subcommand_options() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for action in p._actions for o in action.option_strings} for name, p in sub.choices.items()}


def strings(tree: ast.AST) -> tuple[list[tuple[int, str]], set[str]]:
    """The strings of a module that can reach a user (not docstrings, nor the argv lists it hands
    to other programs), f-strings with their fields as {}; and the options it defines itself
    (`add_argument`: a module with a command line of its own)."""
    skip, own = set(), set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))  # a docstring
        if isinstance(node, (ast.List, ast.Tuple)):
            skip.update(id(e) for e in node.elts)  # argv of another program
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            own.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr):
            found.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
    return found, own


def test_every_message_that_suggests_a_flag_names_an_option_of_its_command():
    options = subcommand_options()
    assert {"--dataset", "--teacher"} <= options["evaluate"] & options["verify"]
    every = set().union(*options.values())
    wrong, checked = [], 0
    # The library's lines, and the Ray layer's, which `fadrm distill` prints too.
    for path in sorted([*LIBRARY.rglob("*.py"), *(LIBRARY.parent / "actors").rglob("*.py")]):
        found, own = strings(ast.parse(path.read_text(encoding="utf-8")))
        for line, text in found:
            text = text.split("python -m ")[0]  # what follows is another program's command line
            where = f"{path.relative_to(LIBRARY.parent)}:{line}"
            for command, rest in NAMED_COMMAND.findall(text):
                for flag in FLAG.findall(rest):
                    checked += 1
                    if flag not in options.get(command, ()):
                        wrong.append(f"{where}: `fadrm {command}` has no {flag}")
            for flag in FLAG.findall(NAMED_COMMAND.sub("", text)):
                checked += 1
                inside = path.relative_to(LIBRARY).as_posix() if path.is_relative_to(LIBRARY) else None
                under = RAISED_UNDER.get(inside)
                if under is not None:
                    wrong += [f"{where}: `fadrm {c}` has no {flag}" for c in under if flag not in options[c]]
                elif flag not in every and flag not in own:
                    wrong.append(f"{where}: no fadrm subcommand has {flag}")
    assert checked > 20 and not wrong, "\n".join(wrong)

