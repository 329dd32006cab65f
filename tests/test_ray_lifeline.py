"""An embedded Ray does not outlive its driver: SIGKILL the driver of `fadrm distill --workers 2`
mid-run, and within seconds no process of that cluster is left (GCS, raylet, dashboard, the
dashboard and runtime-env agents, workers)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.ray_helpers import events, wait_for

pytestmark = pytest.mark.ray


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode(errors="replace").rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], fields[19]


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below `root`."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            parents[int(name)] = st
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, (ppid, _, start) in parents.items():
            if ppid == pid and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def survivors(processes: dict[int, str]) -> dict[int, str]:
    """The processes that still run (a zombie waiting for its reaper has ended)."""
    out = {}
    for pid, start in processes.items():
        st = _stat(pid)
        if st is not None and st[1] != "Z" and st[2] == start:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            except OSError:
                continue
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lifeline finds processes through /proc")
def test_a_killed_driver_takes_its_embedded_ray_with_it(digits_teacher, tmp_path):
    command = [sys.executable, "-m", "actors.cli", "distill", "--dataset", "digits",
               "--teacher", str(digits_teacher[0]), "--ipc", "4", "--set", "iterations=5000", "--workers", "2",
               "--out", str(tmp_path), "--quiet"]
    driver = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_dir = wait_for(lambda: next(iter([d for d in tmp_path.iterdir() if d.is_dir()]), None), timeout=180)
        wait_for(lambda: len(events(run_dir, "worker_started")) >= 2, timeout=180)
        cluster = descendants(driver.pid)
        names = " ".join(survivors(cluster).values())
        assert "raylet" in names and "gcs_server" in names, names
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.time() + 10
    while survivors(cluster) and time.time() < deadline:
        time.sleep(0.2)
    assert survivors(cluster) == {}


def _ctrl_c_dropped(seconds: float) -> bool:
    """Ctrl-C this process and wait, like a native callback that drops the KeyboardInterrupt it gets:
    True if one came (and was dropped)."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(seconds)
    except KeyboardInterrupt:
        return True
    return False


def test_ctrl_c_leaves_a_mark_even_where_the_keyboard_interrupt_is_dropped():
    from actors.lifeline import interrupt_mark

    with interrupt_mark() as interrupted:
        assert not interrupted()
        assert _ctrl_c_dropped(5.0) and interrupted()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    assert _ctrl_c_dropped(5.0)  # outside the block Ctrl-C is the usual KeyboardInterrupt


def test_the_mark_leaves_an_ignored_ctrl_c_alone():
    from actors.lifeline import interrupt_mark

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt_mark() as interrupted:
            assert not _ctrl_c_dropped(0.2) and not interrupted()
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
