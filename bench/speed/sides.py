"""One side of bench.speed.engine_vs_reference in a process of its own.

    python -m bench.speed.sides SETUP.pt --device DEVICE --threads N

Each side (the reference loop, the engine) runs in its own long-lived worker process
(bench/speed/workers.py) because glibc reads the MALLOC_* allocator variables only when a
process starts: the reference gets glibc's defaults, the engine `fadrm_ray.runtime.ALLOCATOR_ENV`.
Each command is {"side", "iterations", "overrides", "save"}; the reply is the timing and memory of
one run (its peak is its own: bench/speed/timing.py). SETUP.pt is what
`bench.speed.engine_vs_reference.prepare` saved: the teacher's path, the resolved config, the
real patches, the classes and the IPC.
"""
from __future__ import annotations

import argparse
import os
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from bench.speed.reference_loop import reference_recover, to_uint8
from bench.speed.timing import peak_rss_mb, status_mb, timed
from bench.speed.workers import serve

# Shown in the worker's hello line, so a log says which allocator and OpenMP settings each side had.
ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")


class SideRun(BaseModel):
    """One command to a side's worker: run `side` for `iterations` (after its warm-up), the engine
    with `overrides` of the config; `save`: a file for the final images (uint8)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    side: Literal["reference", "engine"]
    iterations: int
    overrides: dict = {}
    save: str | None = None


class Sides:
    """Holds the teacher, patches and config of one dataset; runs either side on request."""

    def __init__(self, setup: dict, device: str, threads: int):
        from fadrm_ray.config import DistillConfig
        from fadrm_ray.models import load_teacher
        from fadrm_ray.frozen_teacher import FrozenTeacher

        torch.set_num_threads(threads)
        self.device = device
        self.setup = setup
        self.base_cfg = DistillConfig.from_dict(setup["cfg"])
        # Two copies of the weights, so that nothing the engine does to its teacher (hooks, memory
        # format) reaches the reference; the reference freezes its own, as the published loop does.
        self.ref_model, _ = load_teacher(setup["teacher"], device=device)
        self.ref_model.eval().requires_grad_(False)
        engine_model, info = load_teacher(setup["teacher"], device=device)
        self.teacher = FrozenTeacher(engine_model, in_chans=info.in_chans, first_bn_weight=self.base_cfg.first_bn_weight)

    def cfg(self, iterations: int, overrides: dict):
        from fadrm_ray.config import DistillConfig
        d = dict(self.setup["cfg"], **overrides)
        k = d["k"]
        d["iterations"] = iterations
        d["stage_iterations"] = [iterations // (k + 1) + (1 if s < iterations % (k + 1) else 0) for s in range(k + 1)]
        return DistillConfig.from_dict(d)

    def run(self, command: SideRun) -> dict:
        side, iterations, overrides, save = command.side, command.iterations, command.overrides, command.save
        cfg = self.cfg(iterations, overrides)
        warm_iterations = 2 * (cfg.k + 1)  # two steps per stage: kernels, caches, compiling every stage shape
        warm = timed(self._run(side, self.cfg(warm_iterations, overrides)), self.device)[0]
        rss_before = status_mb("VmRSS")
        seconds, finish, peak = timed(self._run(side, cfg), self.device)
        images = finish() if save is not None else None
        per_iteration = self.setup["ipc"] * len(self.setup["classes"])  # image-updates of one iteration of every batch
        out = {"side": side, "seconds": seconds, "iterations": iterations,
               "ms_per_image_update": 1000.0 * seconds / (iterations * per_iteration), "warmup_seconds": warm,
               "warmup_image_updates": warm_iterations * per_iteration,
               "rss_peak_mb": peak.get("peak_rss_mb", peak_rss_mb()), "rss_before_mb": rss_before, "precision": cfg.precision if side == "engine" else "fp32",
               "pack": self._pack(cfg) if side == "engine" else 1,
               "channels_last": cfg.channels_last if side == "engine" else False,
               "compile": cfg.compile if side == "engine" else False}
        if "peak_gb" in peak:
            out["gpu_peak_mb"] = peak["peak_gb"] * 1024
        if save is not None:
            torch.save(images, save)
        return out

    def _pack(self, cfg) -> int:
        """IPC batches per step: `pack`, or for auto what a default run packs on this device."""
        from fadrm_ray.packing import pack_limit

        s = self.setup
        return pack_limit(cfg, len(s["classes"]), s["image_size"], s["channels"], [self.teacher], self.device)

    def _run(self, side: str, cfg):
        """What one run of `side` does, every IPC batch (the engine's `init_state` inside: it is
        part of what a run does per pack), to be timed; it returns how to make its final images."""
        from fadrm_ray.recover import final_images, init_state, recover

        s = self.setup
        classes, patches, ipc = s["classes"], s["patches"], s["ipc"]
        labels = torch.tensor(classes)

        def reference():
            outs = [reference_recover(self.ref_model, patches[g], labels, cfg, s["mean"], s["std"], seed=1000 + g,
                                      device=self.device) for g in range(ipc)]
            return lambda: torch.cat([to_uint8(x, s["mean"], s["std"]) for x in outs])

        def engine():
            states = []
            pack = self._pack(cfg)
            for p in range(0, ipc, pack):
                idx = list(range(p, min(ipc, p + pack)))
                state = init_state(cfg, classes, idx, patches[idx], s["image_size"], s["channels"], s["mean"], s["std"])
                states.append(recover(state, [self.teacher], cfg, self.device))
            return lambda: torch.cat([final_images(st, [self.teacher], self.device)[0] for st in states])

        return reference if side == "reference" else engine


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.sides",
                                     description="a side of bench.speed.engine_vs_reference (started by it)")
    parser.add_argument("setup")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    sides = Sides(torch.load(args.setup, weights_only=False), args.device, args.threads)
    serve({"rss_mb": status_mb("VmRSS"), "env": {k: os.environ.get(k) for k in ENV_KEYS}},
          lambda command: sides.run(SideRun.model_validate(command)))


if __name__ == "__main__":
    main()
