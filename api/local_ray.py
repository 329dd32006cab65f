"""The service's own local Ray head (`LocalRay`, its record `RayHead`), and the process checks
the driver supervisor (`api.drivers`) shares with it: a process is known by its pid and start
time, so a reused pid is never taken for it.

The head binds to loopback only: Ray turns a loopback `--node-ip-address` into the machine's
routable address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (its single-machine mode), and its
metrics export is off (`LOOPBACK_RAY_ENV`, which the drivers get too).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from fadrm_ray.runtime import proc_stat

from api.files import private_append, private_write
from api.job_files import read_model, write_model

START_TIMEOUT_S = 180.0
# Ray's single-machine mode (the node's address stays loopback) and no metrics export port.
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_enable_metrics_collection": "0"}


def proc_start(pid: int | None) -> str | None:
    """The start time of a live (not zombie) process, from /proc; None when it is gone."""
    stat = proc_stat(pid) if pid else None
    return None if stat is None or stat[0] in ("Z", "X") else stat[2]


def alive(pid: int | None, started: str | None) -> bool:
    now = proc_start(pid)
    return now is not None and (started is None or now == started)


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class RayHead(BaseModel):
    """The record of the service's local Ray head (`STATE/ray-head.json`): its process (the
    group's leader) and that process's start time, and its temporary folder."""

    model_config = ConfigDict(extra="ignore")
    pid: int
    pid_start: str | None = None
    temp_dir: str


class LocalRay:
    """The service's own Ray head: started once, reused across restarts of the service."""

    def __init__(self, state_dir: Path, cpus: int | None):
        self.record = state_dir / "ray-head.json"
        self.token = state_dir / "ray-auth-token"
        self.cpus = cpus or os.cpu_count() or 1
        self._starting = threading.Lock()  # one start at a time: the watch and a job's start

    def env(self) -> dict[str, str]:
        """What the head and every driver joining it run with (module docstring)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token), **LOOPBACK_RAY_ENV}

    def _read(self) -> RayHead | None:
        return read_model(self.record, RayHead)

    def running(self) -> RayHead | None:
        """The record of the head if it is still up."""
        head = self._read()
        if head is not None and alive(head.pid, head.pid_start):
            return head
        return None

    def current_address(self) -> str | None:
        """The address of the head that is up now, without starting one."""
        head = self.running()
        if head is None:
            return None
        with contextlib.suppress(OSError):
            return (Path(head.temp_dir) / "ray_current_cluster").read_text().strip() or None
        return None

    def address(self, timeout: float = START_TIMEOUT_S) -> str:
        """The head's address, starting the head first when none is up."""
        with self._starting:
            return self._address(timeout)

    def _address(self, timeout: float) -> str:
        head = self.running()
        if head is None:
            gone = self._read()
            if gone is not None and gone.temp_dir.startswith(tempfile.gettempdir()):
                shutil.rmtree(gone.temp_dir, ignore_errors=True)  # what a head that died left
            head = self._start()
        address_file = Path(head.temp_dir) / "ray_current_cluster"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if address_file.is_file() and address_file.read_text().strip():
                return address_file.read_text().strip()
            if not alive(head.pid, head.pid_start):
                raise RuntimeError(f"the local Ray head exited while starting; see {head.temp_dir}/head.log")
            time.sleep(0.5)
        raise RuntimeError(f"the local Ray head did not start in {timeout:.0f} s")

    def _start(self) -> RayHead:
        if not self.token.is_file():
            private_write(self.token, secrets.token_hex(32))
        temp_dir = tempfile.mkdtemp(prefix="fadrm-ray-")  # short: Ray's socket paths have a length limit
        log = private_append(Path(temp_dir) / "head.log")
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port=0",
                 "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--num-cpus={self.cpus}",
                 "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                 f"--object-store-memory={512 * 1024 * 1024}", "--block"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**clean_env(), **self.env()})
        finally:
            os.close(log)
        head = RayHead(pid=process.pid, pid_start=proc_start(process.pid), temp_dir=temp_dir)
        write_model(self.record, head)
        return head

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the head (its whole process group: SIGTERM, SIGKILL to what is left after
        `timeout` seconds) and remove its folder; False when none was up. No job runs on it when
        it is stopped, so nothing of value is lost to the SIGKILL."""
        head = self.running()
        if head is None:
            return False
        signal_group(head.pid, signal.SIGTERM)
        deadline = time.time() + timeout
        while time.time() < deadline and alive(head.pid, head.pid_start):
            time.sleep(0.2)
        signal_group(head.pid, signal.SIGKILL)
        shutil.rmtree(head.temp_dir, ignore_errors=True)
        self.record.unlink(missing_ok=True)
        return True


def clean_env() -> dict[str, str]:
    """This process's environment without the service's secret: drivers and Ray never see it."""
    return {k: v for k, v in os.environ.items() if k != "FADRM_API_TOKEN"}
