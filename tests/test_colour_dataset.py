"""`clipart10`: Openclipart's category folders as a 32 x 32 colour benchmark, split so that no
drawing, copy or variant of it is on both sides. The images here are tiny PNGs the tests draw in
a folder laid out like the package's; never the installed package."""
from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from fadrm_ray.cli import main
from fadrm_ray.data import DATASET_NAMES, DatasetError, get_dataset
from fadrm_ray.data import clipart10
from fadrm_ray.data.clipart10 import CLASS_NAMES, CLASSES
from fadrm_ray.store import open_run

PER_CLASS = 8


def drawing(seed: int, size: int = 40) -> Image.Image:
    """A few filled shapes in random colours on a transparent canvas, drawn at 64 px and resized."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    pen = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = (int(v) for v in rng.integers(0, 40, 2))
        x1, y1 = x0 + int(rng.integers(12, 24)), y0 + int(rng.integers(12, 24))
        colour = tuple(int(v) for v in rng.integers(0, 200, 3)) + (255,)
        (pen.ellipse if rng.random() < 0.5 else pen.rectangle)((x0, y0, x1, y1), fill=colour)
    return image.resize((size, size), Image.LANCZOS)


def save(image: Image.Image, path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def write_clipart(root) -> dict[str, list[str]]:
    """PER_CLASS drawings in every class's first folder under `root`/openclipart, and the planted
    duplicates; returns the paths (relative to that folder) of each planted set."""
    top = root / "openclipart"
    for label, (name, folders, _) in enumerate(CLASSES):
        for k in range(PER_CLASS):
            save(drawing(100 * label + k), top / folders[0] / f"{name}_{'abcdefghij'[k]}.png")
    animals = top / "animals"
    save(drawing(0, size=120), animals / "enlarged_q.png")  # animal_a at three times the size
    save(drawing(1).transpose(Image.FLIP_LEFT_RIGHT), animals / "birds" / "mirror_w.png")  # animal_b mirrored
    shutil.copyfile(animals / "animal_c.png", animals / "same_bytes_z.png")
    os.symlink("../animals/animal_d.png", top / "food" / "linked_y.png")
    save(drawing(5000), top / "transportation" / "boat_01.png")
    save(drawing(5001), top / "transportation" / "boat-2.png")
    save(drawing(5002), top / "people" / "clothing" / "hat.png")  # a left-out subfolder
    save(drawing(5003), top / "transportation" / "roadsigns" / "stop.png")
    save(drawing(5004), top / "unsorted" / "orphan_k.png")  # in no class folder: its link's class
    os.symlink("../unsorted/orphan_k.png", top / "tools" / "orphan_link_k.png")
    return {"resized": ["animals/animal_a.png", "animals/enlarged_q.png"],
            "mirrored": ["animals/animal_b.png", "animals/birds/mirror_w.png"],
            "stem": ["transportation/boat_01.png", "transportation/boat-2.png"]}


@pytest.fixture
def no_package(monkeypatch, tmp_path):
    """As on a machine without the Debian package, whatever this one has; a cache of the test's own."""
    monkeypatch.setattr(clipart10, "DPKG_LIST", tmp_path / "no-dpkg.list")
    monkeypatch.setattr(clipart10, "PACKAGE_DIR", tmp_path / "no-package")
    monkeypatch.delenv("FADRM_DATA", raising=False)
    monkeypatch.setenv("FADRM_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def planted(tmp_path, no_package):
    return write_clipart(tmp_path / "data")


def test_the_folders_become_ten_classes_of_32_px_rgb(tmp_path, planted):
    ds = get_dataset("clipart10", root=str(tmp_path / "data"))
    assert "clipart10" in DATASET_NAMES and ds.name == "clipart10" and ds.class_names == CLASS_NAMES
    assert (ds.image_size, ds.channels, ds.hflip, len(ds.mean), len(ds.std)) == (32, 3, True, 3, 3)
    # One per drawing: the same-bytes copy and the link count once, the left-out folders not at all.
    assert len(ds.train) + len(ds.test) == 10 * PER_CLASS + 5
    assert ds.info["same_bytes"] == 1 and ds.info["files"] == 10 * PER_CLASS + 6
    images = ds.train.load(torch.arange(len(ds.train)))
    assert images.shape == (len(ds.train), 3, 32, 32) and images.dtype == torch.uint8
    assert ds.test.load([0]).shape == (1, 3, 32, 32)
    for c in range(10):
        assert len(ds.train.indices_of_class(c)) >= 1 and len(ds.test.indices_of_class(c)) >= 1
    assert int(torch.bincount(torch.cat([ds.train.labels, ds.test.labels]))[0]) == PER_CLASS + 2
    small = get_dataset("clipart10", root=str(tmp_path / "data"), image_size=16)
    assert small.train.load([0]).shape == (1, 3, 16, 16)


def test_the_split_is_deterministic_and_built_once(tmp_path, planted, monkeypatch):
    first = get_dataset("clipart10", root=str(tmp_path / "data"))
    assert first.info["build"] == "built" and os.path.isfile(first.info["cache"])
    again = get_dataset("clipart10", root=str(tmp_path / "data"))
    assert again.info["build"] == "cache" and again.fingerprint() == first.fingerprint()
    # Built afresh, elsewhere, from a copy in another place: the same images on the same sides.
    shutil.copytree(tmp_path / "data", tmp_path / "moved", symlinks=True)
    monkeypatch.setenv("FADRM_CACHE", str(tmp_path / "other-cache"))
    moved = get_dataset("clipart10", root=str(tmp_path / "moved"))
    assert moved.info["build"] == "built" and moved.fingerprint() == first.fingerprint()
    assert torch.equal(moved.test.load(torch.arange(len(moved.test))), first.test.load(torch.arange(len(first.test))))


def test_near_duplicates_never_straddle_the_split(tmp_path, planted):
    root = tmp_path / "data" / "openclipart"
    arrays = clipart10.build(root, clipart10.list_files(root))
    side = {str(p): bool(t) for p, t in zip(arrays["paths"], arrays["test"])}
    assert "animals/same_bytes_z.png" not in side and "food/linked_y.png" not in side
    assert "people/clothing/hat.png" not in side and "transportation/roadsigns/stop.png" not in side
    for name, paths in planted.items():
        assert len({side[p] for p in paths}) == 1, name
    for g in np.unique(arrays["groups"]):
        assert len(set(arrays["test"][arrays["groups"] == g].tolist())) == 1
    # The link is read once, in the class of the folder its file lies in.
    labels = dict(zip(map(str, arrays["paths"]), arrays["labels"].tolist()))
    assert labels["animals/animal_d.png"] == CLASS_NAMES.index("animal")
    assert labels["tools/orphan_link_k.png"] == CLASS_NAMES.index("tool") and "unsorted/orphan_k.png" not in labels
    groups = dict(zip(map(str, arrays["paths"]), arrays["groups"].tolist()))
    for paths in planted.values():
        assert groups[paths[0]] == groups[paths[1]]
    assert len(set(groups.values())) == len(groups) - len(planted)  # nothing else joined


def test_the_name_stem_and_group_split():
    assert clipart10.name_stem("x/dog_01_drawn_with_strai_02.png") == "dog_01_drawn_with_strai"
    assert clipart10.name_stem("bus1_bw_jarno_vasamaa_01.png") == clipart10.name_stem("bus1_jarno_vasamaa1.png")
    assert clipart10.name_stem("Tree-small.png") == clipart10.name_stem("tree_64x64.png") == "tree"
    assert clipart10.name_stem("01.png") == "" and clipart10.name_stem("white_s_7.png") == "white_s"
    assert clipart10.name_stem("people_krug_08a.png") == clipart10.name_stem("people_krug_08b.png") == "people_krug"
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(60), rng.integers(1, 6, 60))
    labels = groups % 3
    paths = [f"p{i}" for i in range(len(groups))]
    test = clipart10.split_groups(paths, labels, groups, 0.25)
    assert np.array_equal(test, clipart10.split_groups(paths, labels, groups, 0.25))
    for g in np.unique(groups):
        assert len(set(test[groups == g].tolist())) == 1
    for c in range(3):
        share = test[labels == c].mean()
        assert 0.15 <= share <= 0.3, (c, share)


