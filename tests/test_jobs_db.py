"""Job records of an earlier version: those whose plan this version cannot run are left out of
what runs jobs, not an error, and the service still answers, lists and settles them; plans of a
shape this version knows are read; the files between the service and its drivers are models."""
import json
import sqlite3
import time

from api.jobs.job_records import JobDB


def test_a_record_with_an_old_plan_is_skipped(tmp_path):
    db = JobDB(tmp_path)
    _write(db, "INSERT INTO jobs (id, fingerprint, state, plan, created_at) VALUES (?, ?, ?, ?, ?)",
           ("job-old", "f", "succeeded", json.dumps({"run_id": "fadrm-0", "config": {}}), time.time()))
    assert db.get("job-old") is None
    assert db.page(None, 10, None) == [] and db.in_state("succeeded") == []
    db.close()


UNREADABLE_PLAN = json.dumps({"run_id": "fadrm-0", "config": {}, "dataset": "digits", "teachers": ["digits-tiny"],
                              "classes": [3, 7], "ipc": 2})


def _service_settings(tmp_path):
    import secrets

    from api.planning.service_settings import ServiceSettings

    (tmp_path / "teachers").mkdir(exist_ok=True)
    # A Ray address of its own: the service starts no local Ray head (nothing here runs a job).
    return ServiceSettings(api_token=secrets.token_urlsafe(32), store=tmp_path / "store",
                           teachers=tmp_path / "teachers", ray_address="127.0.0.1:1")


def _write(db, sql: str, args: tuple) -> None:
    """A row written as an earlier version would have written it: straight into the database."""
    with sqlite3.connect(db.path, isolation_level=None) as conn:
        conn.execute(sql, args)
    conn.close()


def _insert(db, job_id: str, state: str, plan: str, **columns) -> None:
    names = ["id", "fingerprint", "state", "plan", "created_at", *columns]
    _write(db, f"INSERT INTO jobs ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
           (job_id, "f", state, plan, time.time(), *columns.values()))


def test_a_service_upgraded_under_old_records_serves_lists_and_settles_them(tmp_path):
    """Records whose plan this version cannot read are still jobs: GET answers them (not 404),
    the listing shows them, and one that was running or queued is settled as failed, saying
    why, since no driver of this version can run it."""
    from fastapi.testclient import TestClient

    from api.web.app import create_app

    settings = _service_settings(tmp_path)
    done, running, queued = (f"job-{c * 24}" for c in "abc")
    db = JobDB(settings.state_dir)
    _insert(db, done, "succeeded", UNREADABLE_PLAN, started_at=time.time(), finished_at=time.time())
    _insert(db, running, "running", UNREADABLE_PLAN, started_at=time.time())
    _insert(db, queued, "queued", "{not json")
    db.close()
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {settings.api_token}"
        old = client.get(f"/v1/distillations/{done}")
        assert old.status_code == 200, old.text
        assert old.json()["state"] == "succeeded" and old.json()["dataset"] == "digits"
        assert old.json()["classes"] == [3, 7] and old.json()["run_id"] == "fadrm-0"
        for job_id in (running, queued):
            job = client.get(f"/v1/distillations/{job_id}").json()
            assert job["state"] == "failed", job
            assert "could not be read" in job["error"] and "upgrade" in job["error"]
        listed = client.get("/v1/distillations").json()["jobs"]
        assert {j["id"] for j in listed} == {done, running, queued}
        # Its results cannot be served without a plan: a 409 saying why, not a 404 or a 500.
        results = client.get(f"/v1/distillations/{done}/dataset")
        assert results.status_code == 409 and "could not be read" in results.json()["detail"]
        assert client.delete(f"/v1/distillations/{running}").status_code == 409


