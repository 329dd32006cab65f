"""What a client downloads reaches the accuracy the report shows: over real HTTP, a client fetches
a finished job's Parquet file, teacher and recipe, trains a student from those files alone
(`fadrm train-student`, neither Ray nor the service imported) and gets the job's reported top-1
for the same seed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from api.client import FadrmClient
from tests.api_helpers import REPO, TOKEN, request

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def downloaded(api_service, tmp_path_factory):
    """A job of two classes, evaluated by the service (one student, seed 0), and its three files."""
    out = tmp_path_factory.mktemp("client") / "digits-2-6.parquet"
    body = request(classes=[2, 6], ipc=2, seed=51)
    with FadrmClient(api_service.url, TOKEN) as client:
        files = client.distill(out=out, timeout=300, with_teacher=True, evaluate=True,
                               evaluation={"epochs": 3, "seeds": 1}, **{k: v for k, v in body.items()})
        job = client.jobs()[0]
        with api_service.client() as http:
            report = http.get(f"/v1/distillations/{job['id']}/report").json()
    return files, report["evaluation"]


def test_train_student_from_the_downloaded_files_reaches_the_reported_top1(downloaded, one_thread):
    from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
    from fadrm_ray.evaluation.from_files import read_recipe, train_from_files

    files, reported = downloaded
    assert reported["seeds"] == [0] and reported["classes"] == [2, 6]
    job = EvalJob(config=read_recipe(files.recipe), teacher_paths=files.teachers, dataset="digits")
    result = train_from_files(files.data, job, EvalSpec(progress=False))
    # The same images, teacher, recipe, seed and test images: the same student, bit for bit.
    assert result.top1_per_seed == reported["top1_per_seed"]
    assert result.classes == [2, 6] and result.test_size == reported["test_size"]


def test_the_command_runs_from_another_folder_without_ray_or_the_service(downloaded, tmp_path):
    files, reported = downloaded
    code = ("import sys; from fadrm_ray.cli import main; "
            f"rc = main(['train-student', '--data', {str(files.data)!r}, '--teacher', {str(files.teachers[0])!r}, "
            f"'--recipe', {str(files.recipe)!r}, '--test', 'digits', '--seed', '0', '--threads', '1', '--json', "
            "'--quiet']); "
            "loaded = sorted(m for m in ('ray', 'fastapi', 'uvicorn', 'api', 'actors') if m in sys.modules); "
            "print(json.dumps(loaded), file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == []
    out = json.loads(proc.stdout)
    assert out["top1_per_seed"] == reported["top1_per_seed"] and out["top1"] == pytest.approx(out["top1_per_seed"][0], abs=1e-3)
    assert out["classes"] == [2, 6]


def test_files_that_do_not_fit_are_refused_in_one_line(downloaded, tmp_path, capsys):
    from fadrm_ray.cli import main

    files, _ = downloaded
    other = tmp_path / "other.parquet"
    other.write_bytes(b"not parquet")
    assert main(["train-student", "--data", str(other), "--teacher", str(files.teachers[0])]) == 2
    assert "is not a Parquet file" in capsys.readouterr().err
    assert main(["train-student", "--data", str(files.data), "--teacher", str(tmp_path / "missing.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # mnist-sample has digits' class names but 28-px images: not the images' test set.
    assert main(["train-student", "--data", str(files.data), "--teacher", str(files.teachers[0]),
                 "--test", "mnist-sample", "--quiet"]) == 2
    assert "images must be (N, 1, 28, 28)" in capsys.readouterr().err


def test_stored_soft_labels_downloaded_instead_of_the_teacher_reach_the_reported_top1(api_service, tmp_path,
                                                                                      one_thread):
    """A job whose evaluation stores top-k soft labels of a few epochs: the client fetches them with
    the images and the recipe (no teacher), and the student trained from those files is the
    reported one."""
    from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
    from fadrm_ray.evaluation.from_files import read_recipe, train_from_files

    body = request(classes=[1, 8], ipc=2, seed=52)
    evaluation = {"epochs": 4, "seeds": 1, "soft_labels": "stored", "soft_label_topk": 3, "soft_label_epochs": 2}
    with FadrmClient(api_service.url, TOKEN) as client:
        files = client.distill(out=tmp_path / "set.parquet", timeout=300, soft_labels=True, evaluate=True,
                               evaluation=evaluation, **body)
        job = client.jobs()[0]
        with api_service.client() as http:
            reported = http.get(f"/v1/distillations/{job['id']}/report").json()["evaluation"]
    assert files.teachers == () and files.soft_labels == tmp_path / "set.soft-labels.parquet"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set.parquet", "set.recipe.json", "set.soft-labels.parquet"]
    job = EvalJob(config=read_recipe(files.recipe), teacher_paths=[], dataset="digits")
    result = train_from_files(files.data, job, EvalSpec(progress=False), soft_labels=files.soft_labels)
    assert result.top1_per_seed == reported["top1_per_seed"] and result.classes == [1, 8]
    # The service's report says what the images reach with their hard labels alone.
    assert len(reported["ranking"]["hard_top1_per_seed"]) == 1
