"""Bad input to the REST service, against the real server: each refused with its status and a
message naming the field, before any job exists or anything touches the store; a teacher file
that does not load is read once, never offered, and refused without its path."""
from __future__ import annotations

import os

import pytest

from tests.api_helpers import TOKEN, request

pytestmark = [pytest.mark.ray]


def _with(**changes) -> dict:
    body = request()
    for key, value in changes.items():
        if key.startswith("overrides_"):
            body["overrides"][key.removeprefix("overrides_")] = value
        elif value is _DROP:
            body.pop(key)
        else:
            body[key] = value
    return body


_DROP = object()

CASES = [
    ("unknown dataset", _with(dataset="cifar10"), "dataset", "unknown dataset 'cifar10'"),
    ("dataset path", _with(dataset="../etc"), "dataset", "name one of GET /v1/datasets"),
    ("dataset spec", _with(dataset="imagefolder:/etc"), "dataset", "name one of GET /v1/datasets"),
    ("unknown teacher", _with(teacher="resnet-nope"), "teacher", "unknown teacher 'resnet-nope'"),
    ("teacher path", _with(teacher="../../etc/passwd"), "teacher", "name one of GET /v1/teachers"),
    ("no teacher", _with(teacher=_DROP), "teacher", "exactly one of teacher"),
    ("class index", _with(classes=[3, 10]), "classes", "no class 10"),
    ("class name", _with(classes=["3", "cat"]), "classes", "no class named 'cat'"),
    ("no classes", _with(classes=[]), "classes", "at least 1"),
    ("duplicate classes", _with(classes=[3, "3"]), "classes", "more than once"),
    ("ipc 0", _with(ipc=0), "ipc", "greater than or equal to 1"),
    ("ipc over the limit", _with(ipc=6), "ipc", "at most 5"),
    ("too many images", _with(classes=list(range(10)), ipc=3), "ipc", "at most 20"),
    ("ipc as text", _with(ipc="2"), "ipc", "integer"),
    ("alpha 2", _with(overrides_alpha=2.0), "alpha", "alpha must be in (0, 1], got 2"),
    ("alpha 0", _with(overrides_alpha=0.0), "alpha", "alpha must be in (0, 1]"),
    ("k < 0", _with(overrides_k=-1), "k", "k must be an integer >= 0"),
    ("unknown override", _with(overrides_learning_rate=0.1), "learning_rate", "unknown config key(s) learning_rate"),
    ("override as text", _with(overrides_lr="0.1"), "lr", "lr must be"),
    ("ipc in overrides", _with(overrides_ipc=3), "ipc", "set ipc as a field of the request"),
    ("unknown field", _with(gpus=8), "gpus", "Extra inputs are not permitted"),
    ("unknown preset", _with(preset="magic"), "preset", "fadrm"),
    ("bad evaluation", {**request(), "evaluate": True, "evaluation": {"epochs": 0}}, "epochs", "epochs must be"),
]


@pytest.mark.parametrize("body,field,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_request_is_a_422_naming_the_field(api_service, body, field, message):
    with api_service.client() as http:
        before = len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"])
        response = http.post("/v1/distillations", json=body)
        assert response.status_code == 422, response.text
        errors = response.json()["detail"]
        assert any(field in [str(p) for p in e["loc"]] or field in e["msg"] for e in errors), errors
        assert any(message in e["msg"] for e in errors), errors
        assert len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]) == before


def test_ids_paths_and_sizes_are_refused_before_the_store(api_service):
    with api_service.client() as http:
        assert http.get("/v1/distillations/job-0123456789abcdef01234567").status_code == 404
        assert http.delete("/v1/distillations/job-0123456789abcdef01234567").status_code == 404
        for bad in ("job-xyz", "..%2F..%2Fetc%2Fpasswd", "job-0123456789abcdef01234567.json"):
            assert http.get(f"/v1/distillations/{bad}").status_code in (404, 422)
            assert http.get(f"/v1/distillations/{bad}/dataset").status_code in (404, 422)
        assert http.get("/v1/distillations", params={"state": "lost"}).status_code == 422
        assert http.get("/v1/distillations", params={"cursor": "../1"}).status_code == 422
        assert http.get("/v1/distillations", params={"limit": 0}).status_code == 422
        huge = http.post("/v1/distillations", content=b"{" + b" " * 70_000 + b"}",
                         headers={"content-type": "application/json"})
        assert huge.status_code == 413
        assert http.post("/v1/distillations", content=b"not json",
                         headers={"content-type": "application/json"}).status_code == 422
    assert not list(api_service.store.glob("etc*")) and TOKEN not in api_service.log()


def test_a_broken_teacher_file_is_read_once_never_offered_and_refused_without_its_path(api_service):
    broken = api_service.teachers / "broken.pt"
    broken.write_bytes(os.urandom(1 << 20))
    with api_service.client() as http:
        for _ in range(5):
            listed = http.get("/v1/teachers")
            assert listed.status_code == 200 and "broken" not in [t["name"] for t in listed.json()]
        r = http.post("/v1/distillations", json={**request(), "teacher": "broken"})
        assert r.status_code == 422 and "cannot be used" in r.text and str(api_service.root) not in r.text
        r = http.post("/v1/distillations", json={**request(), "teacher": "nope"})
        assert r.status_code == 422 and "this service offers: digits-tiny" in r.text and "broken" not in r.text
    assert api_service.log().count("teacher broken is not offered") == 1  # read once, not per listing
    broken.unlink()