def test_render_flattens_alpha_and_crops_to_the_drawing(monkeypatch):
    canvas = Image.new("RGBA", (100, 60), (0, 0, 0, 0))
    ImageDraw.Draw(canvas).rectangle((80, 40, 89, 49), fill=(255, 0, 0, 255))
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    out = clipart10.render(buf.getvalue())
    assert out.shape == (32, 32, 3) and (out == [255, 0, 0]).all()  # the square fills the frame
    glass = Image.new("RGBA", (20, 10), (0, 0, 255, 128))
    buf = io.BytesIO()
    glass.save(buf, format="PNG")
    out = clipart10.render(buf.getvalue())
    assert np.abs(out[16, 16].astype(int) - [127, 127, 255]).max() <= 1  # half blue over white
    assert (out[0, 0] == 255).all()  # padded square: the background above the wide drawing
    assert clipart10.render(b"not an image") is None
    monkeypatch.setattr(clipart10, "MAX_PIXELS", 100)
    assert clipart10.render(buf.getvalue()) is None  # too large to decode: left out


def test_without_the_package_one_line_names_it(tmp_path, no_package, monkeypatch):
    with pytest.raises(DatasetError) as err:
        get_dataset("clipart10", root=str(tmp_path / "nothing"))
    message = str(err.value)
    assert "\n" not in message and "apt-get install openclipart-png" in message
    assert str(tmp_path / "nothing" / "openclipart") in message and "FADRM_DATA" in message
    # FADRM_DATA is where it looks when no root is given, and the package's own list is read too.
    write_clipart(tmp_path / "env")
    monkeypatch.setenv("FADRM_DATA", str(tmp_path / "env"))
    assert get_dataset("clipart10").info["source"] == str(tmp_path / "env" / "openclipart")
    monkeypatch.delenv("FADRM_DATA")
    installed = tmp_path / "usr" / "share" / "openclipart" / "png"  # wherever the package's list says
    shutil.copytree(tmp_path / "env" / "openclipart", installed, symlinks=True)
    listing = tmp_path / "dpkg.list"
    listing.write_text(f"/.\n/usr\n{installed}\n{installed / 'animals'}\n")
    monkeypatch.setattr(clipart10, "DPKG_LIST", listing)
    assert get_dataset("clipart10", root=str(tmp_path / "nothing")).info["source"] == str(installed)


def test_squeeze_and_distill_from_another_directory(tmp_path, planted, monkeypatch, capsys, one_thread):
    monkeypatch.setenv("FADRM_DATA", str(tmp_path / "data"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["squeeze", "--dataset", "clipart10", "--model", "convnet-bn", "--epochs", "1", "--out", "t",
                 "--threads", "1", "--quiet", "--json"]) == 0
    capsys.readouterr()
    code = main(["distill", "--local", "--dataset", "clipart10", "--teacher", "t/teacher.pt", "--ipc", "1",
                 "--set", "iterations=2", "--set", "precision=fp32", "--set", "recipe=cifar", "--out", "store",
                 "--device", "cpu", "--threads", "1", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    images, labels, _ = open_run(json.loads(out)["run_dir"]).read()
    assert images.shape == (10, 3, 32, 32) and sorted(labels.tolist()) == list(range(10))
