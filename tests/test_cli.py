"""The `fadrm` command end to end: squeeze -> distill -> info -> export, and its errors."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
import yaml

from fadrm_ray.cli import main
from fadrm_ray.config import DistillConfig, make_config
from fadrm_ray.runs.execute import DistillResult
from fadrm_ray.runs.job import DistillJob, ExecutionSpec
from fadrm_ray.config import EvalConfig
from fadrm_ray.store import open_run


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-teacher")
    code = main(["squeeze", "--dataset", "digits", "--model", "convnet-bn", "--epochs", "3",
                 "--out", str(out), "--quiet", "--json", "--threads", "1"])
    assert code == 0
    return out / "teacher.pt"


def test_squeeze_distill_info_export(teacher_path, tmp_path, capsys):
    capsys.readouterr()
    store = tmp_path / "store"
    code, out, err = run_cli(capsys, "distill", "--local", "--dataset", "digits", "--teacher", str(teacher_path),
                             "--preset", "fadrm", "--ipc", "2", "--set", "iterations=24", "--set", "ipc_per_unit=2",
                             "--out", str(store), "--json", "--quiet", "--threads", "1")
    assert code == 0, err
    result = json.loads(out)
    assert result["images"] == 20 and len(result["units_run"]) == 1

    run = open_run(result["run_dir"])
    images, labels, ipc = run.read()
    assert images.shape == (20, 1, 8, 8) and images.dtype == torch.uint8
    assert sorted(labels.tolist()) == sorted(list(range(10)) * 2)     # every class twice
    assert sorted(zip(labels.tolist(), ipc.tolist())) == [(c, i) for c in range(10) for i in range(2)]
    assert run.class_names == [str(c) for c in range(10)]
    assert run.provenance.teachers[0].sha256 and run.provenance.config.alpha == 0.5
    assert run.provenance.class_map[3] == "3"
    assert (run.run_dir / "config.yaml").is_file() and run.complete

    code, out, _ = run_cli(capsys, "info", "--run", result["run_dir"], "--json")
    info = json.loads(out)
    assert code == 0 and info["rows"] == 20 and info["images_per_class"] in ({str(c): 2 for c in range(10)},
                                                                              {c: 2 for c in range(10)})

    code, out, err = run_cli(capsys, "evaluate", "--run", result["run_dir"], "--epochs", "3", "--seeds", "2",
                             "--json", "--quiet", "--threads", "1")
    assert code == 0, err
    evaluation = json.loads(out)
    assert len(evaluation["top1_per_seed"]) == 2 and 10.0 < evaluation["top1_mean"] <= 100.0
    assert evaluation["top1_std"] >= 0 and set(evaluation["report"]) >= {"grid", "losses", "evaluation"}
    # The same evaluation as text (read back from the caches): each baseline with its paired gain.
    code, out, err = run_cli(capsys, "evaluate", "--run", result["run_dir"], "--epochs", "3", "--seeds", "2",
                             "--quiet", "--threads", "1")
    assert code == 0, err
    for name in ("random real images", "its starting patches"):
        assert re.search(rf"{name}: .*\(gain [+-]\d+\.\d\d ± \d+\.\d\d s\.e\., higher on [012] of 2 seeds\)", out), out
    code, out, _ = run_cli(capsys, "info", "--run", result["run_dir"], "--json")
    assert set(json.loads(out)["report"]) >= {"grid", "losses", "evaluation"}  # info lists the report

    folder = tmp_path / "folder"
    code, out, _ = run_cli(capsys, "export", "--run", result["run_dir"], "--format", "imagefolder", "--out", str(folder))
    assert code == 0
    exported = torchvision.datasets.ImageFolder(str(folder))
    assert len(exported) == 20 and exported.classes == [str(c) for c in range(10)]

    # a second identical command finds every unit done and recomputes nothing
    code, out, _ = run_cli(capsys, "distill", "--local", "--dataset", "digits", "--teacher", str(teacher_path),
                           "--ipc", "2", "--set", "iterations=24", "--set", "ipc_per_unit=2",
                           "--out", str(store), "--json", "--quiet", "--threads", "1")
    again = json.loads(out)
    assert again["run_id"] == result["run_id"] and again["units_run"] == [] and len(again["units_skipped"]) == 1


@pytest.mark.parametrize("argv, message", [
    (["distill", "--local", "--dataset", "nosuch", "--teacher", "T", "--out", "O"], "unknown dataset 'nosuch'"),
    (["distill", "--local", "--dataset", "digits", "--teacher", "missing.pt", "--out", "O"], "missing.pt does not exist"),
    (["distill", "--local", "--dataset", "digits", "--teacher", "T", "--out", "O", "--set", "alpha"], "key=value"),
    (["distill", "--local", "--dataset", "digits", "--teacher", "T", "--out", "O", "--set", "alpha=2"], "alpha must be in (0, 1]"),
    (["distill", "--local", "--dataset", "digits", "--teacher", "T", "--out", "O", "--classes", "0,x"], "--classes"),
    (["distill", "--local", "--dataset", "digits", "--teacher", "T", "--out", "O", "--classes", "3,11"], "classes must be in [0, 9]"),
    (["distill", "--local", "--dataset", "digits", "--teacher", "T", "--out", "O", "--preset", "fadrm+"], "several teachers"),
    (["squeeze", "--dataset", "digits", "--model", "nosuchnet", "--out", "O"], "nosuchnet"),
    (["info", "--run", "nowhere"], "nowhere"),
])
def test_bad_input_exits_nonzero_with_one_line(argv, message, teacher_path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [str(teacher_path) if a == "T" else a for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "O").exists() or not any((tmp_path / "O").rglob("manifest.json"))


def test_teacher_of_another_dataset_is_refused(teacher_path, tmp_path, capsys):
    code, _, err = run_cli(capsys, "distill", "--local", "--dataset", "mnist-sample", "--teacher", str(teacher_path),
                           "--out", str(tmp_path / "o"), "--quiet")
    assert code == 2 and ("image_size" in err or "class" in err), err


def test_console_script_help_lists_every_phase():
    out = subprocess.run([sys.executable, "-m", "actors.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("squeeze", "distill", "export", "info", "demo"):
        assert command in out


def test_flags_are_the_last_layer_and_configs_round_trip(digits, digits_teacher, tmp_path, capsys):
    """`--set ipc=3 --ipc 4` is one pass that ends at 4; config.yaml and evaluation.json read back
    into the very models that produced them."""
    sets = ["iterations=4", "k=1", "ipc_per_unit=4", "pack=4"]
    code, out, err = run_cli(capsys, "distill", "--local", "--dataset", "digits", "--teacher", str(digits_teacher[0]),
                             "--set", "ipc=3", "--ipc", "4", "--classes", "0,1", *[a for s in sets for a in ("--set", s)],
                             "--out", str(tmp_path), "--device", "cpu", "--threads", "1", "--json", "--quiet")
    assert code == 0, err
    run_dir = Path(json.loads(out)["run_dir"])
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["ipc"] == 4 and saved["classes"] == [0, 1]
    cfg = make_config("fadrm", overrides=sets, ipc=4, classes=[0, 1]).resolve(
        digits.image_size, digits.num_classes, digits.hflip, "cpu", channels=digits.channels)
    assert DistillConfig.from_dict(saved) == cfg

    code, out, err = run_cli(capsys, "evaluate", "--run", str(run_dir), "--set", "seeds=[0, 1]", "--set",
                             "cosine_stretch=2", "--seeds", "1", "--epochs", "2", "--no-baselines", "--json", "--quiet",
                             "--threads", "1")
    assert code == 0, err
    expected = EvalConfig(epochs=2, seeds=1, cosine_stretch=2.0)
    assert EvalConfig.model_validate(json.loads(out)["config"]) == expected
    with open(run_dir / "report" / "evaluation.json") as fh:
        assert EvalConfig.model_validate(json.load(fh)["config"]) == expected


def test_without_local_the_run_goes_through_the_ray_door_as_one_job_and_one_spec(digits_teacher, tmp_path, capsys):
    """The job is built once, in this process (dataset and teachers loaded and checked before any
    cluster), for the device type the door names, and handed to the door whole with the spec."""
    calls = []

    class FakeRayDoor:
        def device_type(self, spec):
            calls.append(("device_type", spec))
            return "cpu"

        def run(self, job, spec, parts=None):
            assert parts is not None and parts.dataset.name == "digits"
            calls.append(("run", job, spec))
            return DistillResult(run_id=job.run_id, run_dir=job.run_dir, images=0)

    argv = ["distill", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--ipc", "2", "--address", "ray://h:1",
            "--workers", "3", "--gpus-per-worker", "0.5", "--data-root", "/data", "--out", str(tmp_path), "--quiet", "--json"]
    assert main(argv, ray_distill=FakeRayDoor()) == 0
    spec = ExecutionSpec(address="ray://h:1", workers=3, gpus_per_worker=0.5, data_root="/data", progress=False)
    assert [c[0] for c in calls] == ["device_type", "run"] and calls[0][1] == spec
    _, job, given = calls[1]
    assert isinstance(job, DistillJob) and isinstance(job.config, DistillConfig) and job.config.ipc == 2
    assert job.dataset_spec == "digits" and job.data_root == "/data" and job.device_type == "cpu"
    assert job.teacher_paths == [os.path.abspath(digits_teacher[0])] and job.store == str(tmp_path)
    assert given == spec
    capsys.readouterr()
    code, _, err = run_cli(capsys, *argv)  # no Ray function given: only --local can run
    assert code == 2 and "--local" in err


def test_every_bad_input_error_of_the_library_is_reported_in_one_line():
    """`fadrm` reports USER_ERRORS in one line (exit 2) without importing the modules that define
    the library's error classes: each of them must be one of USER_ERRORS."""
    from fadrm_ray.cli import USER_ERRORS
    from fadrm_ray.config import ConfigError
    from fadrm_ray.data.base import DatasetError
    from fadrm_ray.evaluation.training import EvaluationError
    from fadrm_ray.models import ModelError
    from fadrm_ray.store import StoreError

    for error in (ConfigError, DatasetError, EvaluationError, ModelError, StoreError):
        assert issubclass(error, USER_ERRORS), error


def test_every_door_that_trains_students_names_the_device(capsys):
    """`fadrm evaluate`, `fadrm train-student` and `fadrm tune` take --device (default: cuda where
    torch sees a GPU), and a device torch cannot use is refused in one line before any work."""
    from actors.cli import main as fadrm
    from fadrm_ray.errors import InputError
    from fadrm_ray.runtime import resolve_device

    for command in ("evaluate", "train-student", "tune"):
        assert fadrm([command, "--help"]) == 0
        assert "--device" in capsys.readouterr().out, command
    assert resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(InputError, match="fadrm runs on cpu or cuda"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="torch sees no CUDA device"):
            resolve_device("cuda")
