"""One writer per run: a second writer waits (and then finds the work done), stale locks are
broken, readers are never blocked."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from fadrm_ray.layout import RunLayout
from fadrm_ray.store import StoreError, open_run
from fadrm_ray.store.lock import RunLock, read_owner


def write_lock(layout: RunLayout, **owner):
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    layout.lock.write_text(json.dumps({"token": "t-" + str(owner.get("pid")), "since": "then", **owner}))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_writer_waits_and_is_told_by_whom(tmp_path):
    layout = RunLayout(tmp_path / "run")
    first = RunLock(layout)
    seen = []
    with first.held():
        assert read_owner(layout)["pid"] == os.getpid()
        with pytest.raises(StoreError, match=f"pid {os.getpid()} on {socket.gethostname()}"):
            RunLock(layout).acquire(timeout=0.6, on_wait=seen.append)
    assert len(seen) == 1 and seen[0]["pid"] == os.getpid()
    assert not layout.lock.exists()  # released
    with RunLock(layout).held():  # and free again
        pass


def test_the_waiter_takes_over_when_the_writer_finishes(tmp_path):
    layout = RunLayout(tmp_path / "run")
    first = RunLock(layout)
    first.acquire()
    threading.Timer(0.5, first.release).start()
    started = time.monotonic()
    with RunLock(layout).held(timeout=30, on_wait=lambda owner: None):
        assert 0.4 < time.monotonic() - started < 10


def test_a_lock_of_a_dead_process_on_this_host_is_broken_at_once(tmp_path):
    layout = RunLayout(tmp_path / "run")
    write_lock(layout, pid=dead_pid(), host=socket.gethostname(), started=None)
    with RunLock(layout).held(timeout=2):
        assert read_owner(layout)["pid"] == os.getpid()


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path):
    layout = RunLayout(tmp_path / "run")
    write_lock(layout, pid=os.getpid(), host=socket.gethostname(), started="1")  # this pid, another process
    with RunLock(layout).held(timeout=2):
        assert read_owner(layout)["started"] != "1"


def test_a_lock_of_another_host_is_broken_only_when_its_heartbeat_stops(tmp_path):
    layout = RunLayout(tmp_path / "run")
    write_lock(layout, pid=1, host="elsewhere", started=None)
    beating = threading.Event()
    beating.set()

    def heartbeat():
        while beating.is_set():
            os.utime(layout.lock)
            time.sleep(0.05)

    threading.Thread(target=heartbeat, daemon=True).start()
    with pytest.raises(StoreError, match="elsewhere"):
        RunLock(layout, stale_after_s=0.5).acquire(timeout=1.5, on_wait=lambda owner: None)
    beating.clear()
    time.sleep(0.1)
    started = time.monotonic()
    with RunLock(layout, stale_after_s=0.5).held(timeout=5, on_wait=lambda owner: None):
        assert time.monotonic() - started >= 0.5


def test_a_holder_notices_when_its_lock_was_broken(tmp_path):
    layout = RunLayout(tmp_path / "run")
    lock = RunLock(layout, heartbeat_s=0.05)
    lock.acquire()
    write_lock(layout, pid=12345, host="elsewhere")
    time.sleep(0.3)
    assert lock.lost
    lock.release()
    assert read_owner(layout)["host"] == "elsewhere"  # the new owner's lock is left alone


def test_readers_are_never_blocked(run_copy):
    expected = open_run(run_copy).read()
    with RunLock(RunLayout(run_copy)).held():
        images, labels, _ = open_run(run_copy).read()
        assert images.shape == expected[0].shape and open_run(run_copy).info()["writer"]["pid"] == os.getpid()


def test_an_unreadable_lock_is_judged_by_its_age(tmp_path):
    layout = RunLayout(tmp_path / "run")
    layout.run_dir.mkdir()
    layout.lock.write_text("not json")
    started = time.monotonic()
    with RunLock(layout, stale_after_s=0.3).held(timeout=5, on_wait=lambda owner: None):
        assert time.monotonic() - started >= 0.3
