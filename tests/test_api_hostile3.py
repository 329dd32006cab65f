"""A hostile client, round three, against a real `fadrm serve` on loopback: no 5xx for any string a
JSON body can hold (lone surrogates, non-characters, control bytes) in any typed field; the token
checked before the body is read; open descriptors flat over bursts of parallel reads; a broken
teacher file read once, never offered and refused without its path; a run damaged after its job
succeeded refused on every download route, in one line, with the job's record saying so."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from tests.api_helpers import flip_a_byte, request, running_service, wait_state

pytestmark = [pytest.mark.ray]
EVAL_BACKLOG = 300  # image-epochs of evaluation queued or running at once (FADRM_MAX_EVAL_BACKLOG)


@pytest.fixture(scope="module")
def api_service(digits_teacher, tmp_path_factory):
    """A service of this module's own: its tests break teacher files and damage runs."""
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-hostile3"), max_ipc=5, max_images=20,
                         max_running=1, max_queued=4, rate_limit=1000, rate_burst=2000,
                         max_eval_backlog=EVAL_BACKLOG) as server:
        yield server

# What a client can put in a JSON string: escaped lone surrogates (not encodable as UTF-8),
# non-characters, control bytes and a NUL.
NASTY = ["\\ud800", "\\udfff", "a\\ud83d", "\\ufffe", "\\uffff", "\\u0000", "\\u001b[31m", "x\\u202e"]


def _bodies() -> list[tuple[str, bytes]]:
    """(where, raw JSON body) with each nasty string in each typed field, an unknown key, a class
    name, a student_kwargs key and the ipc. The escapes go into the JSON text as they are: a lone
    surrogate cannot be encoded any other way."""
    mark = "@@nasty@@"
    out = []
    for text in NASTY:
        cases = {field: {**request(), field: mark} for field in ("dataset", "teacher", "preset", "ipc")}
        cases["unknown key"] = {**request(), mark: 1}
        cases["classes"] = {**request(), "classes": [mark]}
        cases["student_kwargs"] = {**request(), "evaluate": True, "evaluation": {"student_kwargs": {mark: 1}}}
        for where, body in cases.items():
            out.append((where, json.dumps(body).replace(mark, text).encode()))
    return out


def test_no_string_in_any_typed_field_answers_5xx(api_service):
    with api_service.client() as http:
        for where, body in _bodies():
            r = http.post("/v1/distillations", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code in (400, 422), (where, body[:120], r.status_code, r.text[:300])
            r.json()  # valid JSON, encodable as it was sent


def test_the_token_is_checked_before_the_body_is_read(api_service):
    with api_service.client(token=None) as anonymous:
        for body in (b"not json", b"\xff\xfe", b'{"dataset": "\\ud800"}'):
            r = anonymous.post("/v1/distillations", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (body, r.status_code)
    with api_service.client(token="not-the-token-" + "x" * 40) as wrong:
        assert wrong.post("/v1/distillations", content=b"not json").status_code == 403


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_open_descriptors_stay_flat_over_bursts_of_parallel_reads(api_service):
    """Bursts of 40 parallel reads of a job's endpoints, with idle periods long enough for the
    server's idle worker threads to exit between them: the job database's connections are a pool
    of fixed size, so the count of open files comes back to where it was."""
    with api_service.client() as http:
        job = http.post("/v1/distillations", json=request(classes=(4, 5), ipc=1)).json()
        wait_state(http, job["id"])
    pid = api_service.process.pid

    def burst():
        def read():
            with api_service.client() as c:
                c.get(f"/v1/distillations/{job['id']}")
                c.get("/v1/distillations")
        threads = [threading.Thread(target=read) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    counts = []
    for i in range(4):
        burst()
        time.sleep(1)  # the burst's sockets close
        counts.append(_open_files(pid))
        time.sleep(10 if i < 3 else 0)  # with the second above, longer than anyio's idle threads live (10 s)
    # Before the pool: 32 more after every burst. Now the count after the first burst holds.
    assert max(counts) - counts[0] <= 6 and counts[-1] <= counts[0] + 2, counts


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


def test_a_run_damaged_after_its_job_succeeded_is_refused_on_every_download_route(api_service):
    with api_service.client() as http:
        job = http.post("/v1/distillations", json=request(classes=(1, 8), ipc=1, seed=11)).json()
        done = wait_state(http, job["id"])
        assert done["state"] == "succeeded"
        run = api_service.store / done["run_id"]
        flip_a_byte(run)
        base = f"/v1/distillations/{job['id']}"
        for route in ("/dataset", "/dataset?format=imagefolder", "/preview.png"):
            r = http.get(base + route)
            assert r.status_code == 409, (route, r.status_code, r.text[:300])
            detail = r.json()["detail"]
            assert "failed verification" in detail and "fadrm verify" in detail and "\n" not in detail
            assert str(api_service.root) not in r.text
        assert "failed verification" in http.get(base).json()["error"]


def test_the_evaluation_work_queued_at_once_is_bounded(api_service):
    """2 classes x ipc 2 x 30 epochs x 2 seeds x 2 students a seed (the set's with soft labels, the
    ranking's with hard labels) = 480 image-epochs, over the service's 300: refused with 429 and
    Retry-After before any job exists; within it (one seed: 240), accepted."""
    with api_service.client() as http:
        before = len(http.get("/v1/distillations").json()["jobs"])
        big = {**request(classes=(2, 9), seed=21), "evaluate": True, "evaluation": {"epochs": 30, "seeds": 2}}
        r = http.post("/v1/distillations", json=big)
        assert r.status_code == 429 and "FADRM_MAX_EVAL_BACKLOG" in r.json()["detail"] and r.headers["retry-after"]
        assert len(http.get("/v1/distillations").json()["jobs"]) == before
        small = {**big, "evaluation": {"epochs": 30, "seeds": 1}}  # 240 image-epochs
        r = http.post("/v1/distillations", json=small)
        assert r.status_code == 202, r.text
        http.delete(f"/v1/distillations/{r.json()['id']}")
