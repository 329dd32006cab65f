"""A new user's run: refusals before any pilot or Ray, every flag obeyed on every door, output that
says what it did (a teacher whose class order is not the data's, a renamed folder, a named recipe,
`--device cuda` without a GPU)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fadrm_ray.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _colour_folder(root: Path, classes: int, per_class: int = 6, size: int = 16) -> Path:
    """RGB PNGs under root/<class>/, each class its own hue."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for c in range(classes):
        folder = root / f"class{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            x = torch.rand(size, size, 3, generator=gen) * 60
            x[..., c % 3] += 100 + 10 * (c // 3)
            Image.fromarray(x.clamp(0, 255).byte().numpy()).save(folder / f"{i}.png")
    return root


def _teacher(data: Path, tmp_path: Path) -> str:
    """A one-epoch teacher of the folder `data` at tmp_path/t/teacher.pt."""
    assert main(["squeeze", "--dataset", f"imagefolder:{data}", "--epochs", "1", "--out", str(tmp_path / "t"),
                 "--quiet"]) == 0
    return str(tmp_path / "t" / "teacher.pt")


def _tiny_run(data: Path, tmp_path: Path, capsys, recipe: str) -> str:
    """A one-epoch teacher of `data` and a tiny run of it (IPC 1, 2 iterations) under `recipe`: its folder."""
    teacher = _teacher(data, tmp_path)
    capsys.readouterr()
    assert main(["distill", "--local", "--dataset", f"imagefolder:{data}", "--teacher", teacher, "--ipc", "1",
                 "--set", f"recipe={recipe}", "--set", "iterations=2", "--out", str(tmp_path / "store"),
                 "--quiet", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["run_dir"]


def _fadrm(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actors.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})


def test_device_cuda_without_a_gpu_is_refused_on_the_ray_path_too(digits_teacher, tmp_path):
    """`--local` refused it; the default (Ray) door distilled on the CPU and exited 0."""
    proc = _fadrm(["distill", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--device", "cuda",
                   "--ipc", "1", "--set", "iterations=2", "--out", str(tmp_path / "store"), "--quiet"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert "--device cuda" in proc.stderr and "no GPU" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


def test_a_teacher_of_other_classes_is_refused_before_the_pilot(tmp_path):
    """A 5-class teacher on 10-class colour data (no recipe named: the pilot would run first)."""
    five = _colour_folder(tmp_path / "five", 5)
    ten = _colour_folder(tmp_path / "ten", 10)
    assert main(["squeeze", "--dataset", f"imagefolder:{five}", "--epochs", "1", "--out", str(tmp_path / "t"),
                 "--quiet"]) == 0
    proc = _fadrm(["distill", "--local", "--dataset", f"imagefolder:{ten}", "--teacher", str(tmp_path / "t" / "teacher.pt"),
                   "--ipc", "2", "--out", str(tmp_path / "store")], tmp_path)
    assert proc.returncode == 2, proc.stderr[-1500:]
    err = proc.stderr.strip()
    assert "pilot" not in err.lower() and "Traceback" not in err
    assert "classes" in err.splitlines()[-1]
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.json"))


def test_a_named_recipe_is_said_to_be_the_users(tmp_path, capsys, one_thread):
    from fadrm_ray.recipes import recipe_reason

    assert recipe_reason("cifar", 32, 3, given=True).startswith("cifar, as set (auto takes cifar for 3-channel")
    assert "auto's choice" not in recipe_reason("cifar", 32, 3, given=True)
    data = _colour_folder(tmp_path / "c", 3, per_class=5)
    _teacher(data, tmp_path)
    assert main(["distill", "--local", "--dataset", f"imagefolder:{data}", "--teacher", str(tmp_path / "t" / "teacher.pt"),
                 "--ipc", "1", "--set", "recipe=cifar", "--set", "iterations=2", "--out", str(tmp_path / "store"),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if text.startswith("recipe:"))
    assert line.startswith("recipe: cifar, as set") and "auto's choice" not in line
    run_dir = next(p for p in (tmp_path / "store").iterdir() if (p / "config.yaml").is_file())
    assert main(["info", "--run", str(run_dir)]) == 0
    assert "cifar, as set" in capsys.readouterr().out


def test_a_renamed_dataset_folder_is_the_same_data(tmp_path, capsys, one_thread):
    """The fingerprint is of the content: the folder's name is not part of it."""
    from fadrm_ray.data import get_dataset

    data = _colour_folder(tmp_path / "shapes", 3, per_class=5)
    before = get_dataset(f"imagefolder:{data}").fingerprint()
    run_dir = _tiny_run(data, tmp_path, capsys, "cifar")
    renamed = data.rename(tmp_path / "shapes-v2")
    assert get_dataset(f"imagefolder:{renamed}").fingerprint() == before
    assert main(["evaluate", "--run", run_dir, "--dataset", f"imagefolder:{renamed}", "--seeds", "1", "--epochs", "1",
                 "--no-baselines", "--no-ranking", "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["top1_mean"] >= 0
    # other content under the same name is other data
    shutil.copytree(renamed, tmp_path / "shapes")
    next((tmp_path / "shapes" / "class00").iterdir()).unlink()
    assert get_dataset(f"imagefolder:{tmp_path / 'shapes'}").fingerprint() != before


def test_a_fingerprint_recorded_with_the_folders_name_still_matches(tmp_path):
    """Runs and teachers recorded before the name was left out carry the older fingerprint."""
    from fadrm_ray.data import get_dataset

    data = get_dataset(f"imagefolder:{_colour_folder(tmp_path / 'old-name', 2, per_class=5)}")
    older = data._hash(data.name)
    assert older != data.fingerprint() and data.matches(older) and data.matches(data.fingerprint())
    assert not data.matches("0" * 16)


@pytest.fixture(scope="module")
def digits_folders(tmp_path_factory):
    """digits written as an ImageFolder (train/ and test/ of its own split), and the same with the
    folders of classes 0 and 1 swapped."""
    from PIL import Image

    from fadrm_ray.data import get_dataset

    digits = get_dataset("digits")
    root = tmp_path_factory.mktemp("digits-folders")
    for name, swap in (("plain", {}), ("swapped", {0: 1, 1: 0})):
        for split_name, split in (("train", digits.train), ("test", digits.test)):
            images = split.load(torch.arange(len(split)))
            for i, (image, label) in enumerate(zip(images, split.labels.tolist())):
                folder = root / name / split_name / str(swap.get(label, label))
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image[0].numpy()).save(folder / f"{i}.png")
    return root / "plain", root / "swapped"


def test_weights_of_another_class_order_are_refused_naming_the_classes(digits_teacher, digits_folders, tmp_path,
                                                                       capsys):
    plain, swapped = digits_folders
    state = torch.load(digits_teacher[0], weights_only=True)["state_dict"]
    torch.save(state, tmp_path / "weights.pth")
    common = ["import-teacher", "--model", "convnet-bn", "--model-arg", "width=32", "--weights",
              str(tmp_path / "weights.pth"), "--mean", "0.5", "--std", "0.5"]
    assert main([*common, "--dataset", f"imagefolder:{plain}", "--out", str(tmp_path / "plain.pt"), "--quiet"]) == 0
    capsys.readouterr()
    assert main([*common, "--dataset", f"imagefolder:{swapped}", "--out", str(tmp_path / "swapped.pt"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'0' predicted as '1'" in err and "'1' predicted as '0'" in err and "--class-order" in err
    assert not (tmp_path / "swapped.pt").exists()
    # the order given: the weights' output 0 is this folder's class '1', output 1 its class '0'
    assert main([*common, "--dataset", f"imagefolder:{swapped}", "--out", str(tmp_path / "swapped.pt"),
                 "--class-order", "1,0,2,3,4,5,6,7,8,9", "--quiet", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["top1"] > 50 and any("reordered" in w for w in result["warnings"])


def test_a_baseline_of_the_same_images_as_another_is_reported_once(tmp_path, capsys, one_thread):
    """Under the gentle recipe the starting patches are random whole images: random real images,
    byte for byte. One row, one set of students."""
    data = _colour_folder(tmp_path / "c", 3, per_class=6)
    run_dir = _tiny_run(data, tmp_path, capsys, "gentle")
    assert main(["evaluate", "--run", run_dir, "--seeds", "2", "--epochs", "1", "--no-ranking", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "its starting patches: the same images as random real images" in out
    assert main(["evaluate", "--run", run_dir, "--seeds", "2", "--epochs", "1", "--no-ranking", "--quiet",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["baselines"]["starting_patches"]["same_as"] == "random_real"
    assert set(result["paired_gains"]) == {"random_real"}
    from fadrm_ray.store import open_run

    random_dir = result["baselines"]["random_real"]["run_dir"]
    assert list(open_run(random_dir).layout.evaluations_dir.glob("*.json"))  # its students are kept there
    # Known from the configs: the starting patches are never distilled, and name the run that holds them.
    assert result["baselines"]["starting_patches"]["run_dir"] == random_dir
    assert not list((tmp_path / "store").glob("patches-*"))


def test_a_pilot_budget_of_zero_skips_the_pilot_and_a_negative_one_is_refused(tmp_path, capsys, one_thread):
    data = _colour_folder(tmp_path / "c", 3, per_class=5)
    _teacher(data, tmp_path)
    capsys.readouterr()
    base = ["distill", "--local", "--dataset", f"imagefolder:{data}", "--teacher", str(tmp_path / "t" / "teacher.pt"),
            "--ipc", "1", "--set", "iterations=2", "--out", str(tmp_path / "store"), "--quiet"]
    assert main([*base, "--pilot-budget", "-5"]) == 2
    assert "--pilot-budget" in capsys.readouterr().err
    assert main([*base, "--pilot-budget", "0"]) == 0
    out, err = capsys.readouterr()
    assert "pilot skipped: --pilot-budget 0" in err and "recipe: cifar" in out
    assert not (tmp_path / "store" / ".pilots").exists()


def test_classes_by_name_as_the_service_takes_them():
    from fadrm_ray.cli.common import CLIError, parse_classes

    names = ["cat", "dog", "étoile", "7"]
    assert parse_classes("0,2", names) == [0, 2]
    assert parse_classes("dog,étoile", names) == [1, 2]
    assert parse_classes("7", names) == [3]  # a class named like a number is that class
    with pytest.raises(CLIError, match="'cow' is neither; the dataset's classes are cat, dog"):
        parse_classes("cat,cow", names)
    with pytest.raises(CLIError, match="more than once"):
        parse_classes("cat,0", names)


def test_a_cluster_job_names_its_relative_paths():
    from actors.job import relative_paths

    argv = ["distill", "--dataset", "imagefolder:data/x", "--teacher", "/abs/t.pt", "--teacher", "t2.pt",
            "--out", "store", "--dataset", "cifar100"]
    assert relative_paths(argv) == ["--dataset imagefolder:data/x", "--teacher t2.pt", "--out store"]


def test_info_in_a_pipe_that_closes_early_is_not_an_error(small_run, monkeypatch, capsys):
    """`fadrm info | head -1`: the reader leaves, the next write fails with EPIPE."""
    import io

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["info", "--run", str(small_run)]) == 0
    monkeypatch.undo()
    assert "Broken pipe" not in capsys.readouterr().err


def test_a_teacher_well_below_the_full_data_student_is_named_the_weak_part():
    from fadrm_ray.evaluation.baselines import weak_teacher
    from fadrm_ray.evaluation.ranking import TEACHERS_RECORD
    from fadrm_ray.evaluation.scores import Ranking

    from fadrm_ray.teacher_record import ImportRecord, TeacherRecord

    squeezed = TeacherRecord(model_name="convnet-bn", test_accuracy=67.5, squeeze_config={"epochs": 20})
    line = weak_teacher(Ranking(full_hard_top1=93.5), [squeezed])
    assert "the teacher is the weak part" in line and "26.0 points below" in line
    assert "(`fadrm squeeze --epochs 80`)" in line  # four times its own 20 epochs
    # Imported: the remedy is where its weights came from, not squeeze.
    imported = TeacherRecord(model_name="timm:resnet18", test_accuracy=67.5, imported=ImportRecord(
        source="file /w/sprites.safetensors", normalization="flags", eval_images=100, chance=10.0))
    line = weak_teacher(Ranking(full_hard_top1=93.5), [imported])
    assert "squeeze" not in line and "trained elsewhere (file /w/sprites.safetensors)" in line
    assert "`fadrm import-teacher --model timm:resnet18 --weights FILE`" in line
    assert weak_teacher(Ranking(full_hard_top1=93.5), [squeezed.model_copy(update={"test_accuracy": 90.0})]) is None
    assert weak_teacher(Ranking(full_hard_top1=93.5, full_source=TEACHERS_RECORD), [squeezed]) is None
    assert weak_teacher(Ranking(), [squeezed]) is None and weak_teacher(None, [squeezed]) is None
