"""A job's driver process, against a real `fadrm serve` on loopback: Ray's own lines of the driver
(its connection to the service's Ray head) go to the run's ray.log, not to its driver.log; a
driver that stops (SIGSTOP) is failed by its heartbeat; and its output is rotated at its cap."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fadrm_ray.layout import RunLayout
from tests.api_helpers import REPO, process_alive, request, running_driver, running_service, wait_state
from tests.ray_helpers import ray_or_tune_lines, wait_for

pytestmark = [pytest.mark.ray]
HEARTBEAT_TIMEOUT = 4


@pytest.fixture(scope="module")
def drivers(digits_teacher, tmp_path_factory):
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-driver"), max_running=1, max_queued=4,
                         rate_limit=1000, rate_burst=2000, driver_heartbeat_timeout=HEARTBEAT_TIMEOUT) as server:
        yield server


def _files(server, job_id: str):
    return server.store / ".fadrm-api" / "jobs" / job_id


def test_the_drivers_ray_lines_go_to_the_runs_ray_log_not_its_driver_log(drivers):
    with drivers.client() as http:
        job = wait_state(http, http.post("/v1/distillations", json=request(classes=[1, 4], ipc=1, seed=81)).json()["id"])
    assert job["state"] == "succeeded", job
    ray_log = RunLayout(drivers.store / job["run_id"]).ray_log.read_text()
    assert "Connecting to existing Ray cluster" in ray_log and "\x1b" not in ray_log
    driver_log = _files(drivers, job["id"]).joinpath("driver.log").read_text()
    assert ray_or_tune_lines(driver_log) == [], driver_log[-2000:]


def test_a_stopped_driver_is_failed_by_its_heartbeat(drivers):
    with drivers.client() as http:
        job_id, pid = running_driver(drivers, http, request(classes=[0, 8], seed=11, iterations=4000))
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            job = wait_state(http, job_id, timeout=HEARTBEAT_TIMEOUT + 30)
        finally:
            if process_alive(pid):
                os.kill(pid, signal.SIGCONT)
        assert job["state"] == "failed" and "no heartbeat" in job["error"], job
        assert time.monotonic() - stopped < HEARTBEAT_TIMEOUT + 10
        wait_for(lambda: not process_alive(pid), timeout=30)


def test_a_drivers_output_is_rotated_at_its_cap(tmp_path):
    log = tmp_path / "driver.log"
    script = ("import os, sys\n"
              "from pathlib import Path\n"
              "from api.jobs.runner import bounded_output\n"
              f"pump = bounded_output(Path({str(log)!r}), 10_000)\n"
              "for i in range(3000):\n"
              "    print(f'line {i:05d} ' + 'x' * 40, flush=True)\n"
              "os.write(2, b'the last line\\n')\n"
              "null = os.open(os.devnull, os.O_WRONLY)\n"
              "os.dup2(null, 1); os.dup2(null, 2)\n"
              "pump.join(5)\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, cwd=REPO)
    older = log.with_name("driver.log.1")
    assert log.stat().st_size <= 10_000 and older.stat().st_size <= 10_000
    assert log.read_text().endswith("the last line\n")
    assert not list(tmp_path.glob("driver.log.2"))
    assert oct(log.stat().st_mode & 0o777) == oct(0o600)
