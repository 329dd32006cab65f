"""A hostile client, round five, against a real `fadrm serve` on loopback: the probes answer from
the process, never from a client's budget (`/readyz` 200 while the token is rate limited, and the
Kubernetes probes of deploy/k8s/api.yaml pass against a busy server); a query string is as strict
as a body; the datasets are read once, as the service starts; the first soft-label download is
linear in the stored epochs; a damaged stored soft-label epoch is found by `fadrm verify`,
recomputed by `--repair`, and a 409 naming the repair meanwhile; an evaluation has an ETA; the
trusted proxies are said at start and forwarded headers from another peer are said once; a Ray
head that died leaves no folder, and a server killed with SIGKILL takes its head with it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from api.local_ray import LEASE, RayHead, RayLease, members, processes
from fadrm_ray.evaluation.soft_labels import DIGESTS, EpochDigests, recorded_digests
from fadrm_ray.layout import RunLayout
from tests.api_helpers import REPO, TEACHER, ApiServer, request, running_service
from tests.ray_helpers import wait_for

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def api5(digits_teacher, tmp_path_factory):
    """A service of this module's own, with the default request rate (20 a second, 40 at once) and
    one operator dataset that cannot be read."""
    root = tmp_path_factory.mktemp("api-hostile5")
    datasets = root / "datasets.yaml"
    datasets.write_text(f"broken: imagefolder:{root / 'no-such-folder'}\n")
    with running_service(digits_teacher[0], root, datasets=datasets, max_running=1) as server:
        with server.client() as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, timeout=240, interval=0.5)
        yield server


def _succeeded(http: httpx.Client, body: dict, seen: list | None = None, timeout: float = 600) -> dict:
    """The job of `body` once it has ended; every state it was seen in (polled every 0.3 s) to `seen`."""
    made = http.post("/v1/distillations", json=body)
    assert made.status_code in (200, 202), made.text
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = http.get(f"/v1/distillations/{made.json()['id']}").json()
        if seen is not None:
            seen.append(job)
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.3)
    raise TimeoutError(f"job {made.json()['id']} did not end: {job}")


# --------------------------------------------------------------------------- probes
class _Raylet(BaseHTTPRequestHandler):
    """A node's raylet health endpoint, healthy: the probes also ask it."""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"success")

    def log_message(self, *args):
        pass


