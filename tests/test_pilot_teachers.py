"""`fadrm distill` loads its teachers once: the pilot takes them as the command loaded them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from fadrm_ray import models, pilot
from fadrm_ray.cli import main


def _colour_folder(root: Path, per_class: int) -> Path:
    """Random colour images in four class folders, train and val."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for label in range(4):
            folder = root / split / f"c{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def test_the_pilot_of_fadrm_distill_neither_loads_nor_hashes_its_teachers_again(tmp_path, capsys, monkeypatch,
                                                                                  one_thread):
    data = f"imagefolder:{_colour_folder(tmp_path / 'colour', 4)}"
    assert main(["squeeze", "--dataset", data, "--epochs", "1", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    teacher = tmp_path / "t" / "teacher.pt"
    loads, hashes = [], []
    real_load, real_hash = models.load_teacher, pilot.sha256_file

    def counting_load(path, *args, **kwargs):
        loads.append(Path(path))
        return real_load(path, *args, **kwargs)

    def counting_hash(path):
        hashes.append(Path(path))
        return real_hash(path)

    for module in (models, pilot):
        monkeypatch.setattr(module, "load_teacher", counting_load)
    monkeypatch.setattr(pilot, "sha256_file", counting_hash)
    capsys.readouterr()
    # The pilot runs (its probe loads what it measures with), then is skipped over its bound.
    assert main(["distill", "--local", "--dataset", data, "--teacher", str(teacher), "--ipc", "1", "--set",
                 "iterations=2", "--out", str(tmp_path / "store"), "--quiet", "--pilot-set", "free_seconds=0",
                 "--pilot-set", "max_share=0.001"]) == 0
    assert "pilot skipped: it would take about" in capsys.readouterr().err
    assert loads == [teacher] and hashes == []


def test_a_teacher_handed_to_the_pilot_stays_on_the_callers_device():
    model = models.create_model("convnet-bn", 4, in_chans=3, image_size=16)
    assert pilot._placed(model, "cpu") is model
    elsewhere = pilot._placed(model, "meta")
    assert elsewhere is not model and next(elsewhere.parameters()).device.type == "meta"
    assert next(model.parameters()).device.type == "cpu"
