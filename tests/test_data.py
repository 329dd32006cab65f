"""Dataset sources: built-in sets, ImageFolder, Parquet, CIFAR error path."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchvision.io import encode_png, write_file

from fadrm_ray.data import DATASET_NAMES, DatasetError, get_dataset
from fadrm_ray.data.common import resize_uint8, stratified_split


# ---------------------------------------------------------------- helpers

def _png(value: int | tuple, size=(6, 6), channels=1) -> torch.Tensor:
    """A flat-colour uint8 (C, H, W) image; value per channel."""
    vals = value if isinstance(value, tuple) else (value,) * channels
    img = torch.empty((channels, *size), dtype=torch.uint8)
    for c in range(channels):
        img[c] = vals[c]
    return img


def _write_png(path, img):
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(str(path), encode_png(img))


def _class_value(label: int) -> int:
    return 40 * label + 20


def _make_folder(root, classes, per_class, layout="split", size=(6, 6), channels=1):
    """Class c's images are flat with value _class_value(sorted index of c) so labels can be checked."""
    order = sorted(classes)
    for c in classes:  # deliberately not in sorted order
        v = _class_value(order.index(c))
        for i in range(per_class):
            img = _png(v, size, channels)
            img[0, 0, 0] = i  # distinct bytes per file
            if layout == "split":
                _write_png(root / "train" / c / f"{i}.png", img)
                if i < 2:
                    _write_png(root / "test" / c / f"t{i}.png", img)
            else:
                _write_png(root / c / f"{i}.png", img)


def _check_labels_match_pixels(split):
    x = split.load(torch.arange(len(split)))
    for img, y in zip(x, split.labels.tolist()):
        assert int(img[0, 2, 2]) == _class_value(y)


def _hf_table(images, labels, names=None):
    data = [encode_png(img).numpy().tobytes() for img in images]
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    col = pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(data)], type=image_type)
    table = pa.table({"image": col, "label": pa.array(labels, type=pa.int64())})
    if names is not None:
        features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": names}}
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    return table


# ---------------------------------------------------------------- splitting

def test_stratified_split_is_disjoint_complete_stratified_and_deterministic():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 7 + [3] * 1)
    tr, te = stratified_split(labels)
    assert set(tr.tolist()).isdisjoint(te.tolist())
    assert sorted(tr.tolist() + te.tolist()) == list(range(labels.numel()))
    counts = torch.bincount(labels[te], minlength=4).tolist()
    assert counts == [10, 6, 1, 0]  # 20 % per class, a singleton class stays in train
    tr2, te2 = stratified_split(labels)
    assert torch.equal(tr, tr2) and torch.equal(te, te2)
    _, te3 = stratified_split(labels, seed=1)
    assert not torch.equal(te, te3)


# ---------------------------------------------------------------- built-in sets

def test_digits_shapes_splits_and_values(digits):
    from sklearn.datasets import load_digits

    d = digits
    assert (d.name, d.channels, d.image_size, d.num_classes, d.hflip) == ("digits", 1, 8, 10, False)
    assert d.class_names == [str(i) for i in range(10)]
    assert len(d.train) + len(d.test) == 1797
    assert len(d.test) == 359
    x = d.train.load(torch.arange(len(d.train)))
    assert x.dtype == torch.uint8 and x.shape == (len(d.train), 1, 8, 8)
    assert int(x.max()) == 255 and int(x.min()) == 0
    # Test split is 20 % of each class.
    bunch = load_digits()
    full = torch.bincount(torch.from_numpy(bunch.target), minlength=10)
    assert torch.equal(torch.bincount(d.test.labels, minlength=10), (full.double() * 0.2).round().long())
    # Pixels are v * 255 / 16 rounded, and the test split holds exactly the held-out images.
    _, te = stratified_split(torch.from_numpy(bunch.target))
    expect = np.rint(bunch.images[te.numpy()] * 255.0 / 16.0).astype(np.uint8)
    assert np.array_equal(d.test.load(torch.arange(len(d.test)))[:, 0].numpy(), expect)
    # Stats come from the train split.
    xf = x.float() / 255
    assert d.mean[0] == pytest.approx(float(xf.mean()), abs=1e-3)
    assert d.std[0] == pytest.approx(float(xf.std()), abs=1e-3)


