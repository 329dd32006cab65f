"""The store under pressure, against a real `fadrm serve` on loopback whose store is a small tmpfs of
its own (a mount namespace of the server's, where the machine allows one): job records capped at
two while new jobs sweep old ones and downloads run in a loop (no 5xx, no folder left without a
record, planted orphans removed); then the disk full (every download and submit a 503 in one line,
`/readyz` a 503) and a job's folder read-only (its downloads a 503 in one line), and once the disk
is back nothing is lost or damaged."""
from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from api.web.probes import READY_EVERY_S
from tests.api_helpers import ApiServer, request, running_service, wait_state
from tests.ray_helpers import wait_for

pytestmark = [pytest.mark.ray]
STORE_MB = 256
ROUTES = ("/dataset", "/dataset?format=imagefolder", "/preview.png", "/report", "/recipe", "/teacher")


def _tmpfs_allowed(folder: Path) -> bool:
    """Whether this machine lets a process mount a tmpfs in a mount namespace of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        return False
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{folder}'"],
                          capture_output=True, timeout=30)
    return done.returncode == 0


class TmpfsServer(ApiServer):
    """`fadrm serve` whose store is a tmpfs of STORE_MB, mounted in a mount namespace of the
    server's (`unshare -rm`): the server and what it starts see it; this process reaches it
    through /proc/PID/root."""

    def command(self) -> list[str]:
        mount = f'mount -t tmpfs -o size={STORE_MB}m tmpfs "{self.store}" && exec "$0" "$@"'
        return ["unshare", "-rm", "sh", "-c", mount, *super().command()]

    @property
    def seen_store(self) -> Path:
        """The store as the server sees it."""
        return Path(f"/proc/{self.process.pid}/root") / self.store.relative_to("/")

    def stop(self, timeout: float = 90) -> None:
        """SIGTERM, then what `fadrm serve --stop-ray` does for the head it leaves up (its record
        lives in the tmpfs, which goes with the server's namespace)."""
        import signal

        from api.jobs.local_ray import RayHead, alive, signal_group

        head = None
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                head = RayHead.model_validate_json((self.seen_store / ".fadrm-api" / "ray-head.json").read_text())
        super().stop(timeout)
        if head is not None and alive(head.pid, head.pid_start):
            signal_group(head.pid, signal.SIGTERM)
            deadline = time.time() + 10
            while time.time() < deadline and alive(head.pid, head.pid_start):
                time.sleep(0.2)
            signal_group(head.pid, signal.SIGKILL)
            shutil.rmtree(head.temp_dir, ignore_errors=True)

    def stop_ray(self) -> None:  # done by `stop`
        pass

    def _in_namespace(self, *command: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.process.pid), "-U", "-m", "--preserve-credentials", *command],
                       check=True, capture_output=True, timeout=30)

    @contextlib.contextmanager
    def read_only(self, folder: Path):
        """`folder` (a path in the store) read-only for the block: bound onto itself read-only (a
        file system with files open for writing, as the job records are, cannot be made so whole)."""
        self._in_namespace("mount", "--bind", str(folder), str(folder))
        try:
            self._in_namespace("mount", "-o", "remount,bind,ro", str(folder))
            yield
        finally:
            self._in_namespace("umount", str(folder))


@pytest.fixture(scope="module")
def tight(digits_teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("api-store")
    if not _tmpfs_allowed(root / "probe"):
        pytest.skip("this machine lets no process mount a tmpfs in a namespace of its own (unshare -rm)")
    # orphan_interval=0: the folders planted mid-test are looked for by every sweep, not only the first.
    with running_service(digits_teacher[0], root, server_class=TmpfsServer, max_job_records=2, max_ipc=5,
                         max_images=20, rate_limit=1000, rate_burst=2000, orphan_interval=0) as server:
        yield server


def _job_ids(http: httpx.Client) -> set[str]:
    return {job["id"] for job in http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]}


