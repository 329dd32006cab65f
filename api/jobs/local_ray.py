"""The service's own local Ray head (`LocalRay`, its record `RayHead`), and the process checks
the driver supervisor (`api.jobs.drivers`) shares with it: a process is known by its pid and start
time, so a reused pid is never taken for it.

The head lives as long as the service that started it, or a service after it, needs it: its
lifeline (`api.jobs.head_lifeline`, a small process of its own started beside it) stops it, and
removes its folder, within seconds of finding that no process holds its lease (`RayLease`, written
by the service: the service itself, and the drivers of its running jobs). So a service stopped
with SIGKILL (a supervisor's short grace period, the OOM killer) takes its idle head with it,
while a service restarted with jobs running finds their head up and takes the lease over. A head
that died is replaced with what it left removed (`remove_head`): the rest of its process group,
the processes whose options still name its folder, and the folder with its session folders (again
if a late writer makes them anew, for a few minutes).

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

from api.jobs.job_files import read_model, write_model
from api.jobs.private_files import private_append, private_write

START_TIMEOUT_S = 180.0
LEASE = "ray-lease.json"
REPO = Path(__file__).resolve().parents[1]  # where `python -m api....` finds this package
TEMP_PREFIX = "fadrm-ray-"
GONE_WATCH_S = 300.0  # how long the folder of a head that died is removed again where it reappears
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
    group's leader) and that process's start time, its temporary folder, and its lifeline."""

    model_config = ConfigDict(extra="ignore")
    pid: int
    pid_start: str | None = None
    temp_dir: str
    lifeline_pid: int | None = None
    lifeline_start: str | None = None


class Holder(BaseModel):
    """A process that holds the head's lease: its pid and start time."""

    model_config = ConfigDict(frozen=True)
    pid: int
    start: str | None = None

    @classmethod
    def of(cls, pid: int) -> "Holder":
        return cls(pid=pid, start=proc_start(pid))

    def alive(self) -> bool:
        return alive(self.pid, self.start)


class RayLease(BaseModel):
    """Who needs the local head (`STATE/ray-lease.json`, written by the service, read by the
    head's lifeline): the service's process, and the drivers of its running jobs."""

    model_config = ConfigDict(extra="ignore")
    owner: Holder
    drivers: list[Holder] = []

    def held(self) -> bool:
        return self.owner.alive() or any(driver.alive() for driver in self.drivers)