def test_digits_is_deterministic_and_resizable(digits):
    again = get_dataset("digits")
    assert again.fingerprint() == digits.fingerprint()
    assert torch.equal(again.train.load([0, 5, 9]), digits.train.load([0, 5, 9]))
    big = get_dataset("digits", image_size=16)
    assert big.image_size == 16 and big.train.load([0, 1]).shape == (2, 1, 16, 16)
    assert big.fingerprint() != digits.fingerprint()


def test_mnist_sample():
    d = get_dataset("mnist-sample")
    assert (d.channels, d.image_size, d.num_classes, d.hflip) == (1, 28, 10, False)
    assert (len(d.train), len(d.test)) == (4000, 1000)
    assert torch.bincount(d.test.labels, minlength=10).tolist() == [100] * 10
    x = d.test.load([0, 1, 2])
    assert x.dtype == torch.uint8 and x.shape == (3, 1, 28, 28)
    assert 0.05 < d.mean[0] < 0.3  # mostly black background


def test_unknown_spec_lists_choices():
    with pytest.raises(DatasetError) as err:
        get_dataset("xyz")
    assert str(err.value) == ("unknown dataset 'xyz'; choose one of: digits, mnist-sample, fashion-mnist, clipart10, cifar10, "
                              "cifar100, imagefolder:PATH, parquet:PATH")
    assert "imagefolder:PATH" in DATASET_NAMES
    with pytest.raises(DatasetError):
        get_dataset("digits:extra")


def test_resize_shorter_side_then_center_crop():
    img = torch.zeros((1, 1, 4, 8), dtype=torch.uint8)
    img[..., 2:6] = 200  # bright centre columns
    out = resize_uint8(img, 4)
    assert out.shape == (1, 1, 4, 4)
    assert torch.all(out == 200)  # the centre crop keeps exactly the bright block


# ---------------------------------------------------------------- CIFAR

def test_cifar_missing_data_fails_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("FADRM_OFFLINE", "1")
    with pytest.raises(DatasetError) as err:
        get_dataset("cifar10", root=str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path) in msg and "cifar-10-python.tar.gz" in msg
    # No chained traceback: nothing from torchvision shows behind the message.
    assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__)
    with pytest.raises(DatasetError, match="cifar-100-python"):
        get_dataset("cifar100", root=str(tmp_path), download=False)


def test_cifar_default_root_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FADRM_OFFLINE", "1")
    monkeypatch.setenv("FADRM_DATA", str(tmp_path / "here"))
    with pytest.raises(DatasetError, match=str(tmp_path / "here")):
        get_dataset("cifar10")


def test_cifar_arrays_become_nchw_with_official_names(monkeypatch):
    from fadrm_ray.data import builtin

    class Fake:
        classes = ["airplane", "automobile"]

        def __init__(self, n):
            self.data = np.zeros((n, 32, 32, 3), dtype=np.uint8)
            self.data[:, :, :, 1] = 7  # only the green channel set
            self.targets = [i % 2 for i in range(n)]

    monkeypatch.setattr(builtin, "_open_cifar", lambda kind, root, download: (Fake(6), Fake(4)))
    d = get_dataset("cifar10", root="/nonexistent")
    assert d.class_names == ["airplane", "automobile"] and d.channels == 3 and d.hflip
    x = d.train.load([0])
    assert x.shape == (1, 3, 32, 32) and int(x[0, 1].min()) == 7 and int(x[0, 0].max()) == 0
    assert d.mean == pytest.approx((0.4914, 0.4822, 0.4465))
    assert (len(d.train), len(d.test)) == (6, 4)


# ---------------------------------------------------------------- ImageFolder

