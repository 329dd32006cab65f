"""G-VBSM, EDC and CV-DD through the doors users take: on a real embedded local Ray and in one
process they make the same images, the run names the teachers it used, and a stopped
`fadrm distill --preset ...` resumes where it stopped."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

from actors import coordinator  # noqa: E402
from fadrm_ray.config import make_config  # noqa: E402
from fadrm_ray.runs import execute  # noqa: E402
from fadrm_ray.runs.job import ExecutionSpec  # noqa: E402
from fadrm_ray.store import open_run  # noqa: E402
from tests.ray_helpers import distill, events, only_run_dir, wait_for  # noqa: E402

LOCAL = ExecutionSpec(local=True, device="cpu", progress=False)

PRESETS = ("g-vbsm", "edc", "cv-dd")
CFG = {"ipc": 2, "iterations": 12, "precision": "fp32", "classes_per_batch": 5}


@pytest.fixture(scope="module")
def teachers(digits, digits_teacher, tmp_path_factory):
    """Two different teachers: the session's and a narrower one trained here."""
    from fadrm_ray.config import SqueezeConfig
    from fadrm_ray.squeeze import squeeze
    torch.set_num_threads(1)
    second = squeeze(digits, SqueezeConfig(model="convnet-bn", epochs=2, model_kwargs={"width": 16}, seed=1),
                     out_dir=tmp_path_factory.mktemp("teacher-b"), progress=False, num_threads=1)
    return [digits_teacher[0], second.path]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_on_ray_makes_the_local_images_and_names_its_teachers(preset, local_ray, digits, teachers, tmp_path):
    torch.set_num_threads(1)
    cfg = make_config(preset, overrides=CFG)
    local = distill(execute, cfg, teachers, tmp_path / "local", LOCAL, digits)
    on_ray = distill(coordinator, cfg, teachers, tmp_path / "ray", ExecutionSpec(workers=2, progress=False))
    assert local.run_id == on_ray.run_id
    a, b = open_run(local.run_dir).read(), open_run(on_ray.run_dir).read()
    assert a[0].shape == (20, 1, 8, 8) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert len({e["pid"] for e in events(on_ray.run_dir, "unit_done")}) == 2  # both workers did work
    named = open_run(on_ray.run_dir).info()["teachers"]
    assert [t["path"] for t in named] == [str(p) for p in teachers]
    assert all(t["model"] == "convnet-bn" and t["test_accuracy"] > 10 and t["sha256"] for t in named)


def test_cv_dd_run_says_each_teachers_vote(local_ray, teachers, tmp_path):
    cfg = make_config("cv-dd", overrides=CFG)
    run = distill(coordinator, cfg, teachers, tmp_path, ExecutionSpec(workers=1, progress=False))
    out = subprocess.run([sys.executable, "-m", "fadrm_ray.cli", "info", "--run", str(run.run_dir), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    accs = [t["test_accuracy"] for t in info["teachers"]]
    votes = info["committee_votes"]
    assert len(votes) == 2 and sum(votes) == pytest.approx(1.0, abs=1e-3)
    assert (votes[0] > votes[1]) == (accs[0] > accs[1])  # the better teacher has the larger say


@pytest.mark.parametrize("preset", PRESETS)
def test_stopped_preset_run_resumes_only_unfinished_units_and_ends_as_an_unbroken_run(preset, digits, teachers,
                                                                                     tmp_path):
    overrides = {"iterations": 240, "precision": "fp32", "ipc_per_unit": 1}
    command = [sys.executable, "-m", "actors.cli", "distill", "--dataset", "digits", "--preset", preset,
               "--teacher", str(teachers[0]), "--teacher", str(teachers[1]), "--ipc", "4",
               *[f"--set={k}={v}" for k, v in overrides.items()],
               "--workers", "1", "--out", str(tmp_path / "ray"), "--quiet", "--json"]
    (tmp_path / "ray").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = wait_for(lambda: next(iter([d for d in (tmp_path / "ray").iterdir() if d.is_dir()]), None),
                           timeout=120)
        wait_for(lambda: events(run_dir, "unit_done"), timeout=600)  # generous: Ray starts slowly on a loaded machine
    finally:
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    assert first.returncode != 0 and not (run_dir / "manifest.json").exists(), f"rc {first.returncode}: {err}"
    before = {e["unit"] for e in events(run_dir, "unit_done")}

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert only_run_dir(tmp_path / "ray") == run_dir
    after = [e["unit"] for e in events(run_dir, "unit_done")]
    assert len(after) == len(set(after))                 # no unit finished twice
    assert before and before < set(after)                # the second command added only what was missing
    assert len(events(run_dir, "run_started")) == 2
    resumed = open_run(run_dir).read()
    assert sorted(zip(resumed[1].tolist(), resumed[2].tolist())) == [(c, i) for c in range(10) for i in range(4)]
    torch.set_num_threads(1)  # as the Ray worker: the same images need the same thread count
    unbroken = distill(execute, make_config(preset, overrides={**overrides, "ipc": 4}), teachers, tmp_path / "local",
                       LOCAL, digits)
    assert unbroken.run_dir.name == run_dir.name
    assert all(torch.equal(a, b) for a, b in zip(open_run(unbroken.run_dir).read(), resumed))
