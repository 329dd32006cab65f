"""One side of bench/recover_speed.py in a process of its own, and the parent's handle on it.

Each side (the reference loop, the engine) runs in its own long-lived process because glibc
reads the MALLOC_* allocator variables only when a process starts: the reference gets glibc's
defaults, the engine `fadrm_ray.runtime.ALLOCATOR_ENV`. The parent starts a `Side`, which runs

    python -m bench.speed_worker SETUP.pt --device DEVICE --threads N

and then sends one JSON command per line on stdin ({"side", "iterations", "overrides", "save"}
or {"quit": true}); the worker answers each with one JSON line on stdout: the timing and memory
of one run, or {"error": ...}. SETUP.pt is what `bench.recover_speed.prepare` saved: the
teacher's path, the resolved config, the real patches, the classes and the IPC.

The memory helpers read this process's own peak (VmHWM), so a run's peak is its own.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.speed_reference import reference_recover, to_uint8

# Shown in the worker's hello line, so a log says which allocator and OpenMP settings each side had.
ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")


def status_mb(key: str) -> float | None:
    """VmRSS (now) or VmHWM (peak) of this process from /proc, in MB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Restart the VmHWM high-water mark (Linux >= 4.0), so a run's peak is its own. getrusage's
    ru_maxrss cannot be used: it carries the parent's peak across fork + exec."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    peak = status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Worker:
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

    def run(self, side: str, iterations: int, overrides: dict, save: str | None) -> dict:
        cfg = self.cfg(iterations, overrides)
        warm_iterations = 2 * (cfg.k + 1)  # two steps per stage: kernels, caches, compiling every stage shape
        warm = self._run(side, self.cfg(warm_iterations, overrides), keep=False)[0]
        rss_before = status_mb("VmRSS")
        reset_peak_rss()
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        seconds, images = self._run(side, cfg, keep=save is not None)
        per_iteration = self.setup["ipc"] * len(self.setup["classes"])  # image-updates of one iteration of every batch
        out = {"side": side, "seconds": seconds, "iterations": iterations,
               "ms_per_image_update": 1000.0 * seconds / (iterations * per_iteration), "warmup_seconds": warm,
               "warmup_image_updates": warm_iterations * per_iteration,
               "rss_peak_mb": peak_rss_mb(), "rss_before_mb": rss_before, "precision": cfg.precision if side == "engine" else "fp32",
               "pack": self._pack(cfg) if side == "engine" else 1,
               "channels_last": cfg.channels_last if side == "engine" else False,
               "compile": cfg.compile if side == "engine" else False}
        if self.device.startswith("cuda"):
            out["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        if save is not None:
            torch.save(images, save)
        return out

    def _pack(self, cfg) -> int:
        """IPC batches per step: `pack`, or for auto what a default run packs on this device."""
        from fadrm_ray.packing import pack_limit

        s = self.setup
        return pack_limit(cfg, len(s["classes"]), s["image_size"], s["channels"], [self.teacher], self.device)

    def _run(self, side: str, cfg, keep: bool):
        from fadrm_ray.recover import final_images, init_state, recover

        s = self.setup
        classes, patches, ipc = s["classes"], s["patches"], s["ipc"]
        labels = torch.tensor(classes)
        outs = []
        sync(self.device)
        started = time.perf_counter()
        if side == "reference":
            for g in range(ipc):
                x = reference_recover(self.ref_model, patches[g], labels, cfg, s["mean"], s["std"], seed=1000 + g,
                                      device=self.device)
                outs.append(x)
            sync(self.device)
            seconds = time.perf_counter() - started
            images = torch.cat([to_uint8(x, s["mean"], s["std"]) for x in outs]) if keep else None
        else:
            states = []
            pack = self._pack(cfg)
            for p in range(0, ipc, pack):
                idx = list(range(p, min(ipc, p + pack)))
                state = init_state(cfg, classes, idx, patches[idx], s["image_size"], s["channels"], s["mean"], s["std"])
                states.append(recover(state, [self.teacher], cfg, self.device))
            sync(self.device)
            seconds = time.perf_counter() - started
            images = torch.cat([final_images(st, [self.teacher], self.device)[0] for st in states]) if keep else None
        return seconds, images


def worker_main(setup_path: str, device: str, threads: int) -> None:
    """Answer one JSON command per stdin line with one JSON line on stdout."""
    setup = torch.load(setup_path, weights_only=False)
    worker = _Worker(setup, device, threads)
    print(json.dumps({"ready": True, "pid": os.getpid(), "rss_mb": status_mb("VmRSS"),
                      "env": {k: os.environ.get(k) for k in ENV_KEYS}}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        try:
            reply = worker.run(cmd["side"], cmd["iterations"], cmd.get("overrides", {}), cmd.get("save"))
        except Exception as exc:  # report and go on: the parent decides
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


class Side:
    """A worker process for one side, with its own environment."""

    def __init__(self, name: str, setup_path: Path, device: str, threads: int, env: dict, log):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.speed_worker", str(setup_path), "--device", device,
             "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env,
            cwd=str(Path(__file__).resolve().parent.parent))
        self.hello = self._read()
        log(f"  worker {name}: pid {self.hello['pid']}, env {self.hello['env']}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def run(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"{self.name} worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="a worker of bench.recover_speed (started by its Side)")
    parser.add_argument("setup")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    worker_main(args.setup, args.device, args.threads)


if __name__ == "__main__":
    main()
