"""A user's own image folder: its splits (a training folder named beside its val/ is refused,
naming the parent; a split made here is said by the command that makes it and recorded in the
run) and its identity (the fingerprint is of the content, not of the folder's name)."""
from __future__ import annotations

import json
import shutil

import pytest

from fadrm_ray.cli import main
from tests.folder_helpers import colour_folder, grey_folder, tiny_run


def test_a_training_folder_beside_its_val_folder_is_refused_naming_the_parent(tmp_path, capsys):
    from fadrm_ray.data import get_dataset
    from fadrm_ray.data.base import DatasetError

    data = grey_folder(tmp_path / "inet", {"train": 4, "val": 2})
    with pytest.raises(DatasetError, match=f"name the parent, imagefolder:{data}"):
        get_dataset(f"imagefolder:{data / 'train'}")
    assert main(["squeeze", "--dataset", f"imagefolder:{data / 'train'}", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"imagefolder:{data}" in err and "val/" in err
    assert get_dataset(f"imagefolder:{data}").split_note() is None  # its own val/ is the test split


def test_a_split_made_here_is_said_by_each_command_and_recorded_in_the_run(tmp_path, capsys, one_thread):
    from fadrm_ray.store import open_run

    data = f"imagefolder:{grey_folder(tmp_path / 'flat', {'': 10})}"
    assert main(["squeeze", "--dataset", data, "--epochs", "1", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "note: imagefolder:flat has no test split of its own: its test images are 6 of its 30 images" in err
    assert main(["distill", "--local", "--dataset", data, "--teacher", str(tmp_path / "t" / "teacher.pt"), "--ipc", "1",
                 "--set", "iterations=2", "--out", str(tmp_path / "store"), "--quiet", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "no test split of its own" in err
    recorded = open_run(json.loads(out)["run_dir"]).provenance.dataset.test_split
    assert recorded.startswith("held out per class by a fixed stratified split (20% of each class)")


def test_a_renamed_dataset_folder_is_the_same_data(tmp_path, capsys, one_thread):
    """The fingerprint is of the content: the folder's name is not part of it."""
    from fadrm_ray.data import get_dataset

    data = colour_folder(tmp_path / "shapes", 3, per_class=5)
    before = get_dataset(f"imagefolder:{data}").fingerprint()
    run_dir = tiny_run(data, tmp_path, capsys, "cifar")
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

    data = get_dataset(f"imagefolder:{colour_folder(tmp_path / 'old-name', 2, per_class=5)}")
    older = data._hash(data.name)
    assert older != data.fingerprint() and data.matches(older) and data.matches(data.fingerprint())
    assert not data.matches("0" * 16)