class LocalRay:
    """The service's own Ray head: started once, reused across restarts of the service."""

    def __init__(self, state_dir: Path, cpus: int | None):
        self.record = state_dir / "ray-head.json"
        self.lease_file = state_dir / LEASE
        self.state_dir = state_dir
        self.token = state_dir / "ray-auth-token"
        self.cpus = cpus or os.cpu_count() or 1
        self._starting = threading.Lock()  # one start at a time: the watch and a job's start
        self._lease: RayLease | None = None  # as this process last wrote it
        self._gone: dict[str, float] = {}  # folders of heads that died -> until when to remove them again

    def claim(self, drivers: list[Holder] = ()) -> None:
        """Hold the head's lease: this process, and `drivers` (the running jobs' drivers), need
        it; written again only when that changes."""
        lease = RayLease(owner=Holder.of(os.getpid()), drivers=sorted(set(drivers), key=lambda d: d.pid))
        if lease != self._lease:
            write_model(self.lease_file, lease)
            self._lease = lease

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
            if gone is not None:  # what a head that died left: its processes, its folder
                remove_head(gone)
                self._gone[gone.temp_dir] = time.monotonic() + GONE_WATCH_S
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
        temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)  # short: Ray's socket paths have a length limit
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
        head = self._with_lifeline(head)
        return head

    def _with_lifeline(self, head: RayHead) -> RayHead:
        """`head` with a lifeline (api.jobs.head_lifeline) started for it, recorded."""
        lifeline = subprocess.Popen([sys.executable, "-m", "api.jobs.head_lifeline", str(self.state_dir), str(head.pid),
                                     head.pid_start or ""],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True, env={**clean_env(), "PYTHONPATH": os.pathsep.join(
                                        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
        head = head.model_copy(update={"lifeline_pid": lifeline.pid, "lifeline_start": proc_start(lifeline.pid)})
        write_model(self.record, head)
        return head

    def keep_lifeline(self) -> None:
        """A lifeline for the head that is up, where it has none (it died, or an earlier version
        started the head without one); and the folders of heads that died removed again, where a
        late writer made them anew."""
        now = time.monotonic()
        for folder, until in list(self._gone.items()):
            if now > until:
                del self._gone[folder]
            elif os.path.isdir(folder):
                remove_folder(folder)
        with self._starting:
            head = self.running()
            if head is not None and not alive(head.lifeline_pid, head.lifeline_start):
                self._with_lifeline(head)

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the head (`stop_head`) and remove its record; False when none was up. No job runs
        on it when it is stopped, so nothing of value is lost to the SIGKILL. Its lifeline ends
        with it."""
        head = self.running()
        if head is None:
            return False
        stop_head(head, timeout)
        self.record.unlink(missing_ok=True)
        return True


def stop_head(head: RayHead, timeout: float = 5.0) -> None:
    """Stop `head`: its whole process group SIGTERM, SIGKILL to what is left after `timeout`
    seconds (Ray's `ray start` and its GCS may not end on SIGTERM), then `remove_head`."""
    signal_group(head.pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and alive(head.pid, head.pid_start):
        time.sleep(0.2)
    if alive(head.pid, head.pid_start) or members(head.pid):
        signal_group(head.pid, signal.SIGKILL)
    remove_head(head)


def remove_head(head: RayHead) -> None:
    """What a head that is no longer up leaves, where its record names a folder this service makes
    (`head_folder`; nothing at all for any other, whatever a damaged record names): the rest of its
    process group (workers and agents that renamed themselves), any process of this user whose
    options name its folder (`--temp-dir=FOLDER`, `--log-dir=FOLDER/...`: a raylet or GCS that left
    the group), all SIGKILLed, then the folder, session folders and all."""
    if not head_folder(head.temp_dir):
        return
    if proc_start(head.pid) in (None, head.pid_start):  # not a reused pid: the group is the head's
        signal_group(head.pid, signal.SIGKILL)
    me = os.getpid()
    for pid in processes():
        if pid != me and _names_folder(pid, head.temp_dir):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    remove_folder(head.temp_dir)


def head_folder(folder: str) -> bool:
    """Whether `folder` is one this service makes for a head: `fadrm-ray-*` directly in the
    temporary folder."""
    path = Path(folder)
    return (bool(folder) and path.is_absolute() and path.parent == Path(tempfile.gettempdir())
            and path.name.startswith(TEMP_PREFIX) and len(path.name) > len(TEMP_PREFIX))


def _names_folder(pid: int, folder: str) -> bool:
    """Whether process `pid` is this user's and has an option whose value is `folder` or a path in
    it (`--temp-dir=FOLDER`), as Ray's processes are started; a viewer given a file in it as a
    plain argument (`less FOLDER/.../raylet.out`) is not."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    target = os.fsencode(folder)
    for arg in args:
        name, eq, value = arg.partition(b"=")
        if eq and name.startswith(b"-") and (value == target or value.startswith(target + b"/")):
            return True
    return False


def remove_folder(folder: str) -> None:
    """Remove a head's temporary folder: only one this service makes (`head_folder`), whatever a
    damaged record names."""
    if head_folder(folder):
        shutil.rmtree(folder, ignore_errors=True)


def processes() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    found = []
    for pid in processes():
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pgid and proc_start(pid) is not None:
                found.append(pid)
    return found


def clean_env() -> dict[str, str]:
    """This process's environment without the service's secret: drivers and Ray never see it."""
    return {k: v for k, v in os.environ.items() if k != "FADRM_API_TOKEN"}
