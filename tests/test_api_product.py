"""What a client downloads reaches the top-1 the report shows: the job's teacher checkpoint(s)
(GET .../teacher), the student recipe (GET .../recipe), the dataset file saying which labels
reach the reported figure, and the client fetching all three; against the real server."""
from __future__ import annotations

import hashlib
import json
import shutil

import pyarrow.parquet as pq
import pytest

from api.client import Downloaded, FadrmClient, ServiceError
from fadrm_ray.evaluation.training import resolve_protocol
from fadrm_ray.models import load_teacher
from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.config import EvalConfig
from tests.api_helpers import TEACHER, TOKEN, request, running_service, wait_state

pytestmark = [pytest.mark.ray]
PLAIN = request(classes=[5], ipc=2, seed=44)
EVALUATED = {**request(classes=[0, 1], ipc=1, seed=43), "evaluate": True, "evaluation": {"epochs": 2, "seeds": 1}}


def _succeeded(server, body: dict) -> dict:
    with server.client() as http:
        response = http.post("/v1/distillations", json=body)
        assert response.status_code in (200, 202), response.text
        job = wait_state(http, response.json()["id"])
    assert job["state"] == "succeeded", job
    return job


@pytest.fixture(scope="module")
def plain(api_service) -> dict:
    return _succeeded(api_service, PLAIN)


@pytest.fixture(scope="module")
def evaluated(api_service) -> dict:
    return _succeeded(api_service, EVALUATED)


def test_the_teacher_download_is_the_teacher_file(api_service, plain, tmp_path):
    original = (api_service.teachers / f"{TEACHER}.pt").read_bytes()
    digest = hashlib.sha256(original).hexdigest()
    base = f"/v1/distillations/{plain['id']}"
    with api_service.client() as http:
        response = http.get(f"{base}/teacher")
        assert response.status_code == 200, response.text
        assert response.content == original
        assert response.headers["content-type"] == "application/octet-stream"
        assert response.headers["content-disposition"] == f'attachment; filename="{TEACHER}.pt"'
        assert response.headers["etag"] == f'"{digest}"' and response.headers["repr-digest"].startswith("sha-256=:")
        head = http.head(f"{base}/teacher")
        assert head.status_code == 200 and int(head.headers["content-length"]) == len(original) and not head.content
        beyond = http.get(f"{base}/teacher", params={"index": 5})
        assert beyond.status_code == 404 and beyond.json()["detail"] == \
            f"job {plain['id']} has 1 teacher (index 0..0); no teacher 5"
        assert http.get(f"{base}/teacher", params={"index": 99}).status_code == 422
        assert http.get(f"{base}/teacher", params={"index": "../x"}).status_code == 422
        assert http.get(f"{base}/teacher", params={"index": -1}).status_code == 422
        job = http.get(base).json()
        assert job["links"]["teacher"] == f"{base}/teacher" and job["links"]["recipe"] == f"{base}/recipe"
    saved = tmp_path / "t.pt"
    saved.write_bytes(response.content)
    _, info = load_teacher(saved)
    assert info.sha256 == digest and info.num_classes == 10 and info.image_size == 8


def test_the_recipe_is_the_evaluations_config_and_round_trips(api_service, evaluated, plain):
    with api_service.client() as http:
        body = http.get(f"/v1/distillations/{evaluated['id']}/recipe")
        assert body.status_code == 200 and body.headers["content-type"] == "application/json"
        recipe = EvalConfig.model_validate_json(body.content)
        reported = http.get(f"/v1/distillations/{evaluated['id']}/report").json()["evaluation"]
        default = EvalConfig.model_validate_json(http.get(f"/v1/distillations/{plain['id']}/recipe").content)
    evaluation_file = api_service.store / ".fadrm-api" / "jobs" / evaluated["id"] / "evaluation.json"
    assert recipe == Evaluation.model_validate_json(evaluation_file.read_text()).config
    assert recipe.model_dump(mode="json") == reported["config"]
    assert recipe.epochs == 2 and recipe.seeds == 1 and recipe.cosine_stretch == 1.0
    # Not evaluated: the defaults, resolved for its 2 images at IPC 2 as evaluate_run resolves them.
    assert default == resolve_protocol(EvalConfig(), 2, 2) and default.epochs is not None


