"""Jobs that end other than by succeeding, against real servers (tests/api_helpers.py): the
wall-clock limit, what a cancelled job leaves behind, the error a client reads of a failed one,
the outcome file beside the record, the loopback-only Ray head, and the modes of the files the
service writes. The tests after the first share one service of their own, in file order."""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from api.jobs.job_files import Outcome, read_model
from api.jobs.local_ray import RayHead
from tests.api_helpers import raylet_children, request, running_service, wait_state
from tests.ray_helpers import wait_for

pytestmark = [pytest.mark.ray]
# Enough recover iterations that a job is still distilling whenever a test acts on it.
LONG = {"iterations": 20_000}


@pytest.fixture(scope="module")
def service(digits_teacher, tmp_path_factory):
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-ends")) as server:
        yield server


def _job_files(server, job_id: str) -> Path:
    return server.store / ".fadrm-api" / "jobs" / job_id


def _outcome(server, job_id: str) -> Outcome | None:
    return read_model(_job_files(server, job_id) / "outcome.json", Outcome)


def _agreeing_outcome(server, job: dict, timeout: float = 60) -> Outcome:
    """The job's outcome file once it says what the API says (the driver, or the service once
    the driver is gone, writes it)."""
    return wait_for(lambda: (o := _outcome(server, job["id"])) and o.state == job["state"]
                    and o.error == job["error"] and o, timeout=timeout, interval=0.2)


def _still_answers_after_the_end(http, job: dict) -> None:
    """GET, list and DELETE of a job that ended: the same state, and a 409 for what it cannot do."""
    again = http.get(f"/v1/distillations/{job['id']}")
    assert again.status_code == 200 and again.json()["state"] == job["state"]
    assert again.json()["error"] == job["error"]
    listed = {j["id"]: j["state"] for j in http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]}
    assert listed[job["id"]] == job["state"]
    refused = http.delete(f"/v1/distillations/{job['id']}")
    assert refused.status_code == 409 and refused.json()["state"] == job["state"]
    assert http.get(f"/v1/distillations/{job['id']}/dataset").status_code == 409


def test_a_job_past_the_time_limit_is_stopped_and_fails_saying_so(digits_teacher, tmp_path):
    with running_service(digits_teacher[0], tmp_path, max_job_seconds=3) as server, server.client() as http:
        posted = http.post("/v1/distillations", json=request(classes=[2, 8], ipc=1, seed=71, **LONG))
        assert posted.status_code == 202, posted.text
        job = wait_state(http, posted.json()["id"], timeout=120)
        assert job["state"] == "failed"
        assert job["error"] == "ran longer than the service's job limit of 3 s (FADRM_MAX_JOB_SECONDS)"
        assert 3 <= job["timings"]["running_seconds"] < 60
        _agreeing_outcome(server, job)
        wait_for(lambda: not raylet_children(server, "DistillWorker"), timeout=60, interval=0.5)
        _still_answers_after_the_end(http, job)


