"""Every hint a command prints is a command that works on the door that prints it: the flags a
refusal or a note suggests are flags of the command that printed it, and the refusal of a folder
with unreadable files, followed as it says, opens the folder on every command that reads one."""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from actors.cli import commands
from fadrm_ray.cli import build_parser, main
from fadrm_ray.data import DatasetError, get_dataset

REPO = Path(__file__).resolve().parents[1]
# The packages whose lines the `fadrm` command prints.
PRINTING = ("fadrm_ray", "actors")
# Flags named in those packages' strings that are not `fadrm`'s: another program's (npm's, in the
# script that packs a dataset sample) or a standalone script's own (`python -m ...`).
OTHER_PROGRAMS = {"--silent", "--per-class", "--train-per-class", "--test-per-class", "--ladder", "--table"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(None, commands())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _dirty_folder(root: Path) -> Path:
    """Three colour classes of 32-px images, and one file behind a JPEG name that is not an image."""
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(5):
            pixels = np.clip(rng.normal(60 + 60 * c, 30, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.png")
    (root / "c1" / "broken.jpg").write_bytes(rng.integers(0, 256, 600, dtype=np.uint8).tobytes())
    return root


def _suggested_flag(refusal: str) -> str:
    found = re.search(r"; (--[a-z-]+) leaves them out", refusal)
    assert found, refusal
    return found.group(1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FADRM_CACHE", str(tmp_path / "cache"))


def test_the_folder_refusal_names_a_flag_that_every_command_reading_a_dataset_takes(tmp_path, cache):
    root = _dirty_folder(tmp_path / "dirty")
    with pytest.raises(DatasetError) as refused:
        get_dataset(f"imagefolder:{root}")
    flag = _suggested_flag(str(refused.value))
    doors = {name: p for name, p in _subparsers().items()
             if "--dataset" in _options(p) and next(a for a in p._actions if "--dataset" in a.option_strings).choices
             is None}
    assert {"squeeze", "import-teacher", "distill", "evaluate", "verify", "tune"} <= set(doors)
    for name, parser in doors.items():
        assert flag in _options(parser), f"fadrm {name} refuses {flag}, which its folder refusal suggests"


def test_import_teacher_follows_its_folder_refusal(tmp_path, cache, capsys):
    """The refusal of import-teacher on a folder with an unreadable file, followed as it says."""
    from fadrm_ray.models import create_model

    root = _dirty_folder(tmp_path / "dirty")
    weights = tmp_path / "convnet.pth"
    torch.manual_seed(0)
    torch.save(create_model("convnet-bn", 3, in_chans=3, image_size=32).state_dict(), weights)
    command = ["import-teacher", "--model", "convnet-bn", "--weights", str(weights), "--dataset",
               f"imagefolder:{root}", "--out", str(tmp_path / "t.pt"), "--accept-chance", "--quiet"]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "c1/broken.jpg" in err
    assert main([*command, _suggested_flag(err)]) == 0
    out, err = capsys.readouterr()
    assert "written to" in out and "c1/broken.jpg" in err  # the file left out is named once, in a note
    # The folder has no test split: fadrm made one, but cannot know whether imported weights saw it.
    assert "fadrm cannot know whether they saw these images" in err and "the teacher and the students" not in err
    assert (tmp_path / "t.pt").is_file()


def _printed_strings() -> list[tuple[str, str]]:
    """(module, text) of every string the printing packages hold, but docstrings: each f-string's
    literal parts joined with `{}` where a value goes."""
    found = []
    for package in PRINTING:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                          if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and node.body and isinstance(node.body[0], ast.Expr)
                          and isinstance(node.body[0].value, ast.Constant)}
            inside_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
            for node in ast.walk(tree):
                if isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                        and id(node) not in inside_fstrings:
                    text = node.value
                else:
                    continue
                found.append((str(path.relative_to(REPO)), text))
    return found


def _settings_keys() -> set[str]:
    from fadrm_ray.config import DistillConfig, EvalConfig, PilotConfig, SqueezeConfig

    return {key for model in (DistillConfig, EvalConfig, PilotConfig, SqueezeConfig) for key in model.model_fields}


def test_every_flag_a_line_names_is_a_flag_of_the_command_it_names():
    """`fadrm CMD ... --flag` names flags of CMD; any other `--flag` is a flag of some command
    (or of another program); `--set KEY=...` names a key of a phase's settings."""
    subparsers = _subparsers()
    every = set().union(*(_options(p) for p in subparsers.values()))
    keys = _settings_keys()
    wrong = []
    for where, text in _printed_strings():
        wrong += [f"{where}: `fadrm {name}` is no command" for name in re.findall(r"`fadrm ([a-z][a-z-]+)", text)
                  if name not in subparsers]
        # Split at each command a line names: the flags after it are that command's.
        pieces = re.split(rf"fadrm ({'|'.join(map(re.escape, sorted(subparsers, key=len, reverse=True)))})\b", text)
        for i, piece in enumerate(pieces):
            if i % 2 == 1:
                continue
            command = pieces[i - 1] if i else None
            allowed = _options(subparsers[command]) if command else every | OTHER_PROGRAMS
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", piece):
                if flag not in allowed:
                    wrong.append(f"{where}: {flag} is no flag of {f'fadrm {command}' if command else 'any command'}"
                                 f" in {text!r}")
            for key in re.findall(r"--set ([a-z_]+)=", piece):
                if key not in keys:
                    wrong.append(f"{where}: --set {key}=... names no setting in {text!r}")
    assert not wrong, "\n".join(wrong)