def _old_plan_json() -> str:
    """A plan as the versions before this one stored it: ipc, classes, seed and preset beside
    the job, and again in its config."""
    from fadrm_ray.config import make_config
    from fadrm_ray.runs.job import DistillJob

    cfg = make_config("fadrm", overrides={"iterations": 8, "precision": "fp32"}, ipc=2, classes=[3, 7], seed=5)
    job = DistillJob(config=cfg, dataset_spec="digits", dataset_fingerprint="d" * 16, num_classes=10,
                     image_size=8, channels=1, store="/store", run_id="fadrm-pinned",
                     teachers=(), device_type="cpu")
    # The teacher as those versions recorded it (its model under "model").
    teacher = {"path": "/teachers/t.pt", "sha256": "a" * 64, "model": "convnet-bn", "in_chans": 1, "test_accuracy": 0.9}
    return json.dumps({"dataset": "digits", "teachers": ["digits-tiny"], "classes": [3, 7], "class_names": ["3", "7"],
                       "ipc": 2, "preset": "fadrm", "seed": 5, "evaluate": False, "baselines": False,
                       "job": {**job.model_dump(mode="json"), "teachers": [teacher]}, "evaluation": None})


# The fingerprint of the plan above as the versions that stored it computed it.
PINNED_FINGERPRINT = "d9d4952a24bf16cac213fffb27ad88019b2418507a9a3533bb7efb21053c7451"


def test_a_plan_holds_ipc_classes_seed_and_preset_once_and_keeps_its_fingerprint(tmp_path):
    """The plan's request fields that the job's settings already hold are read from them: its
    JSON holds each once (in job.config); a plan stored with them twice is still read, and the
    fingerprint of the same job is the same string as before."""
    from api.planning.requests import JobPlan

    plan = JobPlan.model_validate_json(_old_plan_json())
    assert (plan.ipc, plan.classes, plan.seed, plan.preset) == (2, [3, 7], 5, "fadrm")
    stored = json.loads(plan.model_dump_json())
    assert not {"ipc", "classes", "seed", "preset"} & set(stored), sorted(stored)
    assert (stored["job"]["config"]["ipc"], stored["job"]["config"]["classes"]) == (2, [3, 7])
    assert plan.fingerprint() == PINNED_FINGERPRINT
    assert JobPlan.model_validate_json(plan.model_dump_json()) == plan
    db = JobDB(tmp_path)
    _insert(db, "job-old", "succeeded", _old_plan_json())
    record = db.get("job-old")
    assert record is not None and record.plan == plan and record.plan.fingerprint() == PINNED_FINGERPRINT
    db.close()


def test_the_files_between_service_and_driver_are_models_and_a_bad_one_reads_as_absent(tmp_path):
    import os

    from api.jobs.job_files import JobFiles, Outcome, SoftLabelSnapshot, StopOrder, read_model, write_model
    from api.jobs.leftovers import remove_added, snapshot
    from api.jobs.local_ray import RayHead

    files = JobFiles(tmp_path / "job")
    assert read_model(files.outcome, Outcome) is None  # not written yet
    write_model(files.outcome, Outcome(state="failed", error="why", pid=7))
    assert read_model(files.outcome, Outcome) == Outcome(state="failed", error="why", pid=7)
    assert os.stat(files.outcome).st_mode & 0o777 == 0o600
    for garbled in ("{half", "[1, 2]", '{"error": "no state"}'):
        files.stop.write_text(garbled)
        assert read_model(files.stop, StopOrder) is None
    # Written by an earlier version with json.dumps: read the same.
    (tmp_path / "ray-head.json").write_text(json.dumps({"pid": 12, "pid_start": "345", "temp_dir": "/tmp/fadrm-ray-x"}))
    assert read_model(tmp_path / "ray-head.json", RayHead) == RayHead(pid=12, pid_start="345",
                                                                       temp_dir="/tmp/fadrm-ray-x")
    labels = tmp_path / "labels"
    (labels / "seed0").mkdir(parents=True)
    (labels / "seed0" / "meta.json").write_text("{}")
    write_model(files.soft_labels_before, snapshot(labels))
    (labels / "seed0" / "epoch-1.bin").write_bytes(b"x")
    before = read_model(files.soft_labels_before, SoftLabelSnapshot)
    assert remove_added(labels, before) == ["seed0/epoch-1.bin"]


