"""What every probe of `python -m bench.api_probes` shares: a `fadrm serve` of its own on loopback
(`Server`, its store a tmpfs in a mount namespace of its own where asked and allowed), the folder
it runs in (`prepare`: a small digits teacher as `bench.pt`), and the helpers that time it."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.api_load import REPO, TOKEN, free_port, small_teacher, wait_ready

# The request the probes start from: 2 digits classes, IPC 2, a few iterations.
BASE = {"dataset": "digits", "teacher": "bench", "classes": [3, 7], "ipc": 2,
        "overrides": {"iterations": 8, "precision": "fp32"}}
TMPFS_MB = 1024


def prepare(out: str | None, prefix: str) -> Path:
    """The folder a probe runs in (`out`, else a new temporary one), with the teacher in place."""
    root = Path(out or tempfile.mkdtemp(prefix=prefix))
    (root / "teachers").mkdir(parents=True, exist_ok=True)
    if not (root / "teachers" / "bench.pt").is_file():
        shutil.copy(small_teacher(root / "teacher"), root / "teachers" / "bench.pt")
    return root


def tmpfs_allowed(root: Path) -> bool:
    """Whether this machine lets a process mount a tmpfs in a namespace of its own (`unshare -rm`)."""
    probe = root / "probe"
    probe.mkdir(exist_ok=True)
    return bool(shutil.which("nsenter")) and subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{probe}'"], capture_output=True).returncode == 0


class Server:
    """`fadrm serve` on a port of its own, with these FADRM_* `settings`; its store a tmpfs where
    `tmpfs` (then the server's own mount namespace holds it: `seen` is the store as it sees it);
    the service's code this checkout's, or `code`'s (another checkout, to measure a change against)."""

    def __init__(self, root: Path, tmpfs: bool = False, code: Path | None = None, **settings):
        self.root, self.tmpfs, self.port = root, tmpfs, free_port()
        self.store = root / "store"
        self.store.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "FADRM_API_TOKEN": TOKEN, "FADRM_STORE": str(self.store),
                    "FADRM_TEACHERS": str(root / "teachers"), "FADRM_WORKERS": "1", "FADRM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([str(code or REPO), os.environ.get("PYTHONPATH", "")]),
                    **{f"FADRM_{k.upper()}": str(v) for k, v in settings.items()}}
        command = [sys.executable, "-m", "actors.cli", "serve", "--port", str(self.port)]
        if tmpfs:
            command = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={TMPFS_MB}m tmpfs "{self.store}" && '
                       'exec "$0" "$@"', *command]
        self.log = root / "serve.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.url, self.headers = f"http://127.0.0.1:{self.port}", {"Authorization": f"Bearer {TOKEN}"}

    @property
    def seen(self) -> Path:
        """The store as the server sees it."""
        return Path(f"/proc/{self.proc.pid}/root") / self.store.relative_to("/") if self.tmpfs else self.store

    def inside(self, *command: str) -> list[str]:
        """`command` as run in the server's namespace (there is none without a tmpfs)."""
        ns = ["nsenter", "-t", str(self.proc.pid), "-U", "-m", "--preserve-credentials"]
        return [*ns, *command] if self.tmpfs else list(command)

    def client(self, token: bool = True, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers if token else {}, timeout=120, **kw)

    def ready(self) -> None:
        with self.client() as http:
            wait_ready(http)

    def stop(self) -> None:
        """SIGTERM, then what `fadrm serve --stop-ray` does, for a head left up (its record read
        before: a namespace would hide it after)."""
        from api.jobs.local_ray import RayHead, stop_head

        record = self.seen / ".fadrm-api" / "ray-head.json"
        head = RayHead.model_validate_json(record.read_text()) if record.exists() else None
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        if head is not None:
            stop_head(head)


def done(http: httpx.Client, body: dict) -> dict:
    """The job of `body`, once it has succeeded (SystemExit when it did not)."""
    job = http.post("/v1/distillations", json=body).json()
    while job["state"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.3)
        job = http.get(f"/v1/distillations/{job['id']}").json()
    if job["state"] != "succeeded":
        raise SystemExit(f"job {job['id']} {job['state']}: {job['error']}")
    return job


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def raw_exchange(port: int, data: bytes, timeout: float = 15.0) -> tuple[bytes, bool]:
    """Send `data` on a new connection: what came back, and whether the server closed it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            return got, False
    return got, True


def healthz_while(port: int, stop: threading.Event) -> list[float]:
    """`/healthz` latencies (s), one request every 0.1 s until `stop` is set."""
    times = []
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            started = time.perf_counter()
            http.get(f"http://127.0.0.1:{port}/healthz")
            times.append(time.perf_counter() - started)
            time.sleep(0.1)
    return times