def test_the_probes_answer_while_the_token_is_rate_limited_and_the_k8s_probes_pass(api5):
    container = yaml.safe_load_all((REPO / "deploy" / "k8s" / "api.yaml").read_text()).__next__()
    container = container["spec"]["template"]["spec"]["containers"][0]
    raylet = ThreadingHTTPServer(("127.0.0.1", 0), _Raylet)
    threading.Thread(target=raylet.serve_forever, daemon=True).start()
    probes = {name: container[name]["exec"]["command"][2].replace("127.0.0.1:52365", f"127.0.0.1:{raylet.server_port}")
              .replace("127.0.0.1:8000", f"127.0.0.1:{api5.port}") for name in
              ("readinessProbe", "livenessProbe", "startupProbe")}
    statuses: dict[str, list[int]] = {"/readyz": [], "/healthz": [], "/v1/teachers": []}
    stop = threading.Event()

    def poller() -> None:  # 40 of them, one keep-alive connection each, as a busy client's workers
        with api5.client() as http:
            while not stop.is_set():
                for path, seen in statuses.items():
                    seen.append(http.get(path).status_code)

    with api5.client() as http:
        while http.get("/v1/teachers").status_code != 429:  # the token over its rate
            pass
        assert [http.get("/readyz").status_code for _ in range(5)] == [200] * 5
        assert http.head("/readyz").status_code == 200 and http.get("/healthz").status_code == 200
    threads = [threading.Thread(target=poller) for _ in range(40)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: statuses["/v1/teachers"].count(429) >= 40, timeout=120)
        ran = {name: [subprocess.run([sys.executable, "-c", code], env={**os.environ, "FADRM_API_TOKEN": api5.env[
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


# --------------------------------------------------------------------------- query strings
def test_query_strings_are_as_strict_as_bodies(api5):
    job = "/v1/distillations/job-000000000000000000000000"
    with api5.client() as http:
        time.sleep(2.5)  # the token's bucket full again
        before = len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"])
        refused = {
            "POST /v1/distillations?dry_run=1": http.post("/v1/distillations?dry_run=1", json=request(seed=901)),
            "?format[]=": http.get(f"{job}/dataset?format%5B%5D=imagefolder"),
            "?Format=": http.get(f"{job}/dataset?Format=imagefolder"),
            "a repeated limit": http.get("/v1/distillations?limit=5&limit=6"),
            "/healthz?x": http.get("/healthz?x=1"),
            "/readyz?x": http.get("/readyz?x"),
            "/v1/teachers?limit": http.get("/v1/teachers?limit=1"),
            **{f"limit={raw}": http.get(f"/v1/distillations?limit={raw}")
               for raw in ("1_0", "%201", "%2B1", "1.0", "1e1", "0x10")},
            "index=1.0": http.get(f"{job}/teacher?index=1.0"),
        }
        for name, r in refused.items():
            assert r.status_code == 422, (name, r.status_code, r.text)
            assert r.json()["detail"][0]["loc"][0] == "query", (name, r.text)
        assert refused["POST /v1/distillations?dry_run=1"].json()["detail"][0]["loc"] == ["query", "dry_run"]
        assert refused["?format[]="].json()["detail"][0]["loc"] == ["query", "format[]"]
        assert refused["?Format="].json()["detail"][0]["loc"] == ["query", "Format"]
        assert "given 2 times" in refused["a repeated limit"].json()["detail"][0]["msg"]
        assert len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]) == before  # no job made
        assert http.get("/v1/distillations?limit=10&state=queued").status_code == 200


# --------------------------------------------------------------------------- the catalog, the log
def test_the_datasets_are_read_once_as_the_service_starts(api5):
    with api5.client() as http:
        assert http.get("/readyz").json()["catalog"] is True
        listings = [http.get("/v1/datasets") for _ in range(5)]
    assert [r.status_code for r in listings] == [200] * 5
    assert [d["name"] for d in listings[0].json()] == ["digits", "mnist-sample"]  # the broken one left out
    assert api5.log().count("dataset broken is not offered") == 1  # read once, not per request


def test_the_trusted_proxies_are_said_at_start_and_a_stray_forwarding_peer_once(api5):
    for i in range(3):
        assert httpx.get(f"{api5.url}/healthz", headers={"X-Forwarded-For": f"10.9.9.{i}"}).status_code == 200
    log = api5.log()
    assert "trusted proxies (FADRM_TRUSTED_PROXIES): none" in log
    warned = [line for line in log.splitlines() if "carries forwarding headers" in line]
    assert len(warned) == 1 and "from 127.0.0.1" in warned[0] and "the one it connects from" in warned[0], warned


# --------------------------------------------------------------------------- soft labels
def test_the_first_soft_label_download_is_linear_in_the_stored_epochs(api5):
    """100 stored epochs, then 1,000 (the same small epoch file copied): the first download of
    each (the pack built then; built again after its file is removed) takes a time per epoch
    within 3x of 100 epochs' (the best of two builds each)."""
    body = {**request(classes=[3, 7], ipc=1, seed=61), "evaluate": True,
            "evaluation": {"epochs": 100, "seeds": 1, "soft_labels": "stored", "soft_label_topk": 2}}
    with api5.client() as http:
        job = _succeeded(http, body)
        assert job["state"] == "succeeded", job
        url, built = f"/v1/distillations/{job['id']}/soft-labels", api5.store / ".fadrm-api" / "jobs" / job["id"]
        folder = next(RunLayout(api5.store / job["run_id"]).soft_labels.glob("*/meta.json")).parent

        def first_download() -> tuple[float, int]:
            best, rows = float("inf"), 0
            for _ in range(2):
                (built / "soft-labels.parquet").unlink(missing_ok=True)
                time.sleep(0.1)
                started = time.perf_counter()
                r = http.get(url)
                best = min(best, time.perf_counter() - started)
                assert r.status_code == 200, r.text
                rows = pq.read_metadata(built / "soft-labels.parquet").num_rows
            return best, rows

        hundred, rows_100 = first_download()
        digests = recorded_digests(folder)
        for epoch in range(100, 1000):  # recorded as an evaluation of 1,000 epochs records them
            name = f"epoch={epoch:05d}.parquet"
            shutil.copy(folder / "epoch=00000.parquet", folder / name)
            digests[name] = digests["epoch=00000.parquet"]
        (folder / DIGESTS).write_text(EpochDigests(files=digests).model_dump_json())
        thousand, rows_1000 = first_download()
    assert rows_1000 == 10 * rows_100 > 0
    assert thousand / 1000 <= 3 * hundred / 100, (hundred, thousand)


def test_a_damaged_soft_label_epoch_is_found_repaired_and_a_409_naming_the_repair_meanwhile(api5):
    body = {**request(classes=[2, 5], ipc=1, seed=62), "evaluate": True,
            "evaluation": {"epochs": 300, "seeds": 1, "soft_labels": "stored", "soft_label_topk": 2}}
    seen: list[dict] = []
    with api5.client() as http:
        job = _succeeded(http, body, seen)
        assert job["state"] == "succeeded", job
        # The evaluation's ETA: once its first student has trained, the other's time is estimated.
        evaluating = [j for j in seen if j["progress"]["phase"] == "evaluating"]
        assert evaluating and all(j["progress"]["students_total"] == 2 for j in evaluating)
        assert any(j["eta_seconds"] is not None and j["progress"]["students_done"] == 1 for j in evaluating), \
            [(j["progress"]["students_done"], j["eta_seconds"]) for j in evaluating]

        run = api5.store / job["run_id"]
        folder = next(RunLayout(run).soft_labels.glob("*/meta.json")).parent
        epoch = folder / "epoch=00299.parquet"
        data = bytearray(epoch.read_bytes())
        data[len(data) // 2] ^= 0xFF
        epoch.write_bytes(bytes(data))
        name = f"soft_labels/{folder.name}/epoch=00299.parquet"

        refused = http.get(f"/v1/distillations/{job['id']}/soft-labels")
        assert refused.status_code == 409, refused.text
        detail = refused.json()["detail"]
        assert name in detail and f"fadrm verify --run STORE/{job['run_id']} --repair" in detail
        assert str(api5.root) not in refused.text
        assert http.get(f"/v1/distillations/{job['id']}").json()["error"] == detail

        env = {**api5.env, "PYTHONPATH": str(REPO)}
        found = subprocess.run([sys.executable, "-m", "actors.cli", "verify", "--run", str(run)], env=env,
                               capture_output=True, text=True, timeout=300)
        assert found.returncode == 1 and f"{name}: its sha256 differs" in found.stdout, found.stdout + found.stderr
        fixed = subprocess.run([sys.executable, "-m", "actors.cli", "verify", "--run", str(run), "--repair", "--quiet"],
                               env=env, capture_output=True, text=True, timeout=600)
        assert fixed.returncode == 0 and f"mended 1 other file(s): {name}" in fixed.stdout, fixed.stdout + fixed.stderr

        served = http.get(f"/v1/distillations/{job['id']}/soft-labels")
        assert served.status_code == 200, served.text
        assert http.get(f"/v1/distillations/{job['id']}").json()["error"] is None


# --------------------------------------------------------------------------- the Ray head
def _named(folder: str) -> list[int]:
    """Live processes whose command line names `folder` (a head's processes name its folder)."""
    found = []
    for pid in processes():
        try:
            if folder.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def _alive(pid: int | None) -> bool:
    try:
        return pid is not None and Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def test_a_dead_heads_folder_goes_and_a_sigkilled_server_takes_its_head_with_it(digits_teacher, tmp_path):
    server = ApiServer(tmp_path)
    server.store.mkdir(parents=True)
    server.teachers.mkdir(parents=True)
    shutil.copy(digits_teacher[0], server.teachers / f"{TEACHER}.pt")
    record = server.store / ".fadrm-api" / "ray-head.json"
    server.start()
    try:
        with server.client() as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, timeout=240, interval=0.5)
            first = RayHead.model_validate_json(record.read_text())
            os.killpg(first.pid, signal.SIGKILL)  # the head dies: a new one replaces it, its folder goes
            wait_for(lambda: RayHead.model_validate_json(record.read_text()).pid != first.pid, timeout=60)
            wait_for(lambda: http.get("/readyz").status_code == 200, timeout=240, interval=0.5)
        assert not Path(first.temp_dir).exists()
        (Path(first.temp_dir) / "session_late" / "logs").mkdir(parents=True)  # as a late writer of the old head
        wait_for(lambda: not Path(first.temp_dir).exists(), timeout=30, interval=0.5)

        head = RayHead.model_validate_json(record.read_text())
        assert members(head.pid) and _alive(head.lifeline_pid)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
        killed = time.monotonic()
        wait_for(lambda: not members(head.pid) and not _named(head.temp_dir) and not _alive(head.lifeline_pid),
                 timeout=60, interval=0.5)
        print(f"the head's processes were gone {time.monotonic() - killed:.1f} s after the server's SIGKILL")
        assert not Path(head.temp_dir).exists() and not record.exists()
    finally:
        server.stop()
        server.stop_ray()


def test_a_server_killed_while_a_job_runs_leaves_the_head_to_its_driver(digits_teacher, tmp_path):
    """SIGKILL while a job runs: its driver holds the head's lease, so the head stays until the
    driver has finished the job, then goes; the service started again reports the job succeeded."""
    server = ApiServer(tmp_path)
    server.store.mkdir(parents=True)
    server.teachers.mkdir(parents=True)
    shutil.copy(digits_teacher[0], server.teachers / f"{TEACHER}.pt")
    record = server.store / ".fadrm-api" / "ray-head.json"
    server.start()
    try:
        with server.client() as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, timeout=240, interval=0.5)
            job = http.post("/v1/distillations", json=request(classes=[4, 9], seed=71, iterations=400)).json()
            wait_for(lambda: http.get(f"/v1/distillations/{job['id']}").json()["state"] == "running", timeout=120)
        lease = server.store / ".fadrm-api" / LEASE
        wait_for(lambda: RayLease.model_validate_json(lease.read_text()).drivers, timeout=30)  # the driver holds it
        head = RayHead.model_validate_json(record.read_text())
        outcome = server.store / ".fadrm-api" / "jobs" / job["id"] / "outcome.json"
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
        wait_for(outcome.is_file, timeout=300, interval=0.5)  # the driver went on, on the head it held
        wait_for(lambda: not members(head.pid) and not _alive(head.lifeline_pid), timeout=60, interval=0.5)
        server.start()
        with server.client() as http:
            done = http.get(f"/v1/distillations/{job['id']}").json()
            deadline = time.time() + 60
            while done["state"] == "running" and time.time() < deadline:
                time.sleep(0.5)
                done = http.get(f"/v1/distillations/{job['id']}").json()
            assert done["state"] == "succeeded", done
            assert http.get(f"/v1/distillations/{job['id']}/dataset").status_code == 200
    finally:
        server.stop()
        server.stop_ray()
