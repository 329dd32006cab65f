"""The REST service against a real server: uvicorn on a free port, a real local Ray head, the
real store (tests/api_helpers.py). The tests share one service; each uses its own seeds, so
each has its own runs."""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import pytest

from api.client import FadrmClient
from tests.api_helpers import TEACHER, TOKEN, raylet_children, request, wait_state
from tests.ray_helpers import events, wait_for

pytestmark = [pytest.mark.ray]


def test_health_is_open_and_everything_else_needs_the_token(api_service):
    with api_service.client(token=None) as anonymous:
        assert anonymous.get("/healthz").json() == {"ok": True}
        missing = anonymous.get("/v1/teachers")
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert anonymous.post("/v1/distillations", json=request()).status_code == 401
    with api_service.client(token="not-the-token-but-long-enough") as wrong:
        refused = wrong.get("/v1/distillations")
        assert refused.status_code == 403 and "not-the-token" not in refused.text
    with api_service.client() as client:
        wait_for(lambda: client.get("/readyz").status_code == 200, timeout=180, interval=0.5)
        assert client.get("/readyz").json() == {"ready": True, "ray": True, "store": True, "catalog": True, "detail": None}
        teachers = client.get("/v1/teachers").json()
        assert [(t["name"], t["model"], t["num_classes"], t["image_size"]) for t in teachers] == \
            [(TEACHER, "convnet-bn", 10, 8)]
        digits = {d["name"]: d for d in client.get("/v1/datasets").json()}["digits"]
        assert digits["num_classes"] == 10 and digits["class_names"][3] == "3"
        presets = client.get("/v1/presets").json()
        assert presets["fadrm"]["alpha"] == 0.5 and presets["sre2l"]["k"] == 0
    assert TOKEN not in api_service.log()


def test_submit_poll_download_and_read(api_service, tmp_path):
    import datasets
    import pandas as pd
    import pyarrow.parquet as pq

    with FadrmClient(api_service.url, TOKEN) as client:
        path = client.distill(out=tmp_path / "d.parquet", timeout=300, **_fields(request(classes=[3, "7"], ipc=2)))
        job = client.jobs()[0]
    assert job["state"] == "succeeded" and job["classes"] == [3, 7] and not job["reused"]
    assert job["progress"]["stages_done"] == job["progress"]["stages_total"] == 4
    assert [c["stages_done"] for c in job["progress"]["classes"]] == [4, 4]
    assert job["timings"]["running_seconds"] > 0
    table = pd.read_parquet(path)
    assert sorted(zip(table.label, table.ipc_index)) == [(3, 0), (3, 1), (7, 0), (7, 1)]
    features = json.loads(pq.read_schema(path).metadata[b"huggingface"])["info"]["features"]
    assert features["label"]["names"][7] == "7"
    loaded = datasets.load_dataset("parquet", data_files=str(path), split="train")
    assert loaded.features["label"].names[3] == "3" and loaded[0]["image"].size == (8, 8)

    with api_service.client() as http:
        whole = http.get(f"/v1/distillations/{job['id']}/dataset").content
        assert whole == path.read_bytes()
        part = http.get(f"/v1/distillations/{job['id']}/dataset", headers={"Range": "bytes=4-99"})
        assert part.status_code == 206 and part.content == whole[4:100]
        archive = http.get(f"/v1/distillations/{job['id']}/dataset", params={"format": "imagefolder"})
        assert archive.status_code == 200 and archive.content[:2] == b"PK"
        preview = http.get(f"/v1/distillations/{job['id']}/preview.png")
        assert preview.headers["content-type"] == "image/png" and preview.content[:4] == b"\x89PNG"
        report = http.get(f"/v1/distillations/{job['id']}/report").json()
        assert report["losses"]["iterations"] == 8 and len(report["losses"]["arc_merges_after"]) == 3
        assert report["evaluation"] is None


