"""DistillWorker: a Ray actor that owns frozen teachers and runs recover one stage at a time.

The actor is a plain class; `actors.coordinator` wraps it with `ray.remote` and the resource
options of the run. It loads the dataset and its teachers once, then runs stages of units:
stage 0 selects the unit's patches and builds its recover states, every stage ends with a
checkpoint of the unit's states on the store (so a lost worker costs at most one stage), and
the last stage writes the unit's part files itself; only small manifests travel back.
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
from fadrm_ray.data import get_dataset
from fadrm_ray.distill import Unit, run_unit_stage, unit_records, unit_states, unit_stats
from fadrm_ray.models import check_teacher_fits, load_teacher
from fadrm_ray.recover import FrozenTeacher, RecoverState
from fadrm_ray.fileio import atomic_write_bytes
from fadrm_ray.store import RunStore


def checkpoint_path(store: RunStore, unit_id: str, stage: int) -> Path:
    """The states of a unit after `stage` stages have run."""
    return store.run_dir / "checkpoints" / f"{unit_id}.after{stage}.pt"


def save_checkpoint(store: RunStore, unit_id: str, states: list[RecoverState]) -> Path:
    import io
    buf = io.BytesIO()
    torch.save({"unit_id": unit_id, "stage": states[0].stage, "states": [s.to_dict() for s in states]}, buf)
    path = atomic_write_bytes(checkpoint_path(store, unit_id, states[0].stage), buf.getvalue())
    for old in path.parent.glob(f"{unit_id}.after*.pt"):  # keep only the newest
        if old != path:
            old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> list[RecoverState]:
    data = torch.load(path, map_location="cpu", weights_only=True)
    return [RecoverState.from_dict(d) for d in data["states"]]


def latest_checkpoints(store: RunStore) -> dict[str, int]:
    """unit_id -> number of stages its newest checkpoint has completed."""
    out: dict[str, int] = {}
    folder = store.run_dir / "checkpoints"
    for path in folder.glob("*.after*.pt") if folder.is_dir() else []:
        unit_id, _, rest = path.name.rpartition(".after")
        try:
            out[unit_id] = max(out.get(unit_id, 0), int(rest.removesuffix(".pt")))
        except ValueError:
            continue
    return out


class DistillWorker:
    def __init__(self, cfg: dict, dataset_spec: str, data_root: str | None, store_root: str, run_id: str,
                 prov: dict, device: str = "cpu", num_threads: int = 1):
        self.num_threads = max(1, int(num_threads))
        torch.set_num_threads(self.num_threads)
        self.cfg = DistillConfig.from_dict(cfg)
        self.dataset = get_dataset(dataset_spec, root=data_root)
        self.device = device
        self.store = RunStore(store_root, run_id)
        self.provenance = prov
        self.teachers: list[FrozenTeacher] = []
        self.teacher_key: tuple = ()
        self.patch_cache: dict = {}
        self.live: dict[str, list[RecoverState]] = {}  # states of units this worker is carrying

    def _load_teachers(self, teacher_refs: list) -> None:
        """Load the teachers once per actor life. The weights come through the object store (no
        shared disk needed); the references ride along with every call rather than with the
        constructor, so a restarted actor simply loads them again on its first call."""
        key = tuple(ref.hex() for ref in teacher_refs)
        if key == self.teacher_key:
            return
        folder = Path(tempfile.mkdtemp(prefix="fadrm-teachers-"))
        self.teachers = []
        for blob in ray.get(list(teacher_refs)):
            path = folder / f"{hashlib.sha256(blob).hexdigest()[:16]}.pt"
            path.write_bytes(blob)
            model, info = load_teacher(path, device=self.device)
            check_teacher_fits(info, self.dataset)
            self.teachers.append(FrozenTeacher(model, in_chans=info.in_chans, first_bn_weight=self.cfg.first_bn_weight))
        self.teacher_key = key

    def ping(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "device": self.device, "threads": self.num_threads}

    def run_stage(self, unit: Unit, stage: int, teacher_refs: list) -> dict:
        """Run stage `stage` of `unit` (from the checkpoint of stage - 1 unless this worker holds it)."""
        torch.set_num_threads(self.num_threads)  # a reused worker process may have another count
        self._load_teachers(teacher_refs)
        started = time.perf_counter()
        states = self.live.pop(unit.unit_id, None)
        if states is None or states[0].stage != stage:
            if stage == 0:
                states = unit_states(unit, self.cfg, self.dataset, self.teachers, self.device, self.patch_cache)
            else:
                states = load_checkpoint(checkpoint_path(self.store, unit.unit_id, stage))
        run_unit_stage(states, self.teachers, self.cfg, self.device)
        seconds = time.perf_counter() - started
        reply = {"unit_id": unit.unit_id, "stage": stage, "pid": os.getpid(), "seconds": seconds}
        if states[0].done:
            records, packs = unit_records(unit, states, self.teachers, self.device)
            stats = unit_stats(unit, packs, self.device, seconds, worker_pid=os.getpid())
            manifest = self.store.write_unit(unit.unit_id, records, self.dataset.class_names, self.provenance, stats)
            for old in (self.store.run_dir / "checkpoints").glob(f"{unit.unit_id}.after*.pt"):
                old.unlink(missing_ok=True)
            reply.update(done=True, rows=sum(f["rows"] for f in manifest["files"]))
        else:
            save_checkpoint(self.store, unit.unit_id, states)
            self.live[unit.unit_id] = states
            reply.update(done=False)
        return reply