def test_the_dataset_file_says_which_labels_reach_the_reported_top1(api_service, plain):
    base = f"/v1/distillations/{plain['id']}"
    with api_service.client() as http:
        data = http.get(f"{base}/dataset").content
    import io

    about = json.loads(pq.read_schema(io.BytesIO(data)).metadata[b"fadrm"])
    labels = about["labels"]
    digest = hashlib.sha256((api_service.teachers / f"{TEACHER}.pt").read_bytes()).hexdigest()
    assert labels["teachers"] == [{"name": TEACHER, "sha256": digest, "url": f"{base}/teacher?index=0"}]
    assert labels["recipe"] == f"{base}/recipe" and labels["kd_temperature"] == 20.0
    assert "soft labels (KD at T=20)" in labels["note"] and "hard labels alone reach less" in labels["note"]


def test_the_client_fetches_data_teacher_and_recipe(api_service, plain, tmp_path):
    with FadrmClient(api_service.url, TOKEN) as client:
        got = client.distill(out=tmp_path / "d.parquet", timeout=300, with_teacher=True, **PLAIN)
        plain_path = client.distill(out=tmp_path / "only.parquet", timeout=300, **PLAIN)
        recipe = client.recipe(plain["id"])
        again = client.download_teacher(plain["id"], tmp_path / "again.pt")
    assert isinstance(got, Downloaded) and plain_path == tmp_path / "only.parquet"
    assert got == Downloaded(data=tmp_path / "d.parquet", teachers=(tmp_path / "d.teacher.pt",),
                             recipe=tmp_path / "d.recipe.json")
    assert got.data.read_bytes() == plain_path.read_bytes()
    original = (api_service.teachers / f"{TEACHER}.pt").read_bytes()
    assert got.teachers[0].read_bytes() == original == again.read_bytes()
    assert EvalConfig.model_validate_json(got.recipe.read_text()) == recipe
    assert not list(tmp_path.glob("*.part"))


def test_a_committee_has_a_teacher_per_index(api_service, tmp_path):
    second = api_service.teachers / "digits-tiny-b.pt"
    shutil.copy(api_service.teachers / f"{TEACHER}.pt", second)
    try:
        body = {**request(classes=[6], ipc=1, seed=46), "preset": "fadrm+", "teachers": [TEACHER, "digits-tiny-b"]}
        body.pop("teacher")
        job = _succeeded(api_service, body)
        with FadrmClient(api_service.url, TOKEN) as client:
            got = client.distill(out=tmp_path / "c.parquet", timeout=300, with_teacher=True, **body)
        assert [p.name for p in got.teachers] == ["c.teacher.pt", "c.teacher-1.pt"]
        assert got.teachers[1].read_bytes() == second.read_bytes()
        with api_service.client() as http:
            second_one = http.get(f"/v1/distillations/{job['id']}/teacher", params={"index": 1})
            assert second_one.headers["content-disposition"] == 'attachment; filename="digits-tiny-b.pt"'
            assert http.get(f"/v1/distillations/{job['id']}/teacher", params={"index": 2}).status_code == 404
    finally:
        second.unlink()


def test_nothing_is_served_before_the_job_succeeded(api_service):
    with api_service.client() as http:
        job = http.post("/v1/distillations", json=request(classes=[7], ipc=1, seed=45, iterations=4000)).json()
        assert http.delete(f"/v1/distillations/{job['id']}").json()["state"] == "cancelled"
        for what in ("recipe", "teacher"):
            refused = http.get(f"/v1/distillations/{job['id']}/{what}")
            assert refused.status_code == 409 and refused.json()["state"] == "cancelled", refused.text
        assert http.get("/v1/distillations/job-000000000000000000000000/teacher").status_code == 404


def test_a_service_that_keeps_teachers_private_says_so_in_one_line(api_service, plain, digits_teacher,
                                                                 tmp_path_factory, tmp_path):
    root = tmp_path_factory.mktemp("api-private")
    # The run is already in its store: the job is succeeded at once, so no Ray is needed (none is reachable).
    shutil.copytree(api_service.store / plain["run_id"], root / "store" / plain["run_id"])
    with running_service(digits_teacher[0], root, private_teachers="true", ray_address="127.0.0.1:9") as server:
        job = _succeeded(server, PLAIN)
        assert job["reused"] is True
        with server.client() as http:
            refused = http.get(f"/v1/distillations/{job['id']}/teacher")
            assert http.get(f"/v1/distillations/{job['id']}/recipe").status_code == 200
        line = refused.json()["detail"]
        assert refused.status_code == 403 and "\n" not in line
        assert "keeps teachers private" in line and f"/v1/distillations/{job['id']}/recipe" in line
        with FadrmClient(server.url, TOKEN) as client, pytest.raises(ServiceError) as raised:
            client.distill(out=tmp_path / "d.parquet", timeout=60, with_teacher=True, **PLAIN)
    assert str(raised.value) == f"HTTP 403: {line}" and raised.value.status == 403
    assert not list(tmp_path.iterdir())  # nothing of the refused call is left
