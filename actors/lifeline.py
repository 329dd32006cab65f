"""The embedded Ray's lifeline: a watchdog that ends the cluster with its driver, however it ends.

`ray.init(address="local")` starts the GCS, the raylet and the dashboard with the kernel's fate
sharing (PR_SET_PDEATHSIG), so they die with the driver. The raylet's own children do not: when
the raylet is killed, the dashboard agent and the runtime-env agent notice, then block for a
minute publishing that news to the GCS, which died too, while SIGTERM goes unanswered; workers
can linger the same way. An embedded cluster must not outlive its driver, so:

- before the embedded Ray starts, the driver starts this watchdog in a session of its own (the
  terminal's Ctrl-C does not reach it), connected by a pipe that only the driver holds;
- while Ray starts, the driver's environment carries a tag (`ENV`) that every process of the
  cluster inherits: GCS, raylet, agents, workers and anything they start;
- the watchdog looks at the cluster's processes every second (`_Cluster`), and when the pipe
  closes (the driver returned, raised, was killed or crashed) it SIGKILLs all of them, until
  none is left.

Processes are found through /proc, so this is Linux only; elsewhere the embedded Ray runs
without a lifeline. A cluster the driver only joins (`--address`) is never touched.

`interrupt_mark` is the other end of a driver's life: it makes sure Ctrl-C stops the run.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid

from fadrm_ray.runtime import proc_stat

ENV = "FADRM_RAY_LIFELINE"
_WATCH_S = 1.0


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time in clock ticks) of every process, from /proc."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = proc_stat(entry.name)
        if stat is not None and stat[0] != "Z":  # a zombie is dead already
            out[int(entry.name)] = (stat[1], stat[2])
    return out


def _carries(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


class _Cluster:
    """The processes of one embedded cluster, as far as they have been seen.

    The tag is found in the environment of the processes Ray starts from binaries (GCS,
    raylet); the agents and workers rename themselves with setproctitle, which overwrites their
    environment block, so they are found as descendants of tagged processes instead, and
    remembered (with their start time, so a reused pid is never mistaken for one of them),
    because once the raylet dies they are re-parented and no longer look related."""

    def __init__(self, tag: str):
        self.needle = f"{ENV}={tag}".encode()
        self.seen: dict[int, str] = {}

    def look(self) -> dict[int, str]:
        """Record and return the live processes of the cluster."""
        procs = processes()
        me = os.getpid()
        members = {pid for pid in procs if pid != me and _carries(pid, self.needle)}
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        stack = list(members) + [pid for pid, start in self.seen.items() if procs.get(pid, (0, None))[1] == start]
        while stack:
            pid = stack.pop()
            members.add(pid)
            stack.extend(c for c in children.get(pid, []) if c not in members and c != me)
        live = {pid: procs[pid][1] for pid in members if pid in procs}
        self.seen = {pid: start for pid, start in self.seen.items() if procs.get(pid, (0, None))[1] == start}
        self.seen.update(live)
        return live

    def end(self, attempts: int = 100, interval: float = 0.1) -> int:
        """SIGKILL the cluster's processes until none is left; returns how many were killed."""
        killed: set[int] = set()
        for _ in range(attempts):
            live = self.look()
            if not live:
                break
            for pid in live:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(interval)
        return len(killed)


class Lifeline:
    """The driver's side: start the watchdog, tag the cluster's environment, close at the end."""

    def __init__(self):
        self.tag = uuid.uuid4().hex
        self.process = subprocess.Popen([sys.executable, "-m", "actors.lifeline", self.tag], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    @staticmethod
    def supported() -> bool:
        return sys.platform.startswith("linux") and os.path.isdir("/proc")

    @contextlib.contextmanager
    def tagging(self):
        """Tag what starts inside the block; the driver's own later children stay untagged."""
        old = os.environ.get(ENV)
        os.environ[ENV] = self.tag
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = old

    def close(self, timeout: float = 30.0) -> None:
        """End the cluster's leftovers now (after `ray.shutdown`, normally none) and the watchdog."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)


@contextlib.contextmanager
def interrupt_mark():
    """Inside the block, Ctrl-C (SIGINT) raises KeyboardInterrupt as usual and also leaves a mark;
    yields a function that tells whether it came.

    A driver spends its time inside Ray's calls, and Ray looks for signals from its own native
    code; a KeyboardInterrupt raised in a callback that cannot pass it on is printed ("Exception
    ignored in ...") and dropped, and the run would go on to the end. A loop that checks the mark
    after every wait stops anyway. Outside the main thread, or where SIGINT is not the usual
    KeyboardInterrupt (ignored, say, in a background job), nothing is changed."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is not signal.default_int_handler:
        yield lambda: False
        return
    came = threading.Event()

    def handler(signum, frame):
        came.set()
        previous(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield came.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: list[str]) -> int:
    cluster = _Cluster(argv[0])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the end of the pipe ends the watch
    stdin = sys.stdin.buffer.raw
    while True:
        ready, _, _ = select.select([stdin], [], [], _WATCH_S)
        if ready and not os.read(stdin.fileno(), 65536):
            break  # end of file: the driver is gone, or done with the cluster
        cluster.look()
    cluster.end()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
