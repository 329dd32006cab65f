"""Measurements of the ImageNet rehearsal (`python -m bench.rehearsal.imagenet`), from /proc and inotify.

- `TreeSampler`: the memory of a process and all its descendants, sampled from /proc every 0.2 s: the
  peak of the tree's summed RSS (shared pages counted once per process), of its summed PSS (shared
  pages split), and the largest VmHWM of one process. With `become_subreaper`, daemonized
  descendants (`ray start`'s GCS and raylet) are re-parented to this process and stay in the tree.
- `ListingCounter`: walks of a folder tree, counted with inotify as opens of the watched folders.
- `Phase`: one measured step of the rehearsal: the commands it runs, each under a `TreeSampler`, its
  wall seconds, the listings it made, whether it wrote the listing cache, and the processes it left behind.
- `ledger_split`: a Ray run's recover stages and patch scoring from its ledger, as worker seconds and
  as wall seconds (the union of the workers' intervals).
"""
from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import threading
import time
from pathlib import Path

from fadrm_ray.events import PatchesScored, RunFinished, RunStarted, StageDone, WorkerStarted, read_ledger
from fadrm_ray.layout import RunLayout

SAMPLE_SECONDS = 0.2
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 2 ** 20


# --------------------------------------------------------------------------- memory
def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0]


def _memory(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, VmHWM) of a process in bytes; zeros when it is gone."""
    rss = hwm = pss = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    except OSError:
        return 0, 0, 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
                break
    except OSError:
        pss = rss
    return rss, pss, hwm


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux), so a daemonized grandchild
    (`ray start` leaves its GCS and raylet behind) is re-parented here and stays in the tree."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


class TreeSampler:
    """Samples the memory of a process and all its descendants every `interval` seconds until
    stopped: peak summed RSS and PSS of the tree, the largest VmHWM of one process, and how many
    processes were seen. A process once in the tree stays counted while it lives (re-parented or
    not), and processes re-parented to this one while the sampler runs join the tree."""

    def __init__(self, root_pid: int, interval: float = SAMPLE_SECONDS, adopt: bool = True, keep: set[int] = ()):
        self.root_pid, self.interval, self.adopt = root_pid, interval, adopt
        self.keep = set(keep) | {root_pid}  # our own children: never reaped here
        self.me = os.getpid()
        self.tracked: dict[int, int] = {}  # pid -> start time
        self.seen: set[tuple[int, int]] = set()
        self.peak_rss = self.peak_pss = self.peak_hwm = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> dict:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
        return self.result()

    def result(self) -> dict:
        return {"peak_rss_mb": round(self.peak_rss / MB, 1), "peak_pss_mb": round(self.peak_pss / MB, 1),
                "max_process_hwm_mb": round(self.peak_hwm / MB, 1), "processes": len(self.seen),
                "samples": self.samples}

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                self.sample()
                return

    def sample(self) -> None:
        table: dict[int, tuple[int, int, str]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _proc_stat(int(entry))
                if stat is not None:
                    table[int(entry)] = stat
        # Keep tracked processes that still live (same start time), add the root, adopted ones,
        # then every descendant of any of them.
        alive = {pid: start for pid, start in self.tracked.items() if pid in table and table[pid][1] == start}
        if self.root_pid in table:
            alive[self.root_pid] = table[self.root_pid][1]
        for pid, (ppid, start, state) in table.items():
            if self.adopt and ppid == self.me and pid not in self.keep:
                if state == "Z":
                    try:
                        os.waitpid(pid, os.WNOHANG)  # an adopted process that ended
                    except ChildProcessError:
                        pass
                    continue
                alive[pid] = start
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        stack = list(alive)
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in alive:
                    alive[child] = table[child][1]
                    stack.append(child)
        self.tracked = alive
        rss = pss = 0
        for pid, start in alive.items():
            if table.get(pid, ("", "", "Z"))[2] == "Z":
                continue
            r, p, h = _memory(pid)
            rss, pss = rss + r, pss + p
            self.peak_hwm = max(self.peak_hwm, h)
            self.seen.add((pid, start))
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.samples += 1


# --------------------------------------------------------------------------- listings
class ListingCounter:
    """Counts walks of a folder tree with inotify: the opens of the watched folders themselves
    (a walk opens each folder; reading an image or a `stat` does not open its folder)."""

    # Closes are watched too, only so that two walks in a row give open, close, open, close:
    # inotify merges identical events that follow each other unread.
    IN_OPEN, IN_CLOSE_NOWRITE, IN_ISDIR = 0x20, 0x10, 0x40000000

    def __init__(self, folders: list[Path]):
        self.fd = -1
        self.counts: dict[int, int] = {}
        try:
            self.libc = ctypes.CDLL(None, use_errno=True)
            self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            self.fd = -1
        self.watches = {}
        if self.fd >= 0:
            for folder in folders:
                wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), self.IN_OPEN | self.IN_CLOSE_NOWRITE)
                if wd >= 0:
                    self.watches[wd] = folder

    @property
    def available(self) -> bool:
        return bool(self.watches)

    def take(self) -> int | None:
        """Opens of the watched folders since the last call (the largest count of one folder),
        or None without inotify."""
        if not self.available:
            return None
        opens: dict[int, int] = {}
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            i = 0
            while i + 16 <= len(data):
                wd, mask, _, length = struct.unpack_from("iIII", data, i)
                name = data[i + 16:i + 16 + length].rstrip(b"\0")
                if mask & self.IN_OPEN and mask & self.IN_ISDIR and not name:  # the folder itself
                    opens[wd] = opens.get(wd, 0) + 1
                i += 16 + length
        return max(opens.values(), default=0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def cache_state(cache: Path) -> dict[str, int]:
    """The listing cache files and their modification times (ns)."""
    folder = cache / "listings"
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.json.gz")} if folder.is_dir() else {}


def orphans() -> list[int]:
    """Live processes re-parented to this one (descendants a command left behind when it ended)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[0] == me and stat[2] != "Z":
                found.append(int(entry))
    return found


