"""DistillWorker: a Ray actor that owns frozen teachers and runs recover one stage at a time.

The actor is a plain class; `actors.coordinator` wraps it with `ray.remote` and the resource
options of the run. Its constructor only sets up the process (threads, allocator), so actors can
start while the driver is still planning. Everything a run needs (resolved config, dataset,
teacher weights, store location, provenance) is one object in the object store, the *run
context*; its reference rides along with every call, and the worker unpacks it once, so a
restarted actor simply unpacks it again on its next call. Then it runs stages of units: stage 0
selects the unit's patches and builds its recover states, every stage ends with a checkpoint of
the unit's states on the store (so a lost worker costs at most one stage), and the last stage
writes the unit's part files itself; only small manifests travel back.
"""
from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import time
from pathlib import Path

import ray
import torch

from fadrm_ray.config import DistillConfig
from fadrm_ray.distill import Unit, load_teachers, run_unit_stage, unit_records, unit_states, unit_stats
from fadrm_ray.recover import RecoverState
from fadrm_ray.fileio import atomic_write_bytes
from fadrm_ray.runtime import tune_allocator
from fadrm_ray.store import RunStore


def save_checkpoint(store: RunStore, unit_id: str, states: list[RecoverState]) -> Path:
    import io
    buf = io.BytesIO()
    torch.save({"unit_id": unit_id, "stage": states[0].stage, "states": [s.to_dict() for s in states]}, buf)
    path = atomic_write_bytes(store.layout.checkpoint(unit_id, states[0].stage), buf.getvalue())
    for old in store.layout.checkpoints(unit_id):  # keep only the newest
        if old != path:
            old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> list[RecoverState]:
    data = torch.load(path, map_location="cpu", weights_only=True)
    return [RecoverState.from_dict(d) for d in data["states"]]


def latest_checkpoints(store: RunStore) -> dict[str, int]:
    """unit_id -> number of stages its newest checkpoint has completed."""
    out: dict[str, int] = {}
    for path in store.layout.checkpoints():
        parsed = store.layout.checkpoint_stage(path)
        if parsed is not None:
            unit_id, stage = parsed
            out[unit_id] = max(out.get(unit_id, 0), stage)
    return out


def run_context(cfg: DistillConfig, dataset, teacher_paths, store: RunStore, prov: dict) -> dict:
    """What every worker needs for one run, as one picklable object (put once, read by all)."""
    return {"cfg": cfg.to_dict(), "dataset": dataset, "store_root": str(store.root), "run_id": store.run_id,
            "provenance": prov, "teachers": [Path(p).read_bytes() for p in teacher_paths]}


class DistillWorker:
    def __init__(self, device: str = "cpu", num_threads: int = 1):
        tune_allocator()
        self.device = device
        self.num_threads = max(1, int(num_threads))
        torch.set_num_threads(self.num_threads)
        self.context_key: str | None = None
        self.live: dict[str, list[RecoverState]] = {}  # states of units this worker is carrying

    def _enter(self, context: list) -> None:
        """Unpack the run context once per actor life (`context` is [ObjectRef], kept unresolved)."""
        key = context[0].hex()
        if key == self.context_key:
            return
        ctx = ray.get(context[0])
        self.cfg = DistillConfig.from_dict(ctx["cfg"])
        self.dataset = ctx["dataset"]
        self.store = RunStore(ctx["store_root"], ctx["run_id"])
        self.provenance = ctx["provenance"]
        with tempfile.TemporaryDirectory(prefix="fadrm-teachers-") as folder:
            paths = []
            for blob in ctx["teachers"]:
                paths.append(Path(folder) / f"{hashlib.sha256(blob).hexdigest()[:16]}.pt")
                paths[-1].write_bytes(blob)
            self.teachers, _ = load_teachers(paths, self.dataset, self.cfg, self.device)
        self.patch_cache: dict = {}
        self.live = {}
        self.context_key = key

    def ping(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "device": self.device, "threads": self.num_threads}

    def run_stage(self, unit: Unit, stage: int, context: list) -> dict:
        """Run stage `stage` of `unit` (from the checkpoint of stage - 1 unless this worker holds it)."""
        torch.set_num_threads(self.num_threads)  # a reused worker process may have another count
        self._enter(context)
        started = time.perf_counter()
        states = self.live.pop(unit.unit_id, None)
        if states is None or states[0].stage != stage:
            if stage == 0:
                states = unit_states(unit, self.cfg, self.dataset, self.teachers, self.device, self.patch_cache)
            else:
                states = load_checkpoint(self.store.layout.checkpoint(unit.unit_id, stage))
        run_unit_stage(states, self.teachers, self.cfg, self.device)
        seconds = time.perf_counter() - started
        reply = {"unit_id": unit.unit_id, "stage": stage, "pid": os.getpid(), "seconds": seconds}
        if states[0].done:
            records, packs = unit_records(unit, states, self.teachers, self.device)
            stats = unit_stats(unit, packs, self.device, seconds, worker_pid=os.getpid())
            manifest = self.store.write_unit(unit.unit_id, records, self.dataset.class_names, self.provenance, stats)
            for old in self.store.layout.checkpoints(unit.unit_id):
                old.unlink(missing_ok=True)
            reply.update(done=True, rows=sum(f["rows"] for f in manifest["files"]))
        else:
            save_checkpoint(self.store, unit.unit_id, states)
            self.live[unit.unit_id] = states
            reply.update(done=False)
        return reply