def test_the_same_request_is_the_same_job_and_computes_nothing_again(api_service):
    body = request(classes=[1, 2], ipc=2, seed=11)
    with api_service.client() as http:
        first = http.post("/v1/distillations", json=body, headers={"Idempotency-Key": "k-11"})
        assert first.status_code == 202 and first.headers["location"] == f"/v1/distillations/{first.json()['id']}"
        job = wait_state(http, first.json()["id"])
        assert job["state"] == "succeeded"
        run_dir = api_service.store / job["run_id"]
        stages = len(events(run_dir, "stage_done"))
        again = http.post("/v1/distillations", json=body)
        assert again.status_code == 200 and again.json()["id"] == job["id"]
        keyed = http.post("/v1/distillations", json=body, headers={"Idempotency-Key": "k-11"})
        assert keyed.json()["id"] == job["id"]
        other = http.post("/v1/distillations", json=request(classes=[1, 2], ipc=2, seed=12),
                          headers={"Idempotency-Key": "k-11"})
        assert other.status_code == 409 and "Idempotency-Key" in other.text
        smaller = http.post("/v1/distillations", json={**body, "ipc": 1})
        assert smaller.status_code == 202
        assert smaller.json()["state"] == "succeeded" and smaller.json()["reused"] is True
        assert smaller.json()["id"] != job["id"]
        assert len(events(run_dir, "stage_done")) == stages  # nothing ran again
        assert len(events(run_dir, "run_started")) == 1

        larger = http.post("/v1/distillations", json={**body, "ipc": 3}).json()
        assert wait_state(http, larger["id"])["state"] == "succeeded" and not larger["reused"]
        grown = {e["unit"] for e in events(run_dir, "stage_done")[stages:]}
        assert grown and all(u.endswith("-ipc00002-00003") for u in grown)  # only the missing IPC index ran


def test_queue_limit_cancel_and_a_fresh_request_after_it(api_service):
    slow = request(classes=[4, 5], ipc=2, seed=21, iterations=2000)
    with api_service.client() as http:
        job = http.post("/v1/distillations", json=slow).json()
        job = wait_state(http, job["id"], states=("running",), until=lambda j: j["progress"]["stages_done"] >= 1)
        assert job["eta_seconds"] is not None and job["progress"]["stages_total"] == 4
        assert raylet_children(api_service, "DistillWorker")
        # One runs (max_running 1), two may wait (max_queued 2), the next is refused.
        waiting = [http.post("/v1/distillations", json=request(seed=s)).json() for s in (22, 23)]
        assert [w["state"] for w in waiting] == ["queued", "queued"]
        refused = http.post("/v1/distillations", json=request(seed=24))
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
        listed = http.get("/v1/distillations", params={"state": "queued", "limit": 1}).json()
        assert len(listed["jobs"]) == 1 and listed["next_cursor"]
        rest = http.get("/v1/distillations", params={"state": "queued", "cursor": listed["next_cursor"]}).json()
        assert {j["id"] for j in listed["jobs"] + rest["jobs"]} == {w["id"] for w in waiting}
        for w in waiting:
            assert http.delete(f"/v1/distillations/{w['id']}").json()["state"] == "cancelled"

        cancelled = http.delete(f"/v1/distillations/{job['id']}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        wait_for(lambda: not raylet_children(api_service, "DistillWorker"), timeout=60)
        time.sleep(1)
        assert http.get(f"/v1/distillations/{job['id']}").json()["state"] == "cancelled"
        conflict = http.get(f"/v1/distillations/{job['id']}/dataset")
        assert conflict.status_code == 409 and conflict.json()["state"] == "cancelled"
        assert http.delete(f"/v1/distillations/{job['id']}").status_code == 409
        run_dir = api_service.store / job["run_id"]
        assert not (run_dir / "manifest.json").exists()

        fresh = http.post("/v1/distillations", json=slow).json()
        assert fresh["id"] != job["id"]
        assert wait_state(http, fresh["id"])["state"] == "succeeded"
        assert http.get(f"/v1/distillations/{fresh['id']}/dataset").status_code == 200


def test_a_restart_of_the_server_keeps_running_jobs(api_service):
    body = request(classes=[6, 8], ipc=2, seed=31, iterations=1200)
    with api_service.client() as http:
        job = http.post("/v1/distillations", json=body).json()
        wait_state(http, job["id"], states=("running",), until=lambda j: j["progress"]["stages_done"] >= 1)
        waiting = http.post("/v1/distillations", json=request(seed=32)).json()
        assert waiting["state"] == "queued"
    restarted = datetime.now(timezone.utc)
    api_service.stop()
    api_service.start()
    with api_service.client() as http:
        after = http.get(f"/v1/distillations/{job['id']}").json()
        assert after["state"] in ("running", "succeeded")
        assert http.delete(f"/v1/distillations/{waiting['id']}").json()["state"] == "cancelled"
        done = wait_state(http, job["id"])
        assert done["state"] == "succeeded"
        manifest = json.loads((api_service.store / job["run_id"] / "manifest.json").read_text())
        assert datetime.fromisoformat(manifest["finalized_at"]) > restarted  # it ran on through the restart
        assert http.get(f"/v1/distillations/{job['id']}/dataset").status_code == 200
        assert job["id"] in {j["id"] for j in http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]}
    run_dir = api_service.store / job["run_id"]
    assert len(events(run_dir, "run_started")) == 1  # one driver ran it, through the restart