# --------------------------------------------------------------------------- the local Ray head
def _listening() -> dict[str, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket (/proc/net/tcp, tcp6)."""
    found = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                hex_address, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_address)  # each 32-bit word in host (little-endian) order
                raw = b"".join(struct.pack("<I", int.from_bytes(raw[i:i + 4], "big")) for i in range(0, len(raw), 4))
                found[fields[9]] = (socket.inet_ntop(family, raw), int(hex_port, 16))
    return found


def _group(pgid: int) -> list[int]:
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    members.append(int(entry.name))
            except OSError:
                continue
    return members


def _sockets_of(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    listening = _listening()
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and link[8:-1] in listening:
                out.setdefault(pid, []).append(listening[link[8:-1]])
    return out


def _driver_pid(job_id: str) -> int | None:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"api.jobs.runner" in cmd and any(arg.endswith(job_id.encode()) for arg in cmd):
                return int(entry.name)
    return None


def _routable_address() -> str | None:
    """This machine's address on its default route (what Ray would pick), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def _loopback(address: str) -> bool:
    return address in ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def test_the_service_ray_listens_on_loopback_only_and_a_cancel_says_cancelled(service):
    head = RayHead.model_validate_json((service.store / ".fadrm-api" / "ray-head.json").read_text())
    with service.client() as http:
        posted = http.post("/v1/distillations", json=request(classes=[4, 6], ipc=1, seed=72, **LONG))
        job_id = posted.json()["id"]
        wait_state(http, job_id, states=("running",), timeout=60)
        # Once a distill actor is up, every kind of Ray process is: GCS, raylet, agents, workers, the driver.
        wait_for(lambda: raylet_children(service, "DistillWorker"), timeout=120, interval=0.5)
        driver = wait_for(lambda: _driver_pid(job_id), timeout=30, interval=0.2)
        sockets = _sockets_of(_group(head.pid) + _group(driver))
        assert len(sockets) >= 3, sockets  # GCS, raylet and workers at least: the check saw them
        exposed = {pid: [s for s in found if not _loopback(s[0])] for pid, found in sockets.items()}
        assert not any(exposed.values()), exposed
        if (address := _routable_address()) is not None:
            answered = []
            for port in sorted({port for found in sockets.values() for _, port in found}):
                with socket.socket() as probe:
                    probe.settimeout(2)
                    if probe.connect_ex((address, port)) == 0:
                        answered.append(port)
            assert not answered, f"ports answering on {address}: {answered}"

        cancelled = http.delete(f"/v1/distillations/{job_id}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        job = wait_state(http, job_id)
        assert (job["state"], job["error"]) == ("cancelled", "cancelled by request")
        outcome = _agreeing_outcome(service, job)
        assert "SystemExit" not in outcome.model_dump_json()
        wait_for(lambda: not raylet_children(service, "DistillWorker"), timeout=60, interval=0.5)
        _still_answers_after_the_end(http, job)


# --------------------------------------------------------------------------- what a job leaves
def _files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []


def test_a_cancelled_evaluation_leaves_no_soft_labels_and_the_run_still_verifies(service):
    body = {**request(classes=[0, 9], ipc=2, seed=73), "evaluate": True,
            "evaluation": {"soft_labels": "stored", "epochs": 2000, "seeds": 1}}
    with service.client() as http:
        posted = http.post("/v1/distillations", json=body)
        assert posted.status_code == 202, posted.text
        job_id, run_dir = posted.json()["id"], service.store / posted.json()["run_id"]
        labels = run_dir / "soft_labels"
        # Mid-way: some epochs stored, far from all of them.
        wait_for(lambda: len(_files_under(labels)) >= 5, timeout=240, interval=0.2)
        assert wait_state(http, job_id, states=("running",), timeout=5)
        assert http.delete(f"/v1/distillations/{job_id}").json()["state"] == "cancelled"
        job = wait_state(http, job_id)
        _agreeing_outcome(service, job)
        # The supervisor removes the labels first, then the snapshot that lists them (so that a
        # stop in between still knows what to remove): wait for both.
        snapshot = _job_files(service, job_id) / "soft-labels-before.json"
        wait_for(lambda: not _files_under(labels) and not snapshot.exists(), timeout=60, interval=0.3)
        assert not snapshot.exists()
        _still_answers_after_the_end(http, job)
    verified = subprocess.run([sys.executable, "-m", "actors.cli", "verify", "--run", str(run_dir), "--json"],
                              capture_output=True, text=True, timeout=300, env=service.env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    check = json.loads(verified.stdout)
    assert check["ok"] and not check["bad_units"]


def test_a_failed_job_says_its_cause_first_in_one_clean_line(service):
    with service.client() as http:
        posted = http.post("/v1/distillations", json=request(classes=[1, 5], ipc=1, seed=74))
        assert posted.status_code == 202, posted.text
        job_id, run_dir = posted.json()["id"], service.store / posted.json()["run_id"]
        # A damaged store: where the distill actors keep their stage checkpoints is a file, so
        # the first stage fails in the actor, on every attempt.
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints").write_text("not a folder")
        job = wait_state(http, job_id, timeout=240)
    error = job["error"]
    assert job["state"] == "failed", job
    assert error.startswith("FileExistsError: "), error
    assert "checkpoints" in error and "stage 0 failed" in error
    assert "\x1b[" not in error and "\n" not in error and len(error) <= 500
    assert not re.search(r"\d+\.\d+\.\d+\.\d+", error) and "pid=" not in error and "ray::" not in error
    assert not re.search(r"[0-9a-f]{24,}", error)  # no actor or node ids
    _agreeing_outcome(service, job)
    log = (_job_files(service, job_id) / "driver.log").read_text()
    assert "Traceback" in log and "FileExistsError" in log  # the operator keeps the whole chain
    with service.client() as http:
        _still_answers_after_the_end(http, job)


def test_the_files_the_service_writes_are_its_own_users_alone(service):
    with service.client() as http:
        done = wait_state(http, http.post("/v1/distillations", json=request(classes=[0, 9], ipc=2, seed=73)).json()["id"])
        assert done["state"] == "succeeded" and done["reused"]  # the run the cancelled evaluation left
        for path in ("dataset", "preview.png"):
            assert http.get(f"/v1/distillations/{done['id']}/{path}").status_code == 200
        assert http.get(f"/v1/distillations/{done['id']}/dataset", params={"format": "imagefolder"}).status_code == 200
    state = service.store / ".fadrm-api"
    written = [state / "jobs.sqlite", state / "jobs.sqlite-wal", state / "ray-head.json", state / "ray-auth-token"]
    written += [p for p in [state / "jobs.sqlite-shm"] if p.exists()]
    for job_dir in (state / "jobs").iterdir():
        written += [p for p in job_dir.iterdir() if p.is_file()]
    names = {p.name for p in written}
    assert {"driver.log", "outcome.json", "plan.json", "dataset.parquet", "imagefolder.zip", "preview.png"} <= names
    loose = {str(p.relative_to(state)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written
             if stat.S_IMODE(p.stat().st_mode) != 0o600}
    assert not loose, loose
