"""The content digest of a run (`fadrm info`, `fadrm verify`): equal for two stores of the same run,
whatever their paths, unit cuts and file times; another run, another digest."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from fadrm_ray.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _said(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _distill(digits, teacher, root, **overrides):
    from fadrm_ray.config import make_config
    from fadrm_ray.runs import execute
    from fadrm_ray.runs.job import ExecutionSpec, prepare_job

    cfg = make_config("fadrm", overrides={"ipc": 3, "iterations": 8, "precision": "fp32", **overrides})
    spec = ExecutionSpec(local=True, device="cpu", progress=False)
    job, parts = prepare_job(cfg, digits, "digits", [teacher], root, device_type=execute.device_type(spec))
    return execute.run(job, spec, parts).run_dir


def test_two_stores_of_the_same_run_have_one_digest_and_another_run_another(small_run, digits, digits_teacher,
                                                                            tmp_path, capsys):
    # The same run distilled again into another store, its units cut otherwise (one IPC index each).
    again = _distill(digits, digits_teacher[0], tmp_path / "elsewhere", ipc_per_unit=1)
    assert again.name == small_run.name and again.parent != small_run.parent
    # A copy of the first, moved and with every file's time changed.
    moved = tmp_path / "moved" / small_run.name
    shutil.copytree(small_run, moved)
    for path in moved.rglob("*"):
        os.utime(path, (1_000_000_000, 1_000_000_000))
    digests = {}
    for run in (small_run, again, moved):
        info = _said(capsys, ["info", "--run", str(run), "--json"])
        verified = _said(capsys, ["verify", "--run", str(run), "--json"])
        assert info["content_digest"] == verified["content_digest"] and info["content_digest"].startswith("sha256:")
        digests[run] = info["content_digest"]
    assert len(set(digests.values())) == 1
    # The part files themselves differ between the stores (each records where it was written).
    first = sorted(p.read_bytes() for p in small_run.rglob("*.parquet"))
    assert first != sorted(p.read_bytes() for p in again.rglob("*.parquet"))
    # Another seed: other pixels, another digest; and the text output says it too.
    other = _distill(digits, digits_teacher[0], tmp_path / "other", seed=1)
    assert _said(capsys, ["info", "--run", str(other), "--json"])["content_digest"] != digests[small_run]
    assert main(["verify", "--run", str(small_run)]) == 0
    assert f"content digest: {digests[small_run]}" in capsys.readouterr().out
    # A view at a smaller IPC holds other images: its own digest.
    assert _said(capsys, ["info", "--run", str(small_run), "--ipc", "1", "--json"])["content_digest"] != \
        digests[small_run]
