"""`fadrm export --with-teacher`: the run's teacher checkpoint(s) and the student recipe of its
report, with the images (inside an ImageFolder export, beside a tensor file), all or nothing."""
from __future__ import annotations

import json
import shutil

import pytest
import torchvision

from fadrm_ray.cli import main
from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.evaluation.training import resolve_protocol
from fadrm_ray.models import load_teacher
from fadrm_ray.config import EvalConfig


def export(capsys, *argv) -> tuple[int, dict | str]:
    code = main(["export", *map(str, argv), "--with-teacher", "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else err


def test_an_imagefolder_export_holds_the_teacher_and_the_default_recipe(small_run, digits_teacher, tmp_path, capsys):
    folder = tmp_path / "folder"
    code, result = export(capsys, "--run", small_run, "--format", "imagefolder", "--out", folder)
    assert code == 0, result
    teacher = folder / "teacher.pt"
    assert teacher.read_bytes() == digits_teacher[0].read_bytes()
    _, info = load_teacher(teacher)
    assert info.num_classes == 10 and info.class_names[3] == "3"
    recipe = EvalConfig.model_validate_json((folder / "recipe.json").read_text())
    assert recipe == resolve_protocol(EvalConfig(), 30, 3) and recipe.epochs and recipe.cosine_stretch
    assert result["teachers"] == [str(teacher)] and result["recipe"] == str(folder / "recipe.json")
    assert result["recipe_from"] == "default (30 images, ipc 3)"
    exported = torchvision.datasets.ImageFolder(str(folder))  # the extra files are not classes
    assert len(exported) == 30 and exported.classes == [str(c) for c in range(10)]


def test_a_tensor_export_gets_them_beside_it_with_the_recipe_the_report_used(run_copy, digits_teacher, tmp_path,
                                                                          capsys, one_thread):
    evaluation = evaluate_store_run(run_copy, EvalJob(config=EvalConfig(epochs=1, seeds=1, eval_every=1)),
                                    EvalSpec(progress=False)).evaluation
    out = tmp_path / "x.pt"
    code, result = export(capsys, "--run", run_copy, "--format", "pt", "--classes", "0,1", "--out", out)
    assert code == 0, result
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["x.pt", "x.recipe.json", "x.teacher.pt"]
    assert (tmp_path / "x.teacher.pt").read_bytes() == digits_teacher[0].read_bytes()
    recipe = EvalConfig.model_validate_json((tmp_path / "x.recipe.json").read_text())
    assert recipe == evaluation.config and recipe.epochs == 1
    assert "/evaluations/" in result["recipe_from"]


def test_nothing_is_replaced_and_a_refused_export_writes_nothing(small_run, tmp_path, capsys):
    (tmp_path / "x.recipe.json").write_text("mine")
    code, err = export(capsys, "--run", small_run, "--format", "pt", "--out", tmp_path / "x.pt")
    assert code == 2 and "x.recipe.json already exists" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.recipe.json"]
    assert (tmp_path / "x.recipe.json").read_text() == "mine"


def test_a_teacher_that_changed_since_the_run_is_refused(digits, digits_teacher, tmp_path, capsys, one_thread):
    from fadrm_ray.config import make_config
    from fadrm_ray.runs import execute
    from fadrm_ray.runs.job import ExecutionSpec, prepare_job

    teacher = tmp_path / "teacher.pt"
    shutil.copy(digits_teacher[0], teacher)
    cfg = make_config("fadrm", overrides={"ipc": 1, "iterations": 4, "precision": "fp32", "classes": [0]})
    spec = ExecutionSpec(local=True, device="cpu", progress=False)
    job, parts = prepare_job(cfg, digits, "digits", [teacher], tmp_path / "store", device_type=execute.device_type(spec))
    run = execute.run(job, spec, parts).run_dir
    teacher.write_bytes(teacher.read_bytes() + b"\0")
    folder = tmp_path / "folder"
    code, err = export(capsys, "--run", run, "--format", "imagefolder", "--out", folder)
    assert code == 2 and "has changed since the run was distilled" in err, err
    assert not folder.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".folder")]


@pytest.mark.parametrize("name", ["classes.json", "../x", ".hidden"])
def test_extra_files_of_an_imagefolder_export_are_plain_free_names(small_run, tmp_path, name):
    from fadrm_ray.store import StoreError, export_imagefolder

    with pytest.raises(StoreError, match="free plain file name"):
        export_imagefolder(small_run, tmp_path / "f", extra={name: b"x"})
    assert not (tmp_path / "f").exists()


def test_stored_soft_labels_travel_instead_of_the_teacher_and_give_the_same_students(run_copy, tmp_path, capsys,
                                                                                     one_thread):
    """`export --format parquet --soft-labels --topk K --label-epochs E` without the teacher: a
    student trained from the files alone (`train-student --soft-labels`) is the one the run's own
    evaluation with that recipe trains, bit for bit."""
    import os
    import subprocess
    import sys

    from tests.api_helpers import REPO

    evaluate_store_run(run_copy, EvalJob(config=EvalConfig(epochs=4, seeds=[0, 1], eval_every=2)),
                       EvalSpec(progress=False))
    out = tmp_path / "set.parquet"
    assert main(["export", "--run", str(run_copy), "--format", "parquet", "--out", str(out), "--soft-labels",
                 "--topk", "3", "--label-epochs", "2", "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "set.parquet", "set.recipe.json", "set.soft-labels.parquet"]
    assert result["teachers"] == [] and result["soft_label_topk"] == 3 and result["soft_label_epochs"] == 2
    assert 0 < result["soft_label_bytes_per_image"]
    recipe = EvalConfig.model_validate_json((tmp_path / "set.recipe.json").read_text())
    assert (recipe.soft_labels, recipe.soft_label_topk, recipe.soft_label_epochs, recipe.seeds) == ("stored", 3, 2, [0, 1])
    reference = evaluate_store_run(run_copy, EvalJob(config=recipe), EvalSpec(progress=False)).evaluation
    argv = ["train-student", "--data", str(out), "--soft-labels", str(tmp_path / "set.soft-labels.parquet"),
            "--recipe", str(tmp_path / "set.recipe.json"), "--test", "digits", "--threads", "1", "--json", "--quiet"]
    # One student unless more are asked for; --seeds 2 trains the recipe's two.
    proc = subprocess.run([sys.executable, "-m", "fadrm_ray.cli", *argv, "--seeds", "2"], cwd=tmp_path / "..",
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    trained = json.loads(proc.stdout)
    assert trained["top1_per_seed"] == reference.top1_per_seed and trained["seeds"] == [0, 1]
    # A seed the file holds no labels for, and no teacher and no test set to normalize with: one line each.
    assert main([*argv[:9], "--seed", "5", "--quiet"]) == 2
    assert "seed(s) [0, 1], not seed 5" in capsys.readouterr().err
    assert main(argv[:7]) == 2
    assert "--test DATASET" in capsys.readouterr().err
