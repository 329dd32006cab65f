"""Parallel decoding, prefetch, ImageNet's flat val/ folder and the listing cache of image folders."""
from __future__ import annotations

import gzip
import json
import os
import time

import numpy as np
import pytest
import torch
from PIL import Image

from fadrm_ray.data import DatasetError, get_dataset
from fadrm_ray.data import listing as listing_mod
from fadrm_ray.data.common import decode_bytes, resize_uint8
from fadrm_ray.data.parallel import WORKERS_ENV, decode_workers, parallel_map, prefetch

WNIDS = ["n02119789", "n01440764", "n01443537"]  # not in sorted order on purpose


def _image(path, seed: int, size=(20, 15), mode="RGB"):
    """A small random image (JPEG or PNG by the suffix) with distinct content per seed."""
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)


def _mixed_folder(root, per_class=6):
    for c, name in enumerate(["a", "b"]):
        for i in range(per_class):
            seed = 100 * c + i
            if i % 3 == 0:
                _image(root / "train" / name / f"{i}.jpg", seed, size=(20 + i, 15))
            elif i % 3 == 1:
                _image(root / "train" / name / f"{i}.png", seed, size=(16, 16), mode="L")
            else:
                _image(root / "train" / name / f"{i}.png", seed, size=(13, 21))
        _image(root / "test" / name / "t.jpg", 999 + c)


def _age(root, seconds=3600):
    """Set every file and folder under `root` (and root) back by `seconds`: a tree that has been still."""
    past = time.time() - seconds
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            os.utime(os.path.join(dirpath, name), (past, past))
        os.utime(dirpath, (past, past))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("FADRM_CACHE", str(folder))
    return folder


# ---------------------------------------------------------------- parallel decoding

def test_parallel_load_equals_serial_bit_for_bit(tmp_path, monkeypatch, cache):
    _mixed_folder(tmp_path / "d")
    monkeypatch.setenv(WORKERS_ENV, "1")
    d = get_dataset(f"imagefolder:{tmp_path / 'd'}", image_size=12)
    order = torch.tensor([5, 0, 11, 3, 3, 7, 1, 10, 2, 9, 4, 8, 6])  # any order, repeats included
    serial = d.train.load(order)
    monkeypatch.setenv(WORKERS_ENV, "4")
    assert decode_workers() == 4
    parallel = d.train.load(order)
    assert parallel.dtype == torch.uint8 and parallel.shape == (13, 3, 12, 12)
    assert torch.equal(parallel, serial)
    # ... and equal to decoding each file by hand, in the request's order
    files = sorted(p for p in (tmp_path / "d" / "train").rglob("*") if p.is_file())
    by_hand = [resize_uint8(decode_bytes(files[i].read_bytes(), 3), 12) for i in order.tolist()]
    assert torch.equal(parallel, torch.stack(by_hand))


def test_parallel_map_keeps_order_and_raises_the_first_error():
    assert parallel_map(lambda x: x * x, list(range(50)), workers=4) == [x * x for x in range(50)]

    def fail_on(bad):
        def fn(x):
            if x in bad:
                time.sleep(0.01 if x == min(bad) else 0)  # the later failure happens first
                raise DatasetError(f"item {x}")
            return x
        return fn

    with pytest.raises(DatasetError, match="item 7"):
        parallel_map(fail_on({7, 8}), list(range(20)), workers=3)


def test_parallel_load_reports_the_first_bad_file_in_request_order(tmp_path, monkeypatch, cache):
    _mixed_folder(tmp_path)
    monkeypatch.setenv(WORKERS_ENV, "3")
    d = get_dataset(f"imagefolder:{tmp_path}")
    for name in ("2.png", "4.png"):
        bad = tmp_path / "train" / "a" / name
        bad.write_bytes(bad.read_bytes()[:30])
    with pytest.raises(DatasetError, match="4.png"):
        d.train.load([0, 1, 4, 3, 2, 5])
    with pytest.raises(DatasetError, match="2.png"):
        d.train.load([0, 1, 2, 3, 4, 5])


def test_decode_workers_setting(monkeypatch):
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert 1 <= decode_workers() <= torch.get_num_threads()
    monkeypatch.setenv(WORKERS_ENV, "0")
    with pytest.raises(DatasetError, match=WORKERS_ENV):
        decode_workers()


# ---------------------------------------------------------------- prefetch