def test_imagefolder_with_split_folders(tmp_path):
    _make_folder(tmp_path, ["cat", "ant", "bee"], per_class=5)
    d = get_dataset(f"imagefolder:{tmp_path}")
    assert d.class_names == ["ant", "bee", "cat"]  # sorted folder names, not creation order
    assert (len(d.train), len(d.test)) == (15, 6)
    assert d.channels == 1 and d.image_size == 6
    _check_labels_match_pixels(d.train)
    _check_labels_match_pixels(d.test)


def test_imagefolder_val_folder_and_flat_layout(tmp_path):
    _make_folder(tmp_path / "a", ["x", "y"], per_class=4)
    os.rename(tmp_path / "a" / "test", tmp_path / "a" / "val")
    d = get_dataset(f"imagefolder:{tmp_path / 'a'}")
    assert (len(d.train), len(d.test)) == (8, 4)

    _make_folder(tmp_path / "flat", ["p", "q"], per_class=10, layout="flat")
    f = get_dataset(f"imagefolder:{tmp_path / 'flat'}")
    assert (len(f.train), len(f.test)) == (16, 4)
    assert torch.bincount(f.test.labels).tolist() == [2, 2]
    _check_labels_match_pixels(f.train)
    g = get_dataset(f"imagefolder:{tmp_path / 'flat'}")
    assert g.train.fingerprint_source == f.train.fingerprint_source
    assert torch.equal(g.test.load(torch.arange(4)), f.test.load(torch.arange(4)))


def test_imagefolder_reads_subfolders_in_path_order(tmp_path):
    # A class's files in path order, subfolders included: "a/x" before "a b/y" before "z".
    names = ["z.png", "a/x.png", "a b/y.png", "a-c/q.png", "a/deep/k.png", ".hidden.png", "notes.txt"]
    for c in ("p", "q"):
        _write_png(tmp_path / "test" / c / "t.png", _png(1))  # with a test split, train keeps every file
        for i, name in enumerate(names):
            path = tmp_path / "train" / c / name
            if name.endswith(".png"):
                _write_png(path, _png(10 * i + (c == "q")))
            else:
                path.write_text("not an image")
    d = get_dataset(f"imagefolder:{tmp_path}")
    firsts = d.train.load(torch.arange(len(d.train)))[:, 0, 0, 0].tolist()
    order = [10 * names.index(n) for n in ["a/deep/k.png", "a/x.png", "a b/y.png", "a-c/q.png", "z.png"]]
    assert firsts == order + [v + 1 for v in order]
    assert d.train.labels.tolist() == [0] * 5 + [1] * 5


def test_imagefolder_colour_if_any_image_is_colour(tmp_path):
    _make_folder(tmp_path, ["a", "b"], per_class=3)
    assert get_dataset(f"imagefolder:{tmp_path}").channels == 1
    _write_png(tmp_path / "train" / "b" / "zz.png", _png((10, 200, 30), (6, 6), 3))
    d = get_dataset(f"imagefolder:{tmp_path}")
    assert d.channels == 3
    x = d.train.load(torch.arange(len(d.train)))
    assert x.shape == (7, 3, 6, 6)
    assert torch.equal(x[0, 0], x[0, 1])  # grey files are expanded to RGB
    assert tuple(int(v) for v in x[-1, :, 0, 0]) == (10, 200, 30)


def test_imagefolder_decodes_on_demand(tmp_path):
    _make_folder(tmp_path, ["a", "b"], per_class=3)
    d = get_dataset(f"imagefolder:{tmp_path}")
    bad = tmp_path / "train" / "b" / "2.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated file, decoded only when asked for
    assert d.train.load([0, 1]).shape == (2, 1, 6, 6)
    with pytest.raises(DatasetError, match="2.png"):
        d.train.load([5])
    assert d.train.load([]).shape == (0, 1, 6, 6)


