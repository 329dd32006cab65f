"""bench/rehearsal/imagenet.py and bench/rehearsal/measure.py: the ImageNet-shaped folder is what
the folder reader takes for ImageNet at 224 px, the memory sampler sees a whole process tree, the
ledger split takes the union of the workers' intervals, the listing counter sees walks and nothing
else, and (slow) the whole rehearsal runs end to end on three classes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from PIL import Image

from bench.rehearsal import imagenet as bench
from bench.rehearsal import measure


def test_wnids_are_sorted_distinct_and_stable():
    names = bench.wnids()
    assert len(names) == 1000 == len(set(names))
    assert names == sorted(names) == bench.wnids()
    assert all(n.startswith("n0") and len(n) == 9 and n[1:].isdigit() for n in names)
    assert bench.wnids(3) == names[:3]


def test_folder_is_imagenet_shaped_and_read_at_224(tmp_path, monkeypatch):
    from fadrm_ray.data import get_dataset

    monkeypatch.setenv("FADRM_CACHE", str(tmp_path / "cache"))
    root = bench.make_folder(tmp_path / "imagenet-3", 3, train_per_class=2, val_per_class=1)
    names = bench.wnids(3)
    assert sorted(p.name for p in (root / "train").iterdir()) == names
    assert sorted(p.name for p in (root / "train" / names[1]).iterdir()) == [f"{names[1]}_0.JPEG", f"{names[1]}_1.JPEG"]
    assert [p.name for p in (root / "val" / names[2]).iterdir()] == ["ILSVRC2012_val_00000003.JPEG"]
    with Image.open(root / "train" / names[0] / f"{names[0]}_0.JPEG") as im:
        assert (im.format, im.mode, im.size) == ("JPEG", "RGB", bench.IMAGE_SIZE)
    # Dated a day back (an extracted archive), and written once: a second call keeps the files.
    first = root / "train" / names[0] / f"{names[0]}_0.JPEG"
    assert first.stat().st_mtime < time.time() - 3600
    stamp = first.stat().st_mtime_ns
    assert bench.make_folder(tmp_path / "imagenet-3", 3, 2, 1) == root and first.stat().st_mtime_ns == stamp

    data = get_dataset(f"imagefolder:{root}")
    assert (data.num_classes, data.channels, data.image_size) == (3, 3, 224)  # non-square: the 224 px default
    assert data.class_names == names
    assert (len(data.train), len(data.test)) == (6, 3)
    images = data.train.load(list(range(6))).float()
    assert images.shape == (6, 3, 224, 224)
    means = images.mean(dim=(1, 2, 3))
    assert len({round(float(m), 1) for m in means[::2]}) == 3  # each class looks different
    assert images.std() > 10  # not flat


def test_larger_folder_holds_the_smaller_ones_classes(tmp_path):
    small = bench.make_folder(tmp_path / "a", 2, 1, 1)
    large = bench.make_folder(tmp_path / "b", 4, 1, 1)
    for wnid in bench.wnids(2):
        a = (small / "train" / wnid / f"{wnid}_0.JPEG").read_bytes()
        assert a == (large / "train" / wnid / f"{wnid}_0.JPEG").read_bytes()


CHILD = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
         "'import time; x = bytearray(200 * 2**20); x[::4096] = b\"1\" * len(x[::4096]); time.sleep(1.5)']); p.wait()")


def test_sampler_sums_the_whole_tree():
    proc = subprocess.Popen([sys.executable, "-c", CHILD])
    with measure.TreeSampler(proc.pid, interval=0.05, adopt=False) as sampler:
        proc.wait(60)
    result = sampler.result()
    assert result["processes"] >= 2  # the command and its child
    assert result["max_process_hwm_mb"] >= 200  # the child's peak
    assert result["peak_rss_mb"] >= result["max_process_hwm_mb"] * 0.9 + 5  # the two together
    assert result["samples"] >= 5


def test_ledger_split_takes_the_union_of_worker_intervals(tmp_path):
    from fadrm_ray.events import PatchesScored, RunFinished, RunStarted, StageDone, append_entry

    def stage(t, seconds, unit):
        return StageDone(t=t, seconds=seconds, unit=unit, stage=0, pid=1, patches_scored=0)

    events = [RunStarted(t=10.0, units=2, todo=2, stages_done=0, ipc=1, resumed={}, stages=1, plan={"a": 0, "b": 0}),
              PatchesScored(t=12.0, seconds=1.0, label=0, pid=1),
              stage(20.0, 6.0, "a"),  # 14-20
              stage(22.0, 6.0, "b"),  # 16-22, overlaps
              stage(30.0, 2.0, "c"),  # 28-30
              RunFinished(t=31.0, seconds=21.0)]
    for event in events:
        append_entry(tmp_path / "ledger.jsonl", event)
    split = measure.ledger_split(tmp_path)
    assert split["recover_worker_s"] == 14.0 and split["recover_wall_s"] == 10.0
    assert split["patch_scoring_wall_s"] == 1.0 and split["run_s"] == 21.0 and split["stages"] == 3


def test_listing_counter_counts_walks_not_reads(tmp_path):
    folder = bench.make_folder(tmp_path / "imagenet-2", 2, 2, 1)
    watched = folder / "train" / bench.wnids(1)[0]
    files = list(watched.iterdir())  # itself a listing, before the counter starts
    counter = measure.ListingCounter([watched])
    if not counter.available:
        pytest.skip("no inotify here")
    try:
        assert counter.take() == 0
        for path in files:
            path.read_bytes()
            os.stat(path)
        os.stat(watched)
        assert counter.take() == 0
        list(os.walk(folder))
        list(os.walk(folder))
        assert counter.take() == 2
    finally:
        counter.close()


def test_rest_subset_is_spread_over_the_classes():
    assert bench.rest_classes(10) == list(range(10))
    subset = bench.rest_classes(1000)
    assert len(subset) == 100 == len(set(subset)) and subset[0] == 0 and subset[-1] == 990


@pytest.mark.slow
def test_three_classes_end_to_end(tmp_path):
    """The whole rehearsal on three classes: import, distill on the embedded Ray at 224 px with
    MRO, verify, export and the REST download (several minutes on two CPUs)."""
    out = tmp_path / "out"
    result = bench.main(["--classes", "3", "--workers", "1", "--out", str(out), "--json"])
    phases = result["counts"][0]["phases"]
    assert phases["import"]["image_size"] == 224 and phases["import"]["normalization"] == "flags"
    d = phases["distill"]
    assert d["images"] == 3 and d["recipe"] == "imagenet" and d["stage_resolutions"] == [200, 224, 200, 224]
    assert 0 < d["recover_wall_s"] < d["seconds"] and d["processes"] >= 3  # driver, raylet, worker ...
    assert d["peak_rss_mb"] > d["max_process_hwm_mb"]
    assert phases["verify"]["ok"] and phases["export"]["png_files"] == 3
    rest = phases["rest"]
    assert rest["rows"] == rest["expected_rows"] == 3 and rest["labels_match"] and rest["left_running"] == 0
    assert phases["import"]["listings"] == 1 and phases["import"]["cache_written"]
    assert json.loads((out / "imagenet_rehearsal.json").read_text())["counts"][0]["classes"] == 3