# --------------------------------------------------------------------------- phases
class Phase:
    """One measured phase: wall seconds, memory of the process tree, listings, cache writes."""

    def __init__(self, name: str, cwd: Path, env: dict, counter: ListingCounter, cache: Path):
        self.name, self.cwd, self.env, self.counter, self.cache = name, cwd, env, counter, cache
        self.result: dict = {}

    def __enter__(self) -> "Phase":
        self.counter.take()
        self.cache_before = cache_state(self.cache)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.result["seconds"] = round(time.perf_counter() - self.started, 2)
        after = cache_state(self.cache)
        self.result["listings"] = self.counter.take()
        self.result["cache_written"] = after != self.cache_before
        self.result["cache_files"] = len(after)
        self.result["left_behind"] = len(orphans())

    def run(self, argv: list[str], timeout: float, log_name: str | None = None) -> subprocess.CompletedProcess:
        """Run a command in the phase, its memory sampled; its stdout returned, stderr to a log."""
        logfile = self.cwd / f"{log_name or self.name}.log"
        with open(logfile, "wb") as err:
            proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=err)
            with TreeSampler(proc.pid, keep={proc.pid}) as sampler:
                try:
                    out, _ = proc.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    raise RuntimeError(f"{' '.join(argv)} ran past {timeout:.0f} s (log: {logfile})") from None
            self.result.update(sampler.result())
        if proc.returncode != 0:
            tail = logfile.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{tail}")
        return subprocess.CompletedProcess(argv, proc.returncode, out.decode(), "")


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


# --------------------------------------------------------------------------- ledger
def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def ledger_split(run_dir: Path) -> dict:
    """Recover stages and patch scoring of a Ray run from its ledger: worker seconds (summed
    over workers) and wall seconds (the union of the intervals), and the run's own seconds."""
    events = list(read_ledger(RunLayout(run_dir).ledger))
    out: dict = {}
    for key, kind in (("recover", StageDone), ("patch_scoring", PatchesScored)):
        spans = [(e.t - e.seconds, e.t) for e in events if isinstance(e, kind)]
        out[f"{key}_worker_s"] = round(sum(b - a for a, b in spans), 2)
        out[f"{key}_wall_s"] = round(_union(spans), 2)
    finished = [e for e in events if isinstance(e, RunFinished)]
    started = [e for e in events if isinstance(e, RunStarted)]
    out["run_s"] = round(finished[-1].seconds, 2) if finished else None
    out["workers_started"] = sum(isinstance(e, WorkerStarted) for e in events)
    out["stages"] = sum(isinstance(e, StageDone) for e in events)
    if started:
        out["units"] = started[-1].units
    return out
