"""The probes, against a real `fadrm serve` on loopback: they answer from the process, never from a
client's budget (`/readyz` 200 while the token is rate limited, and the Kubernetes probes of
deploy/k8s/api.yaml pass against a busy server); and /readyz waits for the datasets, read once,
as the service starts (one that cannot be read logged once and left out)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from tests.api_helpers import REPO, running_service
from tests.ray_helpers import wait_for

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def probed(digits_teacher, tmp_path_factory):
    """A service of this module's own, with the default request rate (20 a second, 40 at once) and
    one operator dataset that cannot be read."""
    root = tmp_path_factory.mktemp("api-probes")
    datasets = root / "datasets.yaml"
    datasets.write_text(f"broken: imagefolder:{root / 'no-such-folder'}\n")
    with running_service(digits_teacher[0], root, datasets=datasets, max_running=1) as server:
        with server.client() as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, timeout=240, interval=0.5)
        yield server


# Before the test that takes the token past its rate: this one's listings need the token's budget.
def test_the_datasets_are_read_once_as_the_service_starts(probed):
    with probed.client() as http:
        assert http.get("/readyz").json()["catalog"] is True
        listings = [http.get("/v1/datasets") for _ in range(5)]
    assert [r.status_code for r in listings] == [200] * 5
    assert [d["name"] for d in listings[0].json()] == ["digits", "mnist-sample"]  # the broken one left out
    assert probed.log().count("dataset broken is not offered") == 1  # read once, not per request


class _Raylet(BaseHTTPRequestHandler):
    """A node's raylet health endpoint, healthy: the probes also ask it."""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"success")

    def log_message(self, *args):
        pass


def test_the_probes_answer_while_the_token_is_rate_limited_and_the_k8s_probes_pass(probed):
    container = yaml.safe_load_all((REPO / "deploy" / "k8s" / "api.yaml").read_text()).__next__()
    container = container["spec"]["template"]["spec"]["containers"][0]
    raylet = ThreadingHTTPServer(("127.0.0.1", 0), _Raylet)
    threading.Thread(target=raylet.serve_forever, daemon=True).start()
    probes = {name: container[name]["exec"]["command"][2].replace("127.0.0.1:52365", f"127.0.0.1:{raylet.server_port}")
              .replace("127.0.0.1:8000", f"127.0.0.1:{probed.port}") for name in
              ("readinessProbe", "livenessProbe", "startupProbe")}
    statuses: dict[str, list[int]] = {"/readyz": [], "/healthz": [], "/v1/teachers": []}
    stop = threading.Event()

    def poller() -> None:  # 40 of them, one keep-alive connection each, as a busy client's workers
        with probed.client() as http:
            while not stop.is_set():
                for path, seen in statuses.items():
                    seen.append(http.get(path).status_code)

    with probed.client() as http:
        while http.get("/v1/teachers").status_code != 429:  # the token over its rate
            pass
        assert [http.get("/readyz").status_code for _ in range(5)] == [200] * 5
        assert http.head("/readyz").status_code == 200 and http.get("/healthz").status_code == 200
    threads = [threading.Thread(target=poller) for _ in range(40)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: statuses["/v1/teachers"].count(429) >= 40, timeout=120)
        ran = {name: [subprocess.run([sys.executable, "-c", code], env={**os.environ, "FADRM_API_TOKEN": probed.env[
            "FADRM_API_TOKEN"]}, capture_output=True, timeout=60).returncode for _ in range(3)]
            for name, code in probes.items()}
    finally:
        stop.set()
        for t in threads:
            t.join()
        raylet.shutdown()
    assert ran == {name: [0, 0, 0] for name in probes}, ran
    assert set(statuses["/readyz"]) == {200} and set(statuses["/healthz"]) == {200}, \
        {path: sorted(set(seen)) for path, seen in statuses.items()}
    assert 429 in statuses["/v1/teachers"]
