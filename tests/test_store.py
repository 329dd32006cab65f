"""Tests of the Parquet store: real files in tmp_path, CPU only, a few seconds in all."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from fadrm_ray.config import make_config
from fadrm_ray.store.run_files import RunManifest, RunProvenance, UnitManifest, UnitStats
from fadrm_ray.teacher_record import TeacherRecord
from fadrm_ray.store import (
    ImageRecord,
    RunStore,
    StoreError,
    export_imagefolder,
    export_tensors,
    imagefolder_names,
    open_run,
)

CLASSES = ["airplane", "bird", "cat", "dog"]
PROVENANCE = RunProvenance(seed=7, teachers=[TeacherRecord(path="convnet-test.pt", sha256="ab" * 32)],
                           code_version="test")


def make_image(label: int, ipc: int, channels: int = 3, size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * label + ipc + 17 * channels)
    return torch.randint(0, 256, (channels, size, size), generator=g, dtype=torch.uint8)


def make_records(labels, ipcs, channels: int = 3, size: int = 8) -> list[ImageRecord]:
    return [
        ImageRecord(label=c, ipc_index=i, image=make_image(c, i, channels, size), ce_loss=0.5 + c, bn_loss=None if i % 2 else 0.25)
        for c in labels
        for i in ipcs
    ]


@pytest.fixture
def store(tmp_path) -> RunStore:
    s = RunStore(tmp_path / "runs", "run1")
    s.write_config(make_config("fadrm", overrides={"ipc": 4}))
    return s


def file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_layout_and_file_names(store):
    manifest = store.write_unit("u-ipc0-2", make_records([0, 2], [0, 1]), CLASSES, PROVENANCE, {"seconds": 1.5})
    run = store.run_dir
    assert (run / "config.yaml").is_file()
    assert (run / "label=0" / "part-ipc00000-00002.parquet").is_file()
    assert (run / "label=2" / "part-ipc00000-00002.parquet").is_file()
    assert (run / "units" / "u-ipc0-2.json").is_file()
    assert not (run / "manifest.json").exists()
    # Nothing temporary is left behind next to the final files.
    leftovers = [p for p in run.rglob("*") if p.name.startswith(".")]
    assert leftovers == []

    assert manifest.unit_id == "u-ipc0-2"
    assert manifest.stats == UnitStats(seconds=1.5)
    assert manifest.written_at
    entries = {e.path: e for e in manifest.files}
    assert set(entries) == {"label=0/part-ipc00000-00002.parquet", "label=2/part-ipc00000-00002.parquet"}
    e = entries["label=2/part-ipc00000-00002.parquet"]
    assert (e.rows, e.label, e.ipc_start, e.ipc_end) == (2, 2, 0, 2)
    assert UnitManifest.model_validate_json((run / "units" / "u-ipc0-2.json").read_text()) == manifest

    # Schema and metadata of a part file.
    schema = pq.read_schema(run / "label=2" / "part-ipc00000-00002.parquet")
    assert schema.names == ["image", "label", "ipc_index", "ce_loss", "bn_loss"]
    assert str(schema.field("image").type) == "struct<bytes: binary, path: string>"
    hf = json.loads(schema.metadata[b"huggingface"])
    assert hf["info"]["features"]["label"] == {"names": CLASSES, "_type": "ClassLabel"}
    assert RunProvenance.model_validate_json(schema.metadata[b"fadrm"]) == PROVENANCE
    paths = pq.read_table(run / "label=2" / "part-ipc00000-00002.parquet").column("image").to_pylist()
    assert [p["path"] for p in paths] == ["cat/ipc00000.png", "cat/ipc00001.png"]

    # An ipc range that does not start at zero.
    store.write_unit("u-ipc2-5", make_records([1], [2, 3, 4]), CLASSES, PROVENANCE)
    assert (run / "label=1" / "part-ipc00002-00005.parquet").is_file()

    assert yaml.safe_load((run / "config.yaml").read_text())["ipc"] == 4


@pytest.mark.parametrize("channels", [3, 1])
def test_round_trip_bit_exact(store, channels):
    records = make_records([3, 1, 0], [2, 0, 1], channels=channels)
    store.write_unit("u0", records, CLASSES, PROVENANCE)
    reader = open_run(store.run_dir, incomplete=True)
    images, labels, ipcs = reader.read()
    assert images.dtype == torch.uint8 and labels.dtype == torch.int64 and ipcs.dtype == torch.int64
    assert images.shape == (9, channels, 8, 8)
    expected = sorted(records, key=lambda r: (r.label, r.ipc_index))
    assert labels.tolist() == [r.label for r in expected]
    assert ipcs.tolist() == [r.ipc_index for r in expected]
    for k, r in enumerate(expected):
        assert torch.equal(images[k], r.image)
    assert reader.class_names == CLASSES
    assert reader.provenance == PROVENANCE
    assert reader.config.ipc == 4

    recs = reader.records()
    assert [(r["label"], r["ipc_index"]) for r in recs] == [(r.label, r.ipc_index) for r in expected]
    assert recs[0]["ce_loss"] == pytest.approx(0.5) and recs[0]["bn_loss"] == pytest.approx(0.25)
    assert recs[1]["bn_loss"] is None
    assert recs[0]["file"] == "label=0/part-ipc00000-00003.parquet"
    assert "image" not in recs[0]


def test_unit_done_and_corruption(store):
    assert not store.unit_done("u0")
    assert store.finished_units() == {}
    m0 = store.write_unit("u0", make_records([0, 1], [0, 1]), CLASSES, PROVENANCE)
    m1 = store.write_unit("u1", make_records([0, 1], [2, 3]), CLASSES, PROVENANCE)
    assert store.unit_done("u0") and store.unit_done("u1")
    assert store.finished_units() == {"u0": m0, "u1": m1}

    # Flip one byte in the middle of a part: same size, different checksum.
    part = store.run_dir / m0.files[0].path
    data = bytearray(file_bytes(part))
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    assert not store.unit_done("u0")
    assert store.unit_done("u1")
    assert set(store.finished_units()) == {"u1"}

    # Deleting a part also undoes the unit.
    (store.run_dir / m1.files[1].path).unlink()
    assert not store.unit_done("u1")
    assert store.finished_units() == {}

    # A garbled unit manifest is not a finished unit either.
    store.write_unit("u2", make_records([2], [0]), CLASSES, PROVENANCE)
    (store.run_dir / "units" / "u2.json").write_text("{not json")
    assert not store.unit_done("u2")


def test_retry_overwrites_own_files_only(store):
    store.write_unit("u0", make_records([0, 1], [0, 1]), CLASSES, PROVENANCE)
    store.write_unit("u1", make_records([0, 1], [2, 3]), CLASSES, PROVENANCE)
    u1_files = {p: file_bytes(p) for p in (store.run_dir / "label=0").glob("*00002-00004*")}
    u1_files.update({p: file_bytes(p) for p in (store.run_dir / "label=1").glob("*00002-00004*")})
    u1_manifest = file_bytes(store.run_dir / "units" / "u1.json")
    assert len(u1_files) == 2

    # The retry produces different pixels for the same slots.
    retry = [ImageRecord(r.label, r.ipc_index, 255 - r.image, ce_loss=9.0) for r in make_records([0, 1], [0, 1])]
    store.write_unit("u0", retry, CLASSES, PROVENANCE.model_copy(update={"seed": 8}))
    assert store.unit_done("u0") and store.unit_done("u1")
    for p, b in u1_files.items():
        assert file_bytes(p) == b
    assert file_bytes(store.run_dir / "units" / "u1.json") == u1_manifest

    images, labels, ipcs = open_run(store.run_dir, incomplete=True).read(classes=[0])
    assert ipcs.tolist() == [0, 1, 2, 3]
    assert torch.equal(images[0], 255 - make_image(0, 0))
    assert torch.equal(images[2], make_image(0, 2))

    # A retry that covers a different range removes its own stale part and nothing else.
    store.write_unit("u0", make_records([0], [0, 1]), CLASSES, PROVENANCE)
    assert not (store.run_dir / "label=1" / "part-ipc00000-00002.parquet").exists()
    assert (store.run_dir / "label=0" / "part-ipc00000-00002.parquet").exists()
    for p, b in u1_files.items():
        assert file_bytes(p) == b


def test_unit_cannot_touch_another_units_files(store):
    store.write_unit("u0", make_records([0], [0, 1]), CLASSES, PROVENANCE)
    before = file_bytes(store.run_dir / "label=0" / "part-ipc00000-00002.parquet")
    with pytest.raises(StoreError, match="belongs to unit u0"):
        store.write_unit("other", make_records([0], [0, 1]), CLASSES, PROVENANCE)
    with pytest.raises(StoreError, match="belongs to unit u0"):
        store.write_unit("other", make_records([0], [1, 2]), CLASSES, PROVENANCE)
    assert file_bytes(store.run_dir / "label=0" / "part-ipc00000-00002.parquet") == before
    assert store.unit_done("u0") and not store.unit_done("other")


def test_write_unit_validates_input(store):
    with pytest.raises(StoreError, match="uint8"):
        store.write_unit("u", [ImageRecord(0, 0, torch.zeros(3, 4, 4))], CLASSES, {})
    with pytest.raises(StoreError, match=r"C in \{1, 3\}"):
        store.write_unit("u", [ImageRecord(0, 0, torch.zeros(4, 4, 4, dtype=torch.uint8))], CLASSES, {})
    with pytest.raises(StoreError, match="label 9"):
        store.write_unit("u", make_records([9], [0]), CLASSES, {})
    with pytest.raises(StoreError, match="duplicate ipc_index"):
        store.write_unit("u", make_records([0], [0]) + make_records([0], [0]), CLASSES, {})
    with pytest.raises(StoreError, match="invalid unit_id"):
        store.write_unit("../evil", make_records([0], [0]), CLASSES, {})
    assert not any(store.run_dir.glob("label=*"))


def test_filter_by_classes(store):
    store.write_unit("u0", make_records([0, 1, 2, 3], [0, 1]), CLASSES, PROVENANCE)
    reader = open_run(store.run_dir, incomplete=True)
    assert [p.parent.name for p in reader.part_files()] == ["label=0", "label=1", "label=2", "label=3"]
    assert [p.parent.name for p in reader.part_files([3, 1])] == ["label=1", "label=3"]
    images, labels, ipcs = reader.read(classes=[3, 1])
    assert labels.tolist() == [1, 1, 3, 3] and ipcs.tolist() == [0, 1, 0, 1]
    assert torch.equal(images[2], make_image(3, 0))
    assert {r["label"] for r in reader.records([2])} == {2}
    images, labels, _ = reader.read(classes=[])
    assert images.shape[0] == 0 and labels.numel() == 0

    ds = reader.as_dataset(classes=[2], transform=lambda x: x.float() / 255)
    assert len(ds) == 2
    x, y = ds[1]
    assert y == 2 and x.dtype == torch.float32
    assert torch.equal((x * 255).round().to(torch.uint8), make_image(2, 1))
    raw = reader.as_dataset()
    assert len(raw) == 8 and torch.equal(raw[0][0], make_image(0, 0))


def test_finalize_is_complete_info(store):
    store.write_unit("u0", make_records([0, 1], [0, 1]), CLASSES, PROVENANCE, {"seconds": 2.0})
    store.write_unit("u1", make_records([0, 1], [2, 3]), CLASSES, PROVENANCE, {"seconds": 3.0})
    assert not store.is_complete()
    assert open_run(store.run_dir, incomplete=True).manifest is None
    assert open_run(store.run_dir, incomplete=True).info()["complete"] is False

    manifest = store.finalize({"timings": {"total_s": 5.0}, "note": "ok"})
    assert store.is_complete()
    assert manifest.complete is True and manifest.run_id == "run1"
    assert manifest.rows == 8 and manifest.classes == [0, 1]
    assert [u.unit_id for u in manifest.units] == ["u0", "u1"]
    assert RunManifest.model_validate_json((store.run_dir / "manifest.json").read_text()) == manifest

    reader = open_run(store.run_dir)  # complete: no flag needed
    assert reader.manifest == manifest
    info = reader.info()
    assert info["run_id"] == "run1" and info["complete"] is True
    assert info["rows"] == 8 and info["classes"] == [0, 1]
    assert info["images_per_class"] == {0: 4, 1: 4}
    assert info["image_shape"] == [3, 8, 8]
    assert info["config"]["preset"] == "fadrm" and info["config"]["ipc"] == 4
    assert info["timings"]["total_s"] == 5.0
    json.dumps(info)  # info is plain data


def test_finalize_refuses_corrupted_units(store):
    m = store.write_unit("u0", make_records([0], [0]), CLASSES, PROVENANCE)
    (store.run_dir / m.files[0].path).unlink()
    with pytest.raises(StoreError, match="u0"):
        store.finalize({})
    assert not store.is_complete()


def test_reader_ignores_leftovers_of_crashed_attempts(store):
    store.write_unit("u0", make_records([0], [0, 1]), CLASSES, PROVENANCE)
    # A part written by an attempt that crashed before its unit manifest.
    orphan = RunStore(store.root, "scratch")
    orphan.write_unit("x", make_records([0], [5]), CLASSES, PROVENANCE)
    src = orphan.run_dir / "label=0" / "part-ipc00005-00006.parquet"
    os.replace(src, store.run_dir / "label=0" / src.name)
    _, _, ipcs = open_run(store.run_dir, incomplete=True).read()
    assert ipcs.tolist() == [0, 1]


def test_reader_on_non_run_dir(tmp_path):
    with pytest.raises(StoreError, match="not a FADRM run directory"):
        open_run(tmp_path)
    with pytest.raises(StoreError, match="not a FADRM run directory"):
        open_run(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(StoreError):
        open_run(tmp_path / "file.txt")


def test_datasets_load_dataset_reads_class_names(store, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    store.write_unit("rgb", make_records([2], [0, 1]), CLASSES, PROVENANCE)
    store.write_unit("grey", make_records([3], [0], channels=1), CLASSES, PROVENANCE)
    part = store.run_dir / "label=2" / "part-ipc00000-00002.parquet"
    ds = datasets.load_dataset("parquet", data_files=[str(part)], split="train", cache_dir=str(tmp_path / "hf"))
    assert ds.features["label"].names == CLASSES
    assert ds.num_rows == 2
    row = ds[1]
    assert row["label"] == 2 and row["ipc_index"] == 1
    img = torch.from_numpy(np.array(row["image"])).permute(2, 0, 1)
    assert torch.equal(img, make_image(2, 1))

    grey_part = store.run_dir / "label=3" / "part-ipc00000-00001.parquet"
    grey = datasets.load_dataset("parquet", data_files=[str(grey_part)], split="train", cache_dir=str(tmp_path / "hf"))
    pil = grey[0]["image"]
    assert pil.mode == "L"
    assert torch.equal(torch.from_numpy(np.array(pil))[None], make_image(3, 0, channels=1))


@pytest.mark.parametrize("names", [CLASSES, ["zebra", "apple", "mango"]])
def test_export_imagefolder(tmp_path, names):
    from torchvision.datasets import ImageFolder
    from torchvision.io import ImageReadMode, decode_image

    s = RunStore(tmp_path, "r")
    s.write_config(make_config())
    labels = list(range(len(names)))
    s.write_unit("u0", make_records(labels, [0, 1, 2]), names, PROVENANCE)
    out = tmp_path / "export"
    n = export_imagefolder(s.run_dir, out, incomplete=True)
    assert n == 3 * len(names)

    folders, prefixed = imagefolder_names(names)
    assert prefixed == (names != sorted(names))
    if prefixed:
        assert folders == ["000_zebra", "001_apple", "002_mango"]
    mapping = json.loads((out / "classes.json").read_text())
    assert [c["folder"] for c in mapping["classes"]] == folders
    assert [c["name"] for c in mapping["classes"]] == names

    ifolder = ImageFolder(str(out), loader=lambda p: decode_image(p, mode=ImageReadMode.UNCHANGED))
    assert ifolder.classes == folders
    assert len(ifolder) == n
    for path, target in ifolder.samples:
        label = folders.index(os.path.basename(os.path.dirname(path)))
        assert target == label
    img, target = ifolder[len(ifolder) - 1]
    assert target == len(names) - 1
    assert torch.equal(img, make_image(len(names) - 1, 2))

    # The target must be new or empty, so stale files never mix into an export.
    with pytest.raises(ValueError, match="already exists"):
        export_imagefolder(s.run_dir, out, incomplete=True)


def test_export_imagefolder_subset_and_grey(tmp_path):
    s = RunStore(tmp_path, "r")
    s.write_unit("u0", make_records([0, 1, 2, 3], [0], channels=1), CLASSES, PROVENANCE)
    out = tmp_path / "empty"
    out.mkdir()
    assert export_imagefolder(s.run_dir, out, classes=[1, 3], incomplete=True) == 2
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["bird", "dog"]
    mapping = json.loads((out / "classes.json").read_text())
    assert mapping["imagefolder_index"] == {"bird": 0, "dog": 1}
    from torchvision.io import ImageReadMode, decode_image

    img = decode_image(str(out / "dog" / "ipc00000.png"), mode=ImageReadMode.UNCHANGED)
    assert torch.equal(img, make_image(3, 0, channels=1))


def test_export_tensors_round_trip(store, tmp_path):
    store.write_unit("u0", make_records([0, 1, 2], [0, 1]), CLASSES, PROVENANCE)
    out = tmp_path / "pt" / "distilled.pt"
    assert export_tensors(store.run_dir, out, incomplete=True) == 6
    data = torch.load(out)
    images, labels, _ = open_run(store.run_dir, incomplete=True).read()
    assert data["images"].dtype == torch.uint8 and data["labels"].dtype == torch.int64
    assert torch.equal(data["images"], images) and torch.equal(data["labels"], labels)
    assert data["class_names"] == CLASSES
    with pytest.raises(ValueError, match="already exists"):  # never replaced
        export_tensors(store.run_dir, out, classes=[1], incomplete=True)
    subset = out.with_name("subset.pt")
    assert export_tensors(store.run_dir, subset, classes=[1], incomplete=True) == 2
    assert torch.load(subset)["labels"].tolist() == [1, 1]
    assert sorted(p.name for p in out.parent.iterdir()) == ["distilled.pt", "subset.pt"]


@pytest.mark.parametrize("finalized", [False, True])
def test_info_counts_rows_from_the_manifests(store, monkeypatch, finalized):
    store.write_unit("u0", make_records([0, 1, 2], [0, 1]), CLASSES, PROVENANCE)
    store.write_unit("u1", make_records([0, 3], [2, 3, 4]), CLASSES, PROVENANCE)
    if finalized:
        store.finalize({})
    first = store.run_dir / "label=0" / "part-ipc00000-00002.parquet"
    touched = []

    def no_table(*args, **kwargs):
        raise AssertionError("info() parsed a whole part file")

    real_file, real_schema = pq.ParquetFile, pq.read_schema
    monkeypatch.setattr(pq, "read_table", no_table)
    monkeypatch.setattr(pq, "ParquetFile", lambda path, *a, **k: touched.append(path) or real_file(path, *a, **k))
    monkeypatch.setattr(pq, "read_schema", lambda path, *a, **k: touched.append(path) or real_schema(path, *a, **k))
    info = open_run(store.run_dir, incomplete=True).info()
    assert info["parts"] == 5 and info["rows"] == 12
    assert info["images_per_class"] == {0: 5, 1: 2, 2: 2, 3: 3} and info["classes"] == [0, 1, 2, 3]
    assert info["image_shape"] == [3, 8, 8]
    # Class names, provenance and the image shape come from the first part; no other part is parsed
    # (each is read and hashed, to check it against its manifest).
    assert {str(p) for p in touched} == {str(first)}


def test_reader_never_builds_the_writer(store, monkeypatch):
    import fadrm_ray.store.writer

    store.write_unit("u0", make_records([0, 1], [0, 1]), CLASSES, PROVENANCE, {"seconds": 1.0})
    store.write_unit("u1", make_records([2], [0, 1]), CLASSES, PROVENANCE)
    expected = open_run(store.run_dir, incomplete=True).read()

    def no_writer(*args, **kwargs):
        raise AssertionError("the reader built a RunStore")

    for finalized in (False, True):
        if finalized:
            store.finalize({})
        with monkeypatch.context() as patch:
            patch.setattr(fadrm_ray.store.writer.RunStore, "__init__", no_writer)
            reader = open_run(store.run_dir, incomplete=True)
            assert reader.complete is finalized
            images, labels, _ = reader.read()
            assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
            assert reader.info()["rows"] == 6 and set(reader.unit_manifests()) == {"u0", "u1"}
            assert len(reader.records()) == 6 and len(reader.as_dataset()) == 6


def test_reader_on_a_bare_copy_of_the_part_files(store, tmp_path):
    store.write_unit("u0", make_records([0, 1], [0, 1]), CLASSES, PROVENANCE)
    store.write_unit("u1", make_records([1], [2, 3]), CLASSES, PROVENANCE)
    copy = tmp_path / "copy"
    for part in store.run_dir.glob("label=*/*.parquet"):
        target = copy / part.parent.name / part.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(part.read_bytes())
    reader = open_run(copy, incomplete=True)  # no config.yaml, no manifests: the label folders are all there is
    assert not reader.complete and reader.config is None and reader.class_names == CLASSES
    images, labels, ipcs = reader.read()
    assert labels.tolist() == [0, 0, 1, 1, 1, 1] and ipcs.tolist() == [0, 1, 0, 1, 2, 3]
    assert torch.equal(images, open_run(store.run_dir, incomplete=True).read()[0])
    info = reader.info()
    assert info["rows"] == 6 and info["images_per_class"] == {0: 2, 1: 4} and info["parts"] == 3
