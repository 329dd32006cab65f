"""How long finished jobs stay (api.jobs.retention): against a real `fadrm serve`, finished records
go past their retention and never more than the cap stay, with their folders, while the store's
runs stay; and the sweep's look for job folders without a record comes at the first sweep, then
at most every FADRM_ORPHAN_INTERVAL, over a real job database and real folders."""
from __future__ import annotations

import secrets

import pytest

from api.jobs.job_records import JobDB
from api.jobs.retention import Retention, RetentionPolicy
from api.planning.service_settings import ServiceSettings
from tests.api_helpers import request, running_service, wait_state
from tests.ray_helpers import wait_for

RETENTION = 4  # FADRM_JOB_RETENTION of the service below, in seconds
MAX_RECORDS = 3


@pytest.fixture(scope="module")
def retaining(digits_teacher, tmp_path_factory):
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-retention"), max_running=1, max_queued=4,
                         rate_limit=1000, rate_burst=2000, job_retention=f"{RETENTION}s",
                         max_job_records=MAX_RECORDS) as server:
        yield server


@pytest.mark.ray
def test_finished_records_go_past_retention_and_never_more_than_the_cap_stay(retaining):
    with retaining.client() as http:
        done = wait_state(http, http.post("/v1/distillations", json=request(classes=[3, 7], ipc=1)).json()["id"],
                          timeout=240)
        assert done["state"] == "succeeded", done
        run_dir = retaining.store / done["run_id"]
        ids = []
        for seed in range(1, 7):  # POST then DELETE, over and over
            job = http.post("/v1/distillations", json=request(classes=[1, 2], seed=seed)).json()
            http.delete(f"/v1/distillations/{job['id']}")
            ids.append(job["id"])
            assert len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]) <= MAX_RECORDS
        assert http.get(f"/v1/distillations/{ids[0]}").status_code == 404
        # Past the retention, every finished record goes, with its folder; the store's run stays.
        wait_for(lambda: http.get("/v1/distillations", params={"limit": 100}).json()["jobs"] == [],
                 timeout=RETENTION + 30, interval=0.5)
        assert http.get(f"/v1/distillations/{done['id']}").status_code == 404
        assert not (retaining.store / ".fadrm-api" / "jobs" / done["id"]).exists()
        assert run_dir.is_dir() and (run_dir / "manifest.json").is_file()
        again = http.post("/v1/distillations", json=request(classes=[3, 7], ipc=1)).json()
        assert again["state"] == "succeeded" and again["reused"]  # served from the store, as before


@pytest.fixture
def make_retention(tmp_path):
    dbs = []

    def make(orphan_interval_s: float) -> Retention:
        dbs.append(JobDB(tmp_path / "store" / ".fadrm-api"))
        policy = RetentionPolicy(keep_s=7 * 86400, max_records=10_000, orphan_interval_s=orphan_interval_s)
        return Retention(dbs[-1], policy, spared=set)

    yield make
    for db in dbs:
        db.close()


def _plant(retention: Retention, n: int) -> list:
    """Job folders with no record, as a service killed mid-sweep leaves them."""
    folders = [retention.jobs_dir / f"job-{secrets.token_hex(12)}" for _ in range(n)]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "log.txt").write_text("left behind\n")
    return folders


def test_orphans_go_at_the_first_sweep_then_only_once_the_interval_has_passed(make_retention):
    retention = make_retention(orphan_interval_s=3600)
    first = _plant(retention, 2)
    assert retention.sweep() == 0
    assert not any(folder.exists() for folder in first)
    later = _plant(retention, 1)
    retention.sweep()  # within the hour: no walk of the job folders
    assert all(folder.exists() for folder in later)
    # The next service start (a new Retention) looks again at its first sweep.
    restarted = make_retention(orphan_interval_s=3600)
    restarted.sweep()
    assert not any(folder.exists() for folder in later)


def test_an_interval_of_zero_looks_at_every_sweep(make_retention):
    retention = make_retention(orphan_interval_s=0)
    for _ in range(3):
        planted = _plant(retention, 1)
        retention.sweep()
        assert not planted[0].exists()


def test_the_interval_is_a_duration(tmp_path):
    def settings(value):
        return ServiceSettings(api_token=secrets.token_urlsafe(32), store=tmp_path, teachers=tmp_path,
                               orphan_interval=value)

    assert settings("30m").orphan_interval == 1800.0 and settings(0).orphan_interval == 0
    for bad in ("soon", -1):
        with pytest.raises(ValueError, match="orphan_interval"):
            settings(bad)
