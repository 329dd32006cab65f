"""The service's catalog reads the operator's datasets once, each in a thread of its own: one
that hangs (a folder on a mount that does not answer; here a FIFO no one writes) does not keep
the service from being ready, and is listed (or left out, saying why) once its reading ends."""
from __future__ import annotations

import os
import threading

from api.planning.catalog import Catalog
from tests.ray_helpers import wait_for


def test_a_dataset_that_hangs_does_not_hold_up_the_others(tmp_path):
    fifo = tmp_path / "hung.parquet"
    os.mkfifo(fifo)
    (tmp_path / "teachers").mkdir()
    specs = tmp_path / "datasets.yaml"
    specs.write_text(f"hung: parquet:{fifo}\n")
    catalog = Catalog(tmp_path / "teachers", specs)
    for name in ("digits", "mnist-sample"):  # loaded before: their reading takes no time, whatever the machine's load
        catalog.dataset(name)
    try:
        catalog.read_all(each_s=2)
        assert catalog.read.is_set()
        assert catalog.pending() == ["hung"]
        assert {name for name, d in catalog.described.items() if isinstance(d, dict)} == {"digits", "mnist-sample"}
    finally:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader sees the end of the file
    wait_for(lambda: "hung" in catalog.described, timeout=30, interval=0.1)
    assert isinstance(catalog.described["hung"], str)  # not a dataset: left out, its reason logged


def test_a_stopped_reading_ends_between_datasets(tmp_path):
    fifo = tmp_path / "hung.parquet"
    os.mkfifo(fifo)
    (tmp_path / "teachers").mkdir()
    specs = tmp_path / "datasets.yaml"
    specs.write_text(f"hung: parquet:{fifo}\n")
    catalog, stop = Catalog(tmp_path / "teachers", specs), threading.Event()
    reading = threading.Thread(target=catalog.read_all, args=(stop, 600))
    reading.start()
    try:
        wait_for(lambda: catalog.pending() == ["hung"], timeout=120, interval=0.1)
        stop.set()
        reading.join(10)
        assert not reading.is_alive() and not catalog.read.is_set()
    finally:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
