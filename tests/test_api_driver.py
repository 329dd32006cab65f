"""A job's driver process, against a real `fadrm serve` on loopback: Ray's own lines of the driver
(its connection to the service's Ray head) go to the run's ray.log, not to its driver.log."""
from __future__ import annotations

import pytest

from fadrm_ray.layout import RunLayout
from tests.api_helpers import request, running_service, wait_state
from tests.ray_helpers import ray_or_tune_lines

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
