"""Dirty image folders: every file that cannot be read is found in the one listing pass and named
(refused without `--skip-bad-images`, left out with it and recorded in the run, which reopens
leaving out the same files); grey and RGBA images converted and stray files ignored are counted
in one note."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fadrm_ray import codec
from fadrm_ray.cli import main
from fadrm_ray.data import DatasetError, get_dataset, skipping_bad_images
from fadrm_ray.data import listing as listing_mod

BAD = ("c0/corrupt.jpg", "c1/truncated.jpg")
# What the decoder says of each (codec.check_file).
WHY = ("unreadable: cannot identify image file", "unreadable: image file is truncated (180 bytes not processed)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("FADRM_CACHE", str(folder))
    return folder


def _colour(rng, c: int, size: int) -> np.ndarray:
    x = np.clip(rng.normal(60 + 60 * c, 40, (size, size, 3)), 0, 255).astype(np.uint8)
    x[..., c % 3] = 255  # each class its own colour
    return x


def _dirty_folder(root: Path, classes: int = 3, per_class: int = 6, size: int = 32) -> Path:
    """Colour JPEGs in root/<class>/, and: a corrupt JPEG (random bytes), a JPEG cut short in its
    pixels, a grey PNG, an RGBA PNG and a stray text file."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        for i in range(per_class):
            (root / f"c{c}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(_colour(rng, c, size)).save(root / f"c{c}" / f"{i}.jpg", quality=95)
    whole = (root / "c1" / "0.jpg").read_bytes()
    (root / BAD[0]).write_bytes(rng.integers(0, 256, 900, dtype=np.uint8).tobytes())
    (root / BAD[1]).write_bytes(whole[:-200])
    Image.fromarray(np.full((size, size), 140, np.uint8), "L").save(root / "c1" / "grey.png")
    Image.fromarray(np.dstack([_colour(rng, 2, size), np.full((size, size), 200, np.uint8)]), "RGBA").save(
        root / "c2" / "rgba.png")
    (root / "c2" / "notes.txt").write_text("not an image")
    return root


def _age(root: Path, seconds: int = 3600) -> None:
    """Every file and folder under `root` dated `seconds` back: a tree still long enough to cache."""
    past = time.time() - seconds
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            os.utime(os.path.join(dirpath, name), (past, past))
        os.utime(dirpath, (past, past))


def test_each_bad_file_is_found_from_its_head_and_its_end(tmp_path):
    rng = np.random.default_rng(1)
    Image.fromarray(_colour(rng, 0, 32)).save(tmp_path / "whole.jpg", quality=95)
    whole = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(whole[:-200])           # cut in its pixels: no end marker
    (tmp_path / "padded.jpg").write_bytes(whole + bytes(300))  # whole, then padding: decodes
    (tmp_path / "head.jpg").write_bytes(whole[:40])            # cut inside its header
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "noise.png").write_bytes(rng.integers(0, 256, 500, dtype=np.uint8).tobytes())
    Image.fromarray(rng.integers(0, 256, (40, 60), dtype=np.uint8), "L").save(tmp_path / "grey.png")
    png = (tmp_path / "grey.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(png[:len(png) // 2])    # cut in its pixels: no IEND chunk
    # Garbage behind a whole JPEG header (up to its scan's start): not cut short, not decodable.
    scan = whole.find(b"\xff\xda")
    header = whole[:scan + 2 + int.from_bytes(whole[scan + 2:scan + 4], "big")]
    garbage = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()  # libjpeg gives up on it
    (tmp_path / "garbage.jpg").write_bytes(header + garbage)
    found = {p.name: codec.check_file(str(p)) for p in tmp_path.iterdir()}
    # Each unreadable file with the decoder's own reason: "truncated" only where the decoder says so.
    assert found.pop("cut.jpg").problem.startswith("unreadable: image file is truncated (")
    assert {name: c.problem for name, c in found.items()} == {
        "whole.jpg": None, "padded.jpg": None, "head.jpg": "unreadable: Truncated File Read", "empty.png": "empty",
        "noise.png": "unreadable: cannot identify image file", "grey.png": None,
        "cut.png": "unreadable: image file is truncated", "garbage.jpg":
        "unreadable: broken data stream when reading image file"}
    assert found["grey.png"][1:] == ("L", 60, 40) and found["whole.jpg"].mode == "RGB"
    assert codec.check_file(str(tmp_path / "missing.jpg")).problem.startswith("unreadable: [Errno 2] No such file")


def test_a_dirty_folder_is_refused_naming_every_bad_file_and_kept_in_the_cache(tmp_path, cache):
    root = _dirty_folder(tmp_path / "dirty")
    _age(root)
    for _ in range(2):  # walked and checked once, then refused again from the cached listing
        with pytest.raises(DatasetError) as refused:
            get_dataset(f"imagefolder:{root}")
        said = str(refused.value)
        assert "\n" not in said and "2 of its 22 image files cannot be read" in said
        assert f"{BAD[0]} ({WHY[0]})" in said and f"{BAD[1]} ({WHY[1]})" in said and "--skip-bad-images" in said
    data = get_dataset(f"imagefolder:{root}", skip_bad_images=True)
    assert data.info["listing"] == "cache" and data.channels == 3
    assert (len(data.train), len(data.test)) == (17, 3)
    assert data.info["notes"][0] == ("imagefolder:dirty: 1 grey and 1 RGBA images converted to RGB, "
                                     "1 file that is not an image ignored")
    assert data.describe()["skipped_images"] == 2
    images = data.train.load(list(range(len(data.train))))  # every kept file decodes
    assert images.shape == (17, 3, 32, 32)
    # The same data as the folder without its bad files: the fingerprint covers the files kept.
    for rel in BAD:
        (root / rel).unlink()
    clean = get_dataset(f"imagefolder:{root}")
    assert clean.info["listing"] == "walked" and clean.fingerprint() == data.fingerprint()
    assert clean.describe().get("skipped_images") is None and clean.info["notes"] == [data.info["notes"][0]]


def test_many_bad_files_are_all_listed_in_a_file_beside_the_listing(tmp_path, cache):
    root = _dirty_folder(tmp_path / "many")
    noise = np.random.default_rng(2).integers(0, 256, 600, dtype=np.uint8).tobytes()
    extra = [f"c{i % 3}/bad{i:02d}.png" for i in range(12)]
    for rel in extra:
        (root / rel).write_bytes(noise)
    with pytest.raises(DatasetError) as refused:
        get_dataset(f"imagefolder:{root}")
    listed = listing_mod.bad_list_file(root)
    said = str(refused.value)
    assert "14 of its 34 image files" in said and f"and 9 more (all listed in {listed})" in said
    lines = listed.read_text().splitlines()
    assert sorted(lines) == sorted(f"{root.resolve() / rel}\t{why}" for rel, why in
                                   [*zip(BAD, WHY)] + [(r, WHY[0]) for r in extra])
    notes = get_dataset(f"imagefolder+skip-bad-images:{root}").info["notes"]
    assert notes[1] == (f"imagefolder:many: 14 of its 34 image files cannot be read and are left out "
                        f"(--skip-bad-images), each listed in {listed}")


def test_a_class_with_no_readable_image_is_refused_and_the_option_is_for_folders(tmp_path, cache):
    root = _dirty_folder(tmp_path / "hollow")
    for path in (root / "c0").glob("*.jpg"):
        path.write_bytes(b"")
    with pytest.raises(DatasetError, match="class 'c0' of .* has no readable training image: its 7 image files"):
        get_dataset(f"imagefolder:{root}", skip_bad_images=True)
    with pytest.raises(DatasetError, match="--skip-bad-images is for image folders"):
        get_dataset("digits", skip_bad_images=True)
    with pytest.raises(DatasetError, match="--skip-bad-images is for image folders"):
        skipping_bad_images("cifar10")
    with pytest.raises(DatasetError, match="only image folders take an option"):
        get_dataset(f"imagefolder+shuffle:{root}")
    assert skipping_bad_images(f"imagefolder:{root}") == f"imagefolder+skip-bad-images:{root}"
    assert skipping_bad_images(f"imagefolder+skip-bad-images:{root}") == f"imagefolder+skip-bad-images:{root}"


def test_a_grey_folder_counts_what_it_converts_to_grey_and_a_clean_one_says_nothing(tmp_path, cache):
    for c in ("a", "b"):
        (tmp_path / "grey" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((8, 8), 40 * i + (c == "b"), np.uint8), "L").save(tmp_path / "grey" / c / f"{i}.png")
    assert get_dataset(f"imagefolder:{tmp_path / 'grey'}").info["notes"] == []
    Image.fromarray(np.full((8, 8, 2), 90, np.uint8), "LA").save(tmp_path / "grey" / "a" / "la.png")
    Image.fromarray(np.full((8, 8), 300, np.uint16)).save(tmp_path / "grey" / "b" / "deep.png")
    (tmp_path / "grey" / "b" / ".DS_Store").write_bytes(b"hidden: not counted")
    data = get_dataset(f"imagefolder:{tmp_path / 'grey'}")
    assert data.channels == 1 and len(data.train) + len(data.test) == 8
    assert data.info["notes"] == ["imagefolder:grey: 1 16-bit and 1 grey+alpha images converted to grey"]


def test_a_dirty_folder_distilled_with_skip_bad_images_and_its_run_reopened(tmp_path, cache, capsys, one_thread):
    from fadrm_ray.store import open_run

    root = _dirty_folder(tmp_path / "dirty")
    data = f"imagefolder:{root}"
    teacher = tmp_path / "t" / "teacher.pt"
    assert main(["squeeze", "--dataset", data, "--epochs", "1", "--out", str(tmp_path / "t"), "--quiet"]) == 2
    assert main(["squeeze", "--dataset", data, "--skip-bad-images", "--epochs", "1", "--out", str(tmp_path / "t"),
                 "--quiet"]) == 0
    capsys.readouterr()
    distill = ["distill", "--local", "--dataset", data, "--teacher", str(teacher), "--ipc", "1", "--set",
               "iterations=2", "--set", "recipe=cifar", "--out", str(tmp_path / "store"), "--quiet", "--json"]

    assert main(distill) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1
    assert all(rel in err for rel in BAD) and "--skip-bad-images" in err
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())

    assert main([*distill, "--skip-bad-images"]) == 0
    out, err = capsys.readouterr()
    assert [err.count(rel) for rel in BAD] == [1, 1]  # every skipped file named once
    assert "note: imagefolder:dirty: 2 of its 22 image files cannot be read and are left out" in err
    assert "note: imagefolder:dirty: 1 grey and 1 RGBA images converted to RGB, 1 file that is not an image " \
           "ignored" in err
    run_dir = json.loads(out)["run_dir"]
    recorded = open_run(run_dir).provenance.dataset
    assert recorded.skipped_images == 2
    assert recorded.skipped_files == [f"{rel} ({why})" for rel, why in zip(BAD, WHY)]
    assert recorded.spec == f"imagefolder+skip-bad-images:{root.resolve()}"
    assert recorded.fingerprint == get_dataset(data, skip_bad_images=True).fingerprint()

    evaluate = ["evaluate", "--run", run_dir, "--seeds", "1", "--epochs", "1", "--no-baselines", "--quiet", "--json"]
    assert main(evaluate) == 0  # the recorded spec leaves out the same files: the fingerprint matches
    assert len(json.loads(capsys.readouterr().out)["top1_per_seed"]) == 1
    moved = tmp_path / "moved"
    root.rename(moved)
    assert main([*evaluate, "--dataset", f"imagefolder:{moved}"]) == 2  # its bad files refused again
    assert "--skip-bad-images" in capsys.readouterr().err
    assert main([*evaluate, "--dataset", f"imagefolder:{moved}", "--skip-bad-images"]) == 0
