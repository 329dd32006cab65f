"""A real `fadrm serve` for the API tests: uvicorn on 127.0.0.1 on a free port (or, with `tls`,
HTTPS on every interface with a certificate made here), its own local Ray head, a store and a
teacher folder under a temporary directory."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TOKEN = secrets.token_urlsafe(32)  # one per test session, strong enough for the service's rule
TEACHER = "digits-tiny"
NO_RAY = "127.0.0.1:9"  # a FADRM_RAY_ADDRESS no one answers: the service starts no Ray head (for tests that run no job)
# Tiny budgets: 4 stages of a few iterations, fp32 so the run is the same on any CPU.
FAST = {"iterations": 8, "precision": "fp32"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (PEM files in `folder`), for a server that must
    speak TLS."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


class ApiServer:
    def __init__(self, root: Path, tls: bool = False, **limits):
        self.root = root
        self.store = root / "store"
        self.teachers = root / "teachers"
        self.port = free_port()
        self.args = ["--port", str(self.port)]
        self.verify: ssl.SSLContext | bool = True
        if tls:  # HTTPS on every interface: what a non-loopback --host needs
            cert, key = self_signed(root)
            self.args += ["--host", "0.0.0.0", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
            self.verify = ssl.create_default_context(cafile=str(cert))
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.env = {**os.environ, "FADRM_API_TOKEN": TOKEN, "FADRM_STORE": str(self.store),
                    "FADRM_TEACHERS": str(self.teachers), "FADRM_WORKERS": "1", "FADRM_THREADS": "1",
                    "FADRM_RAY_CPUS": "2", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    **{f"FADRM_{k.upper()}": str(v) for k, v in limits.items()}}
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def command(self) -> list[str]:
        """What starts the server."""
        return [sys.executable, "-m", "actors.cli", "serve", *self.args]

    def start(self, timeout: float = 180) -> None:
        self.starts += 1
        log = open(self.root / f"serve-{self.starts}.log", "wb")
        self.process = subprocess.Popen(self.command(), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=self.root, start_new_session=True)
        log.close()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"fadrm serve exited: {self.log()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2, verify=self.verify).status_code == 200:
                    return
            time.sleep(0.3)
        raise TimeoutError("fadrm serve did not answer /healthz")

    def stop(self, timeout: float = 90) -> None:
        """SIGTERM, as an operator restarting the service would; jobs keep running."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout)
        self.process = None

    def log(self) -> str:
        return (self.root / f"serve-{self.starts}.log").read_text(errors="replace")

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, verify=self.verify)

    def stop_ray(self) -> None:
        subprocess.run([sys.executable, "-m", "actors.cli", "serve", "--stop-ray"], env=self.env, cwd=self.root,
                       capture_output=True, timeout=120)


@contextlib.contextmanager
def running_service(teacher: Path, root: Path, tls: bool = False, server_class: type = ApiServer, **limits):
    server = server_class(root, tls, **limits)
    server.store.mkdir(parents=True, exist_ok=True)
    server.teachers.mkdir(parents=True)
    shutil.copy(teacher, server.teachers / f"{TEACHER}.pt")
    try:
        server.start()
        yield server
    finally:
        server.stop()
        server.stop_ray()


def request(classes=(3, 7), ipc: int = 2, seed: int = 0, **overrides) -> dict:
    return {"dataset": "digits", "teacher": TEACHER, "classes": list(classes), "ipc": ipc, "seed": seed,
            "overrides": {**FAST, **overrides}}


def wait_state(client: httpx.Client, job_id: str, states=("succeeded", "failed", "cancelled"),
               timeout: float = 300, until=None) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.get(f"/v1/distillations/{job_id}").json()
        if job["state"] in states and (until is None or until(job)):
            return job
        time.sleep(0.3)
    raise TimeoutError(f"job {job_id} stayed {job['state']}: {job}")


def running_driver(server: ApiServer, http: httpx.Client, body: dict) -> tuple[str, int]:
    """Submit `body` and wait until its job runs with a driver that has beaten once: (job id, the
    driver's pid)."""
    import sqlite3

    from tests.ray_helpers import wait_for

    job_id = http.post("/v1/distillations", json=body).json()["id"]
    db = server.store / ".fadrm-api" / "jobs.sqlite"

    def pid():
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT pid FROM jobs WHERE id = ? AND state = 'running'", (job_id,)).fetchone()
        return row[0] if row and row[0] else None

    heartbeat = server.store / ".fadrm-api" / "jobs" / job_id / "heartbeat"
    wait_for(lambda: pid() is not None and heartbeat.exists(), timeout=120, interval=0.3)
    return job_id, pid()


def process_alive(pid: int | None) -> bool:
    """Whether process `pid` is alive (not a zombie)."""
    try:
        return pid is not None and Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def raylet_children(server: ApiServer, title: str) -> list[int]:
    """Pids of this service's Ray worker processes whose title holds `title` (e.g. DistillWorker)."""
    from api.jobs.local_ray import RayHead

    head = RayHead.model_validate_json((server.store / ".fadrm-api" / "ray-head.json").read_text())
    members = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == head.pid:
                members.add(int(entry.name))
        except OSError:
            continue
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text().rpartition(")")[2].split()
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat and stat[0] != "Z" and int(stat[1]) in members and title in cmd:
            found.append(int(entry.name))
    return found


def flip_a_byte(run: Path) -> None:
    """Damage a run as a bad disk does: one byte of its first part file flipped, size and mtime kept."""
    from fadrm_ray.layout import RunLayout

    part = RunLayout(run).parts_on_disk()[0]
    stat = part.stat()
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@contextlib.contextmanager
def in_process_service(root: Path, teacher: Path, **settings):
    """The app under a real uvicorn on loopback in this process, with a Ray address no one answers
    (no job runs) and `settings` (ServiceSettings fields): (the app, a client with its token)."""
    import threading

    import uvicorn

    from api.planning.service_settings import ServiceSettings
    from api.web.app import create_app

    (root / "teachers").mkdir()
    shutil.copy(teacher, root / "teachers" / f"{TEACHER}.pt")
    config = ServiceSettings(api_token=secrets.token_urlsafe(32), store=root / "store", teachers=root / "teachers",
                             ray_address="127.0.0.1:1", **settings)
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=60,
                          headers={"Authorization": f"Bearer {config.api_token}"}) as http:
            yield app, http
    finally:
        server.should_exit = True
        thread.join(60)