def test_an_idempotency_key_held_by_an_unreadable_record_is_a_conflict_not_a_server_error(tmp_path, digits_teacher):
    """The key names the old job whatever this version can read of it: another request with it is a
    409 (as for any job), not a second record with the same key (a 500)."""
    import shutil

    from fastapi.testclient import TestClient

    from api.web.app import create_app
    from tests.api_helpers import TEACHER, request

    settings = _service_settings(tmp_path)
    shutil.copy(digits_teacher[0], settings.teachers / f"{TEACHER}.pt")
    old = "job-" + "d" * 24
    db = JobDB(settings.state_dir)
    _insert(db, old, "succeeded", UNREADABLE_PLAN, idempotency_key="key-1", finished_at=time.time())
    db.close()
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {settings.api_token}"
        again = client.post("/v1/distillations", json=request(), headers={"Idempotency-Key": "key-1"})
        assert again.status_code == 409 and old in again.json()["detail"], again.text


def test_an_evaluations_students_done_never_pass_its_total(tmp_path):
    """Students are counted from the files kept in the run since the evaluation started: others
    kept at the same time (a second job, a CLI evaluate) never take the count past the total."""
    import time

    from api.jobs.job_outputs import _evaluation_progress
    from api.planning.requests import JobPlan
    from fadrm_ray.config import EvalConfig
    from fadrm_ray.evaluation.scores import StudentScore
    from fadrm_ray.layout import RunLayout

    plan = JobPlan.model_validate_json(_old_plan_json())
    plan = plan.model_copy(update={"evaluate": True, "evaluation": EvalConfig(seeds=1)})
    total = plan.eval_students[0]
    run = tmp_path / "run"
    RunLayout(run).evaluations_dir.mkdir(parents=True)
    since = time.time()
    for i in range(total + 3):
        student = StudentScore(seed=i, final_top1=50.0, best_top1=50.0, curve=[], epochs=1, steps=1, seconds=1.0)
        (RunLayout(run).evaluations_dir / f"{i:016x}.json").write_text(student.model_dump_json())
    done, students, eta = _evaluation_progress(run, plan, since)
    assert (done, students) == (total, total) and eta == 0, (done, students, eta)


def test_once_an_evaluations_first_student_is_kept_the_others_time_is_estimated(tmp_path):
    """The ETA of an evaluation: None before any student is kept (no pace timed in this process
    for the data and student), then the students left at the pace of those kept so far."""
    import time

    from api.jobs import job_outputs
    from api.planning.requests import JobPlan
    from fadrm_ray.config import EvalConfig
    from fadrm_ray.evaluation.scores import StudentScore
    from fadrm_ray.layout import RunLayout

    plan = JobPlan.model_validate_json(_old_plan_json())
    plan = plan.model_copy(update={"evaluate": True, "evaluation": EvalConfig(seeds=1),
                                   "dataset": "a-dataset-no-evaluation-timed"})
    total = plan.eval_students[0]
    assert total >= 2
    run = tmp_path / "run"
    RunLayout(run).evaluations_dir.mkdir(parents=True)
    since = time.time() - 10.0  # the evaluation started ten seconds ago
    assert job_outputs._evaluation_progress(run, plan, since) == (0, total, None)
    student = StudentScore(seed=0, final_top1=50.0, best_top1=50.0, curve=[], epochs=1, steps=1, seconds=1.0)
    (RunLayout(run).evaluations_dir / f"{0:016x}.json").write_text(student.model_dump_json())
    job_outputs._STUDENTS_CACHE.clear()  # counted at most every STUDENTS_CACHE_S seconds
    done, students, eta = job_outputs._evaluation_progress(run, plan, since)
    assert (done, students) == (1, total)
    assert eta is not None and 9.0 * (total - 1) <= eta <= 12.0 * (total - 1), eta  # ten seconds a student