def test_prefetch_yields_the_batches_in_order(tmp_path, monkeypatch, cache):
    _mixed_folder(tmp_path)
    monkeypatch.setenv(WORKERS_ENV, "2")
    d = get_dataset(f"imagefolder:{tmp_path}", image_size=8)
    chunks = list(torch.arange(len(d.train)).flip(0).split(5))
    got = list(prefetch(d.train.load, chunks))
    assert [c.tolist() for c, _ in got] == [c.tolist() for c in chunks]
    for chunk, batch in got:
        assert torch.equal(batch, d.train.load(chunk))
    assert list(prefetch(d.train.load, [])) == []
    one = list(prefetch(d.train.load, chunks[:1]))
    assert torch.equal(one[0][1], d.train.load(chunks[0]))


def test_prefetch_raises_a_decode_error_as_a_dataset_error(tmp_path, monkeypatch, cache):
    _mixed_folder(tmp_path)
    monkeypatch.setenv(WORKERS_ENV, "2")
    d = get_dataset(f"imagefolder:{tmp_path}")
    bad = tmp_path / "train" / "b" / "1.png"  # index 7
    bad.write_bytes(bad.read_bytes()[:30])
    seen = []
    with pytest.raises(DatasetError, match="1.png"):
        for chunk, _ in prefetch(d.train.load, torch.arange(12).split(3)):
            seen.append(chunk.tolist())
    assert seen == [[0, 1, 2], [3, 4, 5]]  # the batches before the bad one arrive first
    stream = prefetch(d.train.load, torch.arange(6).split(2))
    next(stream)
    stream.close()  # a consumer that stops early leaves nothing waiting


# ---------------------------------------------------------------- ImageNet's flat val/

def _imagenet(root, solution_at="root", val_labels=None, extra_rows=()):
    for k, wnid in enumerate(WNIDS):
        for i in range(2):
            _image(root / "train" / wnid / f"{wnid}_{i}.JPEG", 10 * k + i)
    val_labels = val_labels or {1: WNIDS[2], 2: WNIDS[0], 3: WNIDS[1], 4: WNIDS[0]}
    rows = ["ImageId,PredictionString"]
    for i, wnid in val_labels.items():
        _image(root / "val" / f"ILSVRC2012_val_{i:08d}.JPEG", 50 + i)
        rows.append(f"ILSVRC2012_val_{i:08d},{wnid} 1 2 10 12 {wnid} 3 3 9 9")
    rows.extend(extra_rows)
    csv_path = root / "LOC_val_solution.csv" if solution_at == "root" else root / "val" / "LOC_val_solution.csv"
    csv_path.write_text("\n".join(rows) + "\n")
    return csv_path


def test_flat_val_with_loc_solution_csv(tmp_path, cache):
    _imagenet(tmp_path, extra_rows=["ILSVRC2012_val_00000099,n01443537 1 1 2 2"])  # a row of an absent image
    d = get_dataset(f"imagefolder:{tmp_path}")
    assert d.class_names == sorted(WNIDS)  # torchvision's ImageNet order: sorted wnids
    assert d.info["layout"] == "train/val (flat, LOC_val_solution.csv)"
    assert len(d.train) == 6 and len(d.test) == 4
    index = {w: i for i, w in enumerate(d.class_names)}
    # ordered by label, then name: 3 (n01440764, label 0), 1 (label 1), then 2 and 4 (n02119789, label 2)
    assert d.test.labels.tolist() == sorted([index[WNIDS[2]], index[WNIDS[0]], index[WNIDS[1]], index[WNIDS[0]]])
    expect = [3, 1, 2, 4]
    for row, i in enumerate(expect):
        by_hand = resize_uint8(decode_bytes((tmp_path / "val" / f"ILSVRC2012_val_{i:08d}.JPEG").read_bytes(), 3), 224)
        assert torch.equal(d.test.load([row])[0], by_hand)


def test_flat_val_csv_in_val_folder_and_unlabelled_test_folder(tmp_path, cache):
    _imagenet(tmp_path, solution_at="val")
    _image(tmp_path / "test" / "ILSVRC2012_test_00000001.JPEG", 7)  # Kaggle's unlabelled test/ is passed over
    d = get_dataset(f"imagefolder:{tmp_path}")
    assert d.info["layout"].startswith("train/val (flat") and len(d.test) == 4


