"""The service's local Ray head, against a real `fadrm serve` on loopback: a head killed under a
running job comes back by itself and the job says why it failed; a head that died leaves no
folder, and a server killed with SIGKILL takes its head with it; a server killed while a job runs
leaves the head to the job's driver, which finishes the job."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from api.jobs.local_ray import LEASE, RayHead, RayLease, members, processes
from tests.api_helpers import (TEACHER, ApiServer, process_alive, request, running_driver, running_service,
                               wait_state)
from tests.ray_helpers import wait_for

pytestmark = [pytest.mark.ray]
FAILS_WITHIN_S = 4  # a job on a head that died is failed within this long


@pytest.fixture(scope="module")
def head(digits_teacher, tmp_path_factory):
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-head"), max_running=1,
                         rate_limit=1000, rate_burst=2000) as server:
        yield server


def test_a_killed_ray_head_comes_back_by_itself_and_its_job_says_why_it_failed(head):
    head_file = head.store / ".fadrm-api" / "ray-head.json"
    with head.client() as http:
        wait_for(lambda: http.get("/readyz").status_code == 200, timeout=120, interval=0.5)
        job_id, _ = running_driver(head, http, request(classes=[2, 6], seed=12, iterations=4000))
        first = RayHead.model_validate_json(head_file.read_text())
        os.killpg(first.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: http.get("/readyz").status_code == 503, timeout=10, interval=0.2)
        # The job on the dead head fails at once, saying why.
        job = wait_state(http, job_id, timeout=FAILS_WITHIN_S)
        assert job["state"] == "failed", job
        assert "Ray head stopped while the job ran" in job["error"] and "/" not in job["error"], job["error"]
        wait_for(lambda: http.get("/readyz").status_code == 200, timeout=90, interval=0.5)
        back_in = time.monotonic() - killed
        assert RayHead.model_validate_json(head_file.read_text()).pid != first.pid
        print(f"/readyz 200 again {back_in:.1f} s after the head was killed")


def _named(folder: str) -> list[int]:
    """Live processes whose command line names `folder` (a head's processes name its folder)."""
    found = []
    for pid in processes():
        try:
            if folder.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def _server(teacher: Path, root: Path) -> ApiServer:
    """A `fadrm serve` with its own local Ray head, not started: the test starts, kills and restarts it."""
    server = ApiServer(root)
    server.store.mkdir(parents=True)
    server.teachers.mkdir(parents=True)
    shutil.copy(teacher, server.teachers / f"{TEACHER}.pt")
    return server


def test_a_dead_heads_folder_goes_and_a_sigkilled_server_takes_its_head_with_it(digits_teacher, tmp_path):
    server = _server(digits_teacher[0], tmp_path)
    record = server.store / ".fadrm-api" / "ray-head.json"
    server.start()
    try:
        with server.client() as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, timeout=240, interval=0.5)
            first = RayHead.model_validate_json(record.read_text())
            os.killpg(first.pid, signal.SIGKILL)  # the head dies: a new one replaces it, its folder goes
            wait_for(lambda: RayHead.model_validate_json(record.read_text()).pid != first.pid, timeout=60)
            wait_for(lambda: http.get("/readyz").status_code == 200, timeout=240, interval=0.5)
        assert not Path(first.temp_dir).exists()
        (Path(first.temp_dir) / "session_late" / "logs").mkdir(parents=True)  # as a late writer of the old head
        wait_for(lambda: not Path(first.temp_dir).exists(), timeout=30, interval=0.5)

        head = RayHead.model_validate_json(record.read_text())
        assert members(head.pid) and process_alive(head.lifeline_pid)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
        killed = time.monotonic()
        wait_for(lambda: not members(head.pid) and not _named(head.temp_dir) and not process_alive(head.lifeline_pid),
                 timeout=60, interval=0.5)
        print(f"the head's processes were gone {time.monotonic() - killed:.1f} s after the server's SIGKILL")
        assert not Path(head.temp_dir).exists() and not record.exists()
    finally:
        server.stop()
        server.stop_ray()


def test_a_server_killed_while_a_job_runs_leaves_the_head_to_its_driver(digits_teacher, tmp_path):
    """SIGKILL while a job runs: its driver holds the head's lease, so the head stays until the
    driver has finished the job, then goes; the service started again reports the job succeeded."""
    server = _server(digits_teacher[0], tmp_path)
    record = server.store / ".fadrm-api" / "ray-head.json"
    server.start()
    try:
        with server.client() as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, timeout=240, interval=0.5)
            job = http.post("/v1/distillations", json=request(classes=[4, 9], seed=71, iterations=400)).json()
            wait_for(lambda: http.get(f"/v1/distillations/{job['id']}").json()["state"] == "running", timeout=120)
        lease = server.store / ".fadrm-api" / LEASE
        wait_for(lambda: RayLease.model_validate_json(lease.read_text()).drivers, timeout=30)  # the driver holds it
        head = RayHead.model_validate_json(record.read_text())
        outcome = server.store / ".fadrm-api" / "jobs" / job["id"] / "outcome.json"
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
        wait_for(outcome.is_file, timeout=300, interval=0.5)  # the driver went on, on the head it held
        wait_for(lambda: not members(head.pid) and not process_alive(head.lifeline_pid), timeout=60, interval=0.5)
        server.start()
        with server.client() as http:
            done = http.get(f"/v1/distillations/{job['id']}").json()
            deadline = time.time() + 60
            while done["state"] == "running" and time.time() < deadline:
                time.sleep(0.5)
                done = http.get(f"/v1/distillations/{job['id']}").json()
            assert done["state"] == "succeeded", done
            assert http.get(f"/v1/distillations/{job['id']}/dataset").status_code == 200
    finally:
        server.stop()
        server.stop_ray()
