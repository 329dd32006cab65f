"""Submits against the service's app under a real uvicorn on loopback, in this process and with a
Ray address of its own (no job runs): a submit whose store read is stuck does not hold up
another submit, and a refused body is parsed once."""
from __future__ import annotations

import errno
import json
import os
import threading
import time

import httpx
import pytest

from tests.api_helpers import in_process_service, request


@pytest.fixture
def served(digits_teacher, tmp_path):
    with in_process_service(tmp_path, digits_teacher[0], rate_limit=1000, rate_burst=2000, max_queued=8) as served:
        yield served


def _run_dir(app, body: dict):
    from api.contract.schemas import DistillationRequest
    from api.planning.requests import plan_request, run_dir

    service = app.state.service
    plan = plan_request(DistillationRequest.model_validate(body), service.catalog, service.limits, service.store,
                        service.device)
    return run_dir(service.store, plan)


def test_a_submit_stuck_reading_the_store_holds_up_no_other_submit(served, tmp_path):
    """One submit's run has a manifest that blocks its reader (a FIFO with no data): while that
    submit is inside its store read, another submit is answered."""
    app, http = served
    stuck, other = request(classes=(1, 2), seed=5), request(classes=(4, 6), seed=5)
    run = _run_dir(app, stuck)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("being written\n")
    manifest = run / "manifest.json"
    os.mkfifo(manifest)
    answers = {}

    def submit_stuck():
        with httpx.Client(base_url=str(http.base_url), headers=http.headers, timeout=120) as own:
            answers["stuck"] = own.post("/v1/distillations", json=stuck)

    thread = threading.Thread(target=submit_stuck)
    thread.start()
    writer = None
    try:
        deadline = time.time() + 120
        while writer is None:  # opens once the service has the manifest open for reading
            try:
                writer = os.open(manifest, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                assert exc.errno == errno.ENXIO and time.time() < deadline, exc
                time.sleep(0.05)
        # The stuck submit now reads (nothing comes until the writer closes); this one is answered.
        answer = http.post("/v1/distillations", json=other, timeout=30)
        assert answer.status_code == 202, answer.text
        assert answer.json()["classes"] == [4, 6]
        assert "stuck" not in answers
    finally:
        manifest.unlink()
        if writer is not None:
            os.close(writer)
        thread.join(120)
    # Its run had no manifest (nor a writer) once read: absent, so a job is queued for it.
    assert answers["stuck"].status_code == 202, answers["stuck"].text
    assert answers["stuck"].json()["classes"] == [1, 2]


def test_a_body_is_parsed_once(served, monkeypatch):
    """A body refused for its shape (api.web.refusals.body_shape) and one accepted: each parsed once."""
    app, http = served
    parsed = []
    real_loads = json.loads

    def counting_loads(text, *args, **kwargs):
        parsed.append(text)
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting_loads)
    for body, status in ((json.dumps({**request(), "colour": "red"}).encode(), 422),
                         (json.dumps(request(classes=(2, 8))).encode(), 202)):
        answer = http.post("/v1/distillations", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == status, answer.text
        assert parsed.count(body) == 1