def test_imagefolder_fingerprint_follows_content(tmp_path):
    _make_folder(tmp_path, ["a", "b"], per_class=3)
    before = get_dataset(f"imagefolder:{tmp_path}").fingerprint()
    assert get_dataset(f"imagefolder:{tmp_path}").fingerprint() == before
    noisy = torch.randint(0, 255, (1, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    _write_png(tmp_path / "train" / "a" / "0.png", noisy)
    assert get_dataset(f"imagefolder:{tmp_path}").fingerprint() != before


def test_imagefolder_sizes(tmp_path):
    _make_folder(tmp_path / "rect", ["a", "b"], per_class=2, size=(6, 10))
    d = get_dataset(f"imagefolder:{tmp_path / 'rect'}")
    assert d.image_size == 224  # first image not square
    small = get_dataset(f"imagefolder:{tmp_path / 'rect'}", image_size=4)
    assert small.train.load([0, 3]).shape == (2, 1, 4, 4)


def test_imagefolder_errors(tmp_path):
    with pytest.raises(DatasetError, match=str(tmp_path / "missing")):
        get_dataset(f"imagefolder:{tmp_path / 'missing'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no class folders"):
        get_dataset(f"imagefolder:{tmp_path / 'empty'}")
    (tmp_path / "hollow" / "a").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no images"):
        get_dataset(f"imagefolder:{tmp_path / 'hollow'}")


# ---------------------------------------------------------------- Parquet

def test_parquet_train_test_files_with_class_names(tmp_path):
    names = ["zebra", "apple", "moon"]  # metadata order is the class order, not alphabetical
    imgs = [_png(_class_value(i % 3)) for i in range(9)]
    labels = [i % 3 for i in range(9)]
    pq.write_table(_hf_table(imgs, labels, names), tmp_path / "train-00000-of-00001.parquet")
    pq.write_table(_hf_table(imgs[:3], labels[:3], names), tmp_path / "test-00000-of-00001.parquet")
    d = get_dataset(f"parquet:{tmp_path}")
    assert d.class_names == names
    assert (len(d.train), len(d.test), d.channels, d.image_size) == (9, 3, 1, 6)
    _check_labels_match_pixels(d.train)
    _check_labels_match_pixels(d.test)


def test_parquet_single_file_without_names_is_split(tmp_path):
    imgs = [_png(_class_value(i % 2), channels=3) for i in range(20)]
    path = tmp_path / "data.parquet"
    pq.write_table(_hf_table(imgs, [i % 2 for i in range(20)]), path)
    d = get_dataset(f"parquet:{path}")
    assert d.class_names == ["0", "1"] and d.channels == 3
    assert (len(d.train), len(d.test)) == (16, 4)
    assert torch.bincount(d.test.labels).tolist() == [2, 2]
    _check_labels_match_pixels(d.train)


def test_parquet_reads_a_distilled_store_layout(tmp_path):
    run = tmp_path / "store" / "run123"
    names = ["0", "1", "2"]
    for c in range(3):
        imgs = [_png(_class_value(c)) for _ in range(5)]
        for k, img in enumerate(imgs):
            img[0, 0, 0] = k
        (run / f"label={c}").mkdir(parents=True)
        pq.write_table(_hf_table(imgs, [c] * 5, names), run / f"label={c}" / "part-ipc0-5.parquet")
    d = get_dataset(f"parquet:{tmp_path / 'store'}")
    assert d.num_classes == 3 and len(d.train) + len(d.test) == 15
    assert torch.bincount(d.test.labels).tolist() == [1, 1, 1]
    _check_labels_match_pixels(d.train)


def test_parquet_fingerprint_follows_content(tmp_path):
    imgs = [_png(_class_value(i % 2)) for i in range(6)]
    path = tmp_path / "x.parquet"
    pq.write_table(_hf_table(imgs, [i % 2 for i in range(6)]), path)
    before = get_dataset(f"parquet:{path}").fingerprint()
    assert get_dataset(f"parquet:{path}").fingerprint() == before
    imgs[0][0, 3, 3] = 1
    pq.write_table(_hf_table(imgs, [i % 2 for i in range(6)]), path)
    assert get_dataset(f"parquet:{path}").fingerprint() != before


def test_parquet_errors(tmp_path):
    with pytest.raises(DatasetError, match="nope.parquet"):
        get_dataset(f"parquet:{tmp_path / 'nope.parquet'}")
    with pytest.raises(DatasetError, match="no .parquet files"):
        get_dataset(f"parquet:{tmp_path}")
    pq.write_table(pa.table({"pixels": [1, 2]}), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match="no 'image' column"):
        get_dataset(f"parquet:{tmp_path / 'bad.parquet'}")


def test_cifar_failed_download_is_one_line(tmp_path, monkeypatch):
    import urllib.error

    from torchvision import datasets

    def no_network(self):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.delenv("FADRM_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.CIFAR10, "download", no_network)
    with pytest.raises(DatasetError) as err:
        get_dataset("cifar10", root=str(tmp_path / "c"))
    msg = str(err.value)
    assert "download failed: URLError" in msg and "\n" not in msg and str(tmp_path / "c") in msg


def test_fashion_sample_builds_a_parquet_dataset_the_reader_splits(tmp_path):
    """fadrm_ray.data.fashion_sample on a package tarball of its layout (no npm call: the tarball is cached)."""
    import io
    import tarfile

    from fadrm_ray.data.fashion_sample import CLASS_NAMES, PACKAGE, build

    cache = tmp_path / "npm"
    cache.mkdir()
    name, version = PACKAGE.rsplit("@", 1)
    with tarfile.open(cache / f"{name}-{version}.tgz", "w:gz") as tar:
        for label in range(10):
            # Image j of class c is flat at 20 * c + j; class 0 ends in two empty rows, as the package's does.
            rows = [[20 * label + j] * 784 for j in range(8)] + ([[], []] if label == 0 else [])
            data = json.dumps({"data": rows}).encode()
            info = tarfile.TarInfo(f"package/src/clothes/{label}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = build(tmp_path / "out", per_class=5, cache=cache)
    assert build(tmp_path / "again", per_class=5, cache=cache).read_bytes() == path.read_bytes()  # seeded

    d = get_dataset(f"parquet:{path}")
    assert d.class_names == CLASS_NAMES and d.hflip and d.channels == 1 and d.image_size == 28
    for split, per_class in ((d.train, 4), (d.test, 1)):
        for label in range(10):
            images = split.load(split.indices_of_class(label))
            assert images.shape == (per_class, 1, 28, 28)
            values = images.flatten(1)
            assert (values == values[:, :1]).all()  # each image came through whole
            assert all(20 * label <= v < 20 * label + 8 for v in values[:, 0].tolist())
    drawn = {int(v) for split in (d.train, d.test) for v in split.load(torch.arange(len(split)))[:, 0, 0, 0]}
    assert len(drawn) == 50  # five different images of each class


def test_the_registry_makes_the_names_the_help_and_the_specs():
    from fadrm_ray.cli.common import DATASET_HELP
    from fadrm_ray.data import DATASETS, path_source, skipping_bad_images

    assert DATASET_NAMES == [s.spec for s in DATASETS.values()]
    for source in DATASETS.values():
        assert f"{source.spec}: {source.help}" in DATASET_HELP
    assert get_dataset(" Digits ").name == "digits"
    assert path_source("folder+skip-bad-images:/x").name == "imagefolder" and path_source("digits") is None
    assert path_source("parquet:/x").name == "parquet" and path_source("parquet") is None
    assert skipping_bad_images("imagefolder:/x") == "imagefolder+skip-bad-images:/x"
    with pytest.raises(DatasetError, match="only image folders take an option"):
        get_dataset("parquet+skip-bad-images:/x")
    with pytest.raises(DatasetError, match="is for image folders"):
        get_dataset("digits", skip_bad_images=True)
    with pytest.raises(DatasetError, match="unknown dataset 'imagefolder'"):
        get_dataset("imagefolder")
