"""What a dead local Ray head leaves is removed by its process group and its folder, never by a
substring of a command line: a record naming a folder the service does not make kills nothing, a
viewer of the head's logs is left alone, and the head's renamed workers (no longer naming the
folder) go with its group. Real processes, no Ray."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from api.jobs.local_ray import TEMP_PREFIX, RayHead, head_folder, proc_start, remove_head
from tests.api_helpers import process_alive
from tests.ray_helpers import wait_for

SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


def _sleeper(*args: str) -> subprocess.Popen:
    """A process of its own session whose command line carries `args`."""
    return subprocess.Popen([*SLEEP, *args], start_new_session=True)


def _dead_leader_with_a_member() -> tuple[int, str | None, int]:
    """(pid and start time of a group leader that has exited, pid of the group's member still alive)."""
    leader = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; read _"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    member = int(leader.stdout.readline())
    start = proc_start(leader.pid)
    leader.stdin.close()
    leader.wait(10)
    return leader.pid, start, member


def test_only_folders_the_service_makes_pass():
    made = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    try:
        assert head_folder(made)
    finally:
        Path(made).rmdir()
    for other in ("", "/", tempfile.gettempdir(), str(Path(tempfile.gettempdir()) / TEMP_PREFIX),
                  str(Path.home()), "fadrm-ray-x", str(Path(tempfile.gettempdir()) / "x" / f"{TEMP_PREFIX}x")):
        assert not head_folder(other), other


def test_a_record_naming_another_folder_kills_nothing(tmp_path):
    victim = _sleeper(f"--temp-dir={tmp_path}")
    leader, start, member = _dead_leader_with_a_member()
    try:
        remove_head(RayHead(pid=leader, pid_start=start, temp_dir=str(tmp_path)))
        with pytest.raises(subprocess.TimeoutExpired):  # a SIGKILL would have ended it by then
            victim.wait(1)
        assert process_alive(member)
        assert tmp_path.is_dir()
    finally:
        victim.kill()
        victim.wait()
        subprocess.run(["kill", "-9", str(member)], check=False)


def test_a_dead_heads_group_and_processes_go_and_a_viewer_of_its_logs_stays():
    folder = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    (Path(folder) / "session_latest" / "logs").mkdir(parents=True)
    named = _sleeper(f"--temp-dir={folder}")  # a raylet that left the head's group
    viewer = _sleeper(f"{folder}/session_latest/logs/raylet.out")  # an operator's `less`
    leader, start, member = _dead_leader_with_a_member()  # a worker that renamed itself
    try:
        remove_head(RayHead(pid=leader, pid_start=start, temp_dir=folder))
        named.wait(10)
        wait_for(lambda: not process_alive(member), timeout=10, interval=0.1)
        with pytest.raises(subprocess.TimeoutExpired):
            viewer.wait(1)
        assert not Path(folder).exists()
    finally:
        for process in (named, viewer):
            process.kill()
            process.wait()
        subprocess.run(["kill", "-9", str(member)], check=False)