def test_flat_val_errors(tmp_path, cache):
    _imagenet(tmp_path / "unknown", val_labels={1: WNIDS[0], 2: "n09999999"})
    with pytest.raises(DatasetError, match="n09999999"):
        get_dataset(f"imagefolder:{tmp_path / 'unknown'}")
    _imagenet(tmp_path / "missing")
    _image(tmp_path / "missing" / "val" / "ILSVRC2012_val_00000042.JPEG", 1)
    with pytest.raises(DatasetError, match="ILSVRC2012_val_00000042.JPEG"):
        get_dataset(f"imagefolder:{tmp_path / 'missing'}")
    _imagenet(tmp_path / "nocsv").unlink()
    with pytest.raises(DatasetError, match="LOC_val_solution.csv"):
        get_dataset(f"imagefolder:{tmp_path / 'nocsv'}")


# ---------------------------------------------------------------- the listing cache

class _Counter:
    def __init__(self, monkeypatch):
        self.walks = self.scans = 0
        self.stats: list[str] = []
        walk, scandir, stat = os.walk, os.scandir, os.stat

        def counted_walk(*a, **k):
            self.walks += 1
            return walk(*a, **k)

        def counted_scandir(*a, **k):
            self.scans += 1
            return scandir(*a, **k)

        def counted_stat(path, *a, **k):
            self.stats.append(os.fspath(path))
            return stat(path, *a, **k)

        monkeypatch.setattr(os, "walk", counted_walk)
        monkeypatch.setattr(os, "scandir", counted_scandir)
        monkeypatch.setattr(os, "stat", counted_stat)


def test_second_open_reads_the_listing_from_the_cache(tmp_path, monkeypatch, cache):
    root = tmp_path / "d"
    _mixed_folder(root)
    _age(root)
    first = get_dataset(f"imagefolder:{root}")
    assert first.info["listing"] == "walked"
    files = list((cache / "listings").glob("*.json.gz"))
    assert len(files) == 1 and json.loads(gzip.decompress(files[0].read_bytes()))["root"] == str(root.resolve())

    with monkeypatch.context() as m:
        counter = _Counter(m)
        second = get_dataset(f"imagefolder:{root}")
    assert second.info["listing"] == "cache"
    assert counter.walks == 0 and counter.scans == 0
    assert not [p for p in counter.stats if os.path.isfile(p) and not p.startswith(str(cache))]  # no image file
    assert second.fingerprint() == first.fingerprint()
    assert (second.mean, second.std, second.channels, second.image_size) == \
        (first.mean, first.std, first.channels, first.image_size)
    assert torch.equal(second.train.load(torch.arange(len(second.train))), first.train.load(torch.arange(len(first.train))))

    _image(root / "train" / "b" / "sub" / "new.png", 5)  # a new folder inside a class folder: its parent changes
    third = get_dataset(f"imagefolder:{root}")
    assert third.info["listing"] == "walked" and len(third.train) == len(first.train) + 1
    assert third.fingerprint() != first.fingerprint()


def test_listing_cache_sees_files_added_and_removed_in_nested_folders(tmp_path, cache):
    root = tmp_path / "d"
    _mixed_folder(root)
    _image(root / "train" / "a" / "deep" / "x.png", 1)
    _age(root)
    before = get_dataset(f"imagefolder:{root}")
    assert get_dataset(f"imagefolder:{root}").info["listing"] == "cache"
    (root / "train" / "a" / "deep" / "x.png").unlink()  # only the nested folder's time changes
    after = get_dataset(f"imagefolder:{root}")
    assert after.info["listing"] == "walked" and len(after.train) == len(before.train) - 1


def test_fresh_trees_are_not_cached_and_an_unwritable_cache_is_no_error(tmp_path, monkeypatch, cache):
    _mixed_folder(tmp_path / "fresh")
    get_dataset(f"imagefolder:{tmp_path / 'fresh'}")
    assert not (cache / "listings").exists() or not list((cache / "listings").iterdir())

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("x")
    monkeypatch.setenv("FADRM_CACHE", str(blocked))
    _mixed_folder(tmp_path / "old")
    _age(tmp_path / "old")
    for _ in range(2):
        d = get_dataset(f"imagefolder:{tmp_path / 'old'}")
        assert d.info["listing"] == "walked" and len(d.train) == 12


def test_a_damaged_cache_file_is_ignored(tmp_path, cache):
    root = tmp_path / "d"
    _mixed_folder(root)
    _age(root)
    first = get_dataset(f"imagefolder:{root}")
    listing_mod.cache_file(root).write_bytes(b"not gzip")
    again = get_dataset(f"imagefolder:{root}")
    assert again.info["listing"] == "walked" and again.fingerprint() == first.fingerprint()
    assert get_dataset(f"imagefolder:{root}").info["listing"] == "cache"  # written anew