def test_sweeps_racing_downloads_answer_no_5xx_and_leave_no_folder_without_a_record(tight):
    jobs = tight.seen_store / ".fadrm-api" / "jobs"
    with tight.client() as http:
        first = wait_state(http, http.post("/v1/distillations", json=request(classes=(3, 7), ipc=4)).json()["id"])
        assert first["state"] == "succeeded"
        planted = [jobs / f"job-{i:024x}" for i in (1, 2)]  # folders with no record, as a crash leaves them
        for folder in planted:
            folder.mkdir(parents=True)
            (folder / "dataset.parquet").write_bytes(b"left behind")

        statuses: list[int] = []
        made: list[str] = []
        stop = threading.Event()

        def download():
            with tight.client() as c:
                while not stop.is_set():
                    for job_id in list(_job_ids(c)):
                        for route in ROUTES:
                            statuses.append(c.get(f"/v1/distillations/{job_id}{route}").status_code)
                        statuses.append(c.head(f"/v1/distillations/{job_id}/dataset").status_code)

        readers = [threading.Thread(target=download) for _ in range(3)]
        for reader in readers:
            reader.start()
        try:
            # Four requests the run already holds (IPC 1 to 4), in turn: each one whose job was
            # swept is a new job, and its record takes the records past the cap of two.
            for i in range(48):
                r = http.post("/v1/distillations", json=request(classes=(3, 7), ipc=1 + i % 4))
                assert r.status_code in (200, 202), r.text
                made.append(r.json()["id"])
        finally:
            stop.set()
            for reader in readers:
                reader.join()
        assert len(set(made)) > 10  # the cap made new jobs all along
        assert statuses and max(statuses) < 500, sorted(set(statuses))
        assert set(statuses) <= {200, 404}, sorted(set(statuses))
        assert statuses.count(200) > 0
        records = _job_ids(http)
        folders = {p.name for p in jobs.iterdir()}
        assert len(records) <= 2 and folders <= records, (records, folders)
        assert not any(folder.exists() for folder in planted)


def _fill(store: Path) -> Path:
    filler = store / "filler"
    with open(filler, "wb") as f:
        block = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
                f.flush()
    with contextlib.suppress(OSError):  # the last few bytes
        with open(filler, "ab") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    return filler


def _refused_in_one_line(r: httpx.Response, root: Path) -> str:
    assert r.status_code == 503 and r.headers["retry-after"], (r.status_code, r.text[:300])
    detail = r.json()["detail"]
    assert "\n" not in detail and "Traceback" not in r.text and str(root) not in r.text, r.text
    return detail


def test_a_full_or_read_only_store_is_a_503_in_one_line_and_loses_nothing(tight, tmp_path):
    from fadrm_ray.store.verify import verify_run

    with tight.client() as http:
        job = wait_state(http, http.post("/v1/distillations", json=request(classes=(2, 5), ipc=1, seed=3)).json()["id"])
        assert job["state"] == "succeeded"
        base = f"/v1/distillations/{job['id']}"
        before = _job_ids(http)

        filler = _fill(tight.seen_store)
        try:
            for route in ("/dataset", "/dataset?format=imagefolder", "/preview.png"):
                assert "full" in _refused_in_one_line(http.get(base + route), tight.root), route
            new = http.post("/v1/distillations", json=request(classes=(4, 6), ipc=1, seed=4))
            assert "full" in _refused_in_one_line(new, tight.root)
            # /readyz answers from the readiness its thread checks every READY_EVERY_S seconds.
            wait_for(lambda: http.get("/readyz").status_code == 503, timeout=10 * READY_EVERY_S, interval=0.2)
            assert http.get(base).json()["state"] == "succeeded" and _job_ids(http) == before
            # The readiness thread's write probes that failed left no file (one in flight goes at once).
            state = tight.seen_store / ".fadrm-api"
            wait_for(lambda: not [p for p in state.iterdir() if "probe" in p.name], timeout=5, interval=0.1)
        finally:
            filler.unlink()

        with tight.read_only(tight.store / ".fadrm-api" / "jobs" / job["id"]):
            for route in ("/dataset", "/dataset?format=imagefolder", "/preview.png"):
                assert "read-only" in _refused_in_one_line(http.get(base + route), tight.root), route

        for route in ROUTES:
            assert http.get(base + route).status_code == 200, route
        wait_for(lambda: http.get("/readyz").status_code == 200, timeout=10 * READY_EVERY_S, interval=0.2)
        assert http.get(base).json()["error"] is None and _job_ids(http) == before
    check = verify_run(tight.seen_store / job["run_id"])
    assert check.complete and not check.bad_units, check
    # SQLite resolves /proc/PID/root to this namespace's /: the records are checked in a copy (the
    # server is idle now: nothing is written between the copies).
    copy = tmp_path / "jobs.sqlite"
    for suffix in ("", "-wal"):
        source = tight.seen_store / ".fadrm-api" / f"jobs.sqlite{suffix}"
        if source.exists():
            shutil.copy(source, f"{copy}{suffix}")
    with contextlib.closing(sqlite3.connect(copy)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert {row[0] for row in conn.execute("SELECT id FROM jobs")} == before
    leftovers = [p.name for p in (tight.seen_store / ".fadrm-api" / "jobs" / job["id"]).iterdir()
                 if p.name.startswith(".")]
    assert leftovers == [], leftovers  # no partial file of a write that failed
    assert os.path.exists(tight.seen_store / job["run_id"])
