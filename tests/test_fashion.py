"""`fashion-mnist`: read from the four IDX files where they are found, with one error line when
they are not. The files here are tiny ones written by the test, never the installed package."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from fadrm_ray.data import DATASET_NAMES, DatasetError, get_dataset
from fadrm_ray.data import fashion_mnist
from fadrm_ray.data.fashion_mnist import CLASS_NAMES, FILES, read_idx


def write_idx(path, array: np.ndarray, type_byte: int = 0x08) -> None:
    """IDX: two zero bytes, the type, the number of dimensions, each size as a big-endian uint32."""
    header = bytes([0, 0, type_byte, array.ndim]) + b"".join(struct.pack(">I", n) for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_fashion(folder, n_train: int = 30, n_test: int = 10, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for part, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = np.arange(n, dtype=np.uint8) % 10
        write_idx(folder / FILES[part][0], images)
        write_idx(folder / FILES[part][1], labels)
        arrays[part] = (images, labels)
    return arrays


@pytest.fixture
def no_package(monkeypatch, tmp_path):
    """As on a machine without the Debian package, whatever this one has."""
    monkeypatch.setattr(fashion_mnist, "DPKG_LIST", tmp_path / "no-dpkg.list")
    monkeypatch.setattr(fashion_mnist, "PACKAGE_DIR", tmp_path / "no-package")
    monkeypatch.delenv("FADRM_DATA", raising=False)


def test_the_idx_files_become_the_published_split(tmp_path, no_package):
    arrays = write_fashion(tmp_path / "fashion-mnist")
    ds = get_dataset("fashion-mnist", root=str(tmp_path))
    assert (ds.name, ds.image_size, ds.channels, ds.class_names, ds.hflip) == ("fashion-mnist", 28, 1, CLASS_NAMES, True)
    assert (len(ds.train), len(ds.test)) == (30, 10)  # the files' own split, not a re-split
    train_images, train_labels = arrays["train"]
    assert np.array_equal(ds.train.load(list(range(30)))[:, 0].numpy(), train_images)
    assert ds.train.labels.tolist() == train_labels.tolist()
    assert np.array_equal(ds.test.load([3])[0, 0].numpy(), arrays["test"][0][3])
    pixels = train_images.astype(np.float64) / 255
    assert ds.mean == (round(pixels.mean(), 4),) and ds.std == (round(pixels.std(), 4),)
    assert "fashion-mnist" in DATASET_NAMES


def test_fadrm_data_and_the_package_list_are_looked_in(tmp_path, no_package, monkeypatch):
    write_fashion(tmp_path / "env" / "fashion-mnist", seed=1)
    monkeypatch.setenv("FADRM_DATA", str(tmp_path / "env"))
    assert get_dataset("fashion-mnist").info["source"] == str(tmp_path / "env" / "fashion-mnist")
    monkeypatch.delenv("FADRM_DATA")
    # The folder the package's file list names, wherever it is.
    elsewhere = tmp_path / "usr" / "share" / "data"
    write_fashion(elsewhere, seed=2)
    listing = tmp_path / "dpkg.list"
    listing.write_text("\n".join(["/.", "/usr", str(elsewhere), *(str(elsewhere / n) for p in FILES.values() for n in p)]))
    monkeypatch.setattr(fashion_mnist, "DPKG_LIST", listing)
    assert get_dataset("fashion-mnist", root=str(tmp_path / "empty")).info["source"] == str(elsewhere)


def test_without_the_files_one_line_names_the_package(tmp_path, no_package):
    with pytest.raises(DatasetError) as err:
        get_dataset("fashion-mnist", root=str(tmp_path))
    message = str(err.value)
    assert "\n" not in message and "apt-get install dataset-fashion-mnist" in message
    assert str(tmp_path / "fashion-mnist") in message and "train-images-idx3-ubyte.gz" in message
    # Three of the four files are not enough.
    write_fashion(tmp_path / "fashion-mnist")
    (tmp_path / "fashion-mnist" / FILES["test"][1]).unlink()
    with pytest.raises(DatasetError, match="Fashion-MNIST not found"):
        get_dataset("fashion-mnist", root=str(tmp_path))


def test_a_damaged_idx_file_is_refused(tmp_path, no_package):
    write_idx(tmp_path / "ok.gz", np.zeros((2, 3), dtype=np.uint8))
    assert read_idx(tmp_path / "ok.gz").shape == (2, 3)
    write_idx(tmp_path / "int.gz", np.zeros((2, 3), dtype=np.uint8), type_byte=0x0C)
    with pytest.raises(DatasetError, match="not an IDX file of unsigned bytes"):
        read_idx(tmp_path / "int.gz")
    with gzip.open(tmp_path / "short.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"\x01\x02")
    with pytest.raises(DatasetError, match="2 values after the header, but its header says \\(5,\\)"):
        read_idx(tmp_path / "short.gz")
    (tmp_path / "plain.gz").write_bytes(b"not gzip")
    with pytest.raises(DatasetError, match="cannot read"):
        read_idx(tmp_path / "plain.gz")
    # Labels past the ten classes.
    folder = tmp_path / "fashion-mnist"
    write_fashion(folder)
    write_idx(folder / FILES["train"][1], np.full(30, 12, dtype=np.uint8))
    with pytest.raises(DatasetError, match="label 12 is not a Fashion-MNIST class"):
        get_dataset("fashion-mnist", root=str(tmp_path))


def test_bench_accuracy_runs_the_fashion_grid_on_a_tiny_setting(tmp_path, monkeypatch):
    """The command of docs/benchmarks/accuracy.md's Fashion-MNIST grid, on tiny IDX files."""
    from bench.accuracy import main as bench_main

    write_fashion(tmp_path / "data" / "fashion-mnist", n_train=40, n_test=20)
    monkeypatch.setenv("FADRM_DATA", str(tmp_path / "data"))  # the grid's processes read it too
    report = bench_main(["--datasets", "fashion-mnist", "--ipc", "1", "--quick", "--seeds", "1",
                         "--methods", "random-real,patches,fadrm,fadrm-paper", "--student-steps", "2",
                         "--teacher-epochs", "1", "--set", "iterations=2", "--jobs", "1", "--json",
                         "--out", str(tmp_path / "out")])
    assert {r["method"] for r in report["results"]} == {"random-real", "patches", "fadrm", "fadrm-paper"}
    assert all(r["dataset_name"] == "fashion-mnist" and r["ipc"] == 1 for r in report["results"])
    assert report["table"].splitlines()[2].startswith("| fashion-mnist | 1 | ")