def test_a_cancel_after_a_restart_stops_the_driver_the_old_server_started(api_service):
    body = request(classes=[2, 9], ipc=2, seed=51, iterations=4000)
    with api_service.client() as http:
        job = http.post("/v1/distillations", json=body).json()
        wait_state(http, job["id"], states=("running",), until=lambda j: j["progress"]["stages_done"] >= 1)
    api_service.stop()
    api_service.start()
    with api_service.client() as http:
        assert http.get(f"/v1/distillations/{job['id']}").json()["state"] == "running"
        assert http.delete(f"/v1/distillations/{job['id']}").json()["state"] == "cancelled"
        wait_for(lambda: not raylet_children(api_service, "DistillWorker"), timeout=60)
        assert http.get(f"/v1/distillations/{job['id']}").json()["state"] == "cancelled"
    assert not (api_service.store / job["run_id"] / "manifest.json").exists()


def test_evaluate_reports_the_students_accuracy(api_service):
    body = {**request(classes=[0, 1], ipc=1, seed=41), "evaluate": True,
            "evaluation": {"epochs": 2, "seeds": 1, "eval_every": 1}}
    with api_service.client() as http:
        job = http.post("/v1/distillations", json=body).json()
        assert job["evaluate"] is True
        assert wait_state(http, job["id"])["state"] == "succeeded"
        evaluation = http.get(f"/v1/distillations/{job['id']}/report").json()["evaluation"]
    assert 0 <= evaluation["top1_mean"] <= 100 and len(evaluation["top1_per_seed"]) == 1


def test_baselines_give_the_gain_over_random_real_images_and_warn_when_clearly_below(api_service):
    """Gaussian noise no iteration moved (preset sre2l, T = 0) teaches far less than random real
    images of the same classes: with baselines the report gives the gain seed by seed and one
    warning line naming what to try."""
    body = {**request(classes=[0, 1, 2, 3], ipc=2, seed=45, iterations=0), "preset": "sre2l", "evaluate": True,
            "baselines": True, "evaluation": {"epochs": 40, "seeds": 3}}
    with api_service.client() as http:
        refused = http.post("/v1/distillations", json={**body, "evaluate": False, "evaluation": {}})
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"][-1] == "baselines"
        job = http.post("/v1/distillations", json=body).json()
        assert job["baselines"] is True
        assert wait_state(http, job["id"])["state"] == "succeeded"
        evaluation = http.get(f"/v1/distillations/{job['id']}/report").json()["evaluation"]
    assert set(evaluation["baselines"]) == {"random_real"}  # noise has no starting patches
    gain = evaluation["paired_gains"]["random_real"]
    assert gain["seeds"] == 3 and gain["mean"] < -2 * gain["stderr"], gain
    [line] = evaluation["warnings"]
    assert line.startswith("this set is clearly below random real images of the same size (") and "try recipe" in line


def _fields(body: dict) -> dict:
    return {k: v for k, v in body.items()}
