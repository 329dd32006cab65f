"""The lifeline of the service's local Ray head: `python -m api.jobs.head_lifeline STATE_DIR HEAD_PID
HEAD_START`.

Started by `api.jobs.local_ray.LocalRay` beside each head it starts, in a session of its own (so a
signal to the service or to the head's group does not reach it), this process checks every
CHECK_S seconds who holds the head's lease (`RayLease`: the service, and the drivers of its
running jobs). Once no holder has been alive for GRACE_S seconds (time for a restarted service to
take the lease over), it stops the head (`stop_head`: SIGTERM to its group, SIGKILL after
STOP_S seconds, then what still names its folder, then the folder) and removes the head's record
if it still names that head. It ends when the head ends, however it ended. It imports nothing
heavy: a few tens of MiB, no torch, no Ray.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from api.jobs.job_files import read_model
from api.jobs.local_ray import LEASE, RayHead, RayLease, alive, stop_head

CHECK_S = 0.5
GRACE_S = 2.0
STOP_S = 2.0


def watch(state_dir: Path, pid: int, start: str | None) -> bool:
    """Watch the head `pid` (started at `start`) until it ends; True when this process stopped it."""
    record, lease_file = state_dir / "ray-head.json", state_dir / LEASE
    unheld_since = None
    while alive(pid, start):
        lease = read_model(lease_file, RayLease)
        if lease is not None and lease.held():
            unheld_since = None
        elif unheld_since is None:
            unheld_since = time.monotonic()
        elif time.monotonic() - unheld_since >= GRACE_S:
            head = read_model(record, RayHead)
            if head is None or head.pid != pid:  # the record names another head, or none: this one's folder
                head = RayHead(pid=pid, pid_start=start, temp_dir=_temp_dir(pid))
            stop_head(head, STOP_S)
            if (named := read_model(record, RayHead)) is not None and named.pid == pid:
                record.unlink(missing_ok=True)
            return True
        time.sleep(CHECK_S)
    return False


def _temp_dir(pid: int) -> str:
    """The temporary folder of head `pid`, from its command line (`--temp-dir=...`); '' if none."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    for arg in args:
        if arg.startswith(b"--temp-dir="):
            return arg.split(b"=", 1)[1].decode(errors="replace")
    return ""


def main(argv: list[str]) -> int:
    state_dir, pid, start = Path(argv[0]), int(argv[1]), argv[2] or None
    watch(state_dir, pid, start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
