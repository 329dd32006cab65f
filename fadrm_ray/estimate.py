"""How long a distillation takes here: its units' steps, as they will run, timed on this machine.

A run's time is the time of its parts as the run cuts and places them (`runs.units.plan_units`,
`packing.pack_limit`): the patch scoring of its classes (a teacher forward of every crop of every
candidate, where the recipe scores them), then each unit's recover steps, one pack of IPC
groups per step at each stage's resolution, the units spread over the workers that run them at
once; on Ray, a worker's start first. Each step is timed here once per shape (`StepTimer`: the
recover loop itself, `recover.run_stage`, for a few steps of a pack of that many groups at that
resolution on that many torch threads, after a warm-up, the machine as it is now), so the
estimate is of the run this machine will run, not of a step of another size or of the teacher's
forward and backward alone: a CPU step of 50 images costs less per image than one of 10, each
group's view is cut on its own, one worker's thread is not the whole machine.

The `fadrm` command's pilot (pilot.py) sizes itself and states its cost with it, and `fadrm
distill` says the run's estimate before it starts and beside the time it took
(bench/estimates.py measures both against what they took).
"""
from __future__ import annotations

import heapq
import statistics
import time
from typing import Callable, NamedTuple, Sequence

import torch

from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.runtime import available_cpus, torch_threads

# Seconds until a Ray worker of this project answers (its process starts and imports torch):
# 6.5 to 14 s on the busy 2-core EPYC of docs/benchmarks/estimates.md (the ledgers' worker_started).
RAY_WORKER_START = 10.0
# Crops (and candidate images) a probe of the patch scoring times: enough for a whole batch's cost.
_SCORING_PROBE = 128
# Recover steps a probe times, after a warm-up of two.
_STEPS = 5


def timed(fn: Callable[[], None], device: str | torch.device = "cpu", repeats: int = 5) -> float:
    """The median of `repeats` calls after a warm-up: what a step costs on this machine as it is
    now, other work on it included (the fastest call would promise what a busy machine does not
    give; a pilot measured 805 s against an estimate of 517 s so). On CUDA each call is waited
    for."""
    cuda = torch.device(device).type == "cuda"

    def call():
        fn()
        if cuda:
            torch.cuda.synchronize(device)

    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class RunShape(NamedTuple):
    """How a run's units are run: `workers` processes at once, of `threads` torch threads each,
    Ray actors (which start first) or this process."""

    workers: int
    threads: int
    ray: bool

    @classmethod
    def here(cls, threads: int | None = None) -> "RunShape":
        """This process alone (`--local`, a pilot's sets)."""
        return cls(1, int(threads or torch.get_num_threads()), False)

    @classmethod
    def of_spec(cls, spec, device_type: str = "cpu") -> "RunShape":
        """The shape an `ExecutionSpec` gives a run on this machine: `--local` this process; else
        `--workers` actors (default as the worker pool counts them on an embedded Ray: one per GPU,
        or one per `--cpus-per-worker` CPUs) of `--cpus-per-worker` threads. A cluster's
        (`--address`) are taken to be machines like this one."""
        if spec.local:
            return cls.here(spec.threads)
        threads = max(1, int(spec.cpus_per_worker))
        if spec.workers:
            return cls(int(spec.workers), threads, True)
        if device_type == "cuda":
            share = spec.gpus_per_worker or 1.0
            return cls(max(1, int(torch.cuda.device_count() // share)), threads, True)
        return cls(max(1, int(available_cpus() // spec.cpus_per_worker)), threads, True)


class StepTimer:
    """The seconds of the real steps of a run with `teachers` on `dataset` on `device`, each shape
    timed once (`timed`) and kept: a recover step (`recover_step`) and the patch scoring of one
    crop (`scoring_crop`)."""

    def __init__(self, teachers: Sequence[FrozenTeacher], dataset: ImageDataset, device: str | torch.device):
        self.teachers, self.dataset, self.device = list(teachers), dataset, torch.device(device)
        self.seconds: dict[tuple, float] = {}

    def recover_step(self, cfg: DistillConfig, classes: int, groups: int, resolution: int, threads: int) -> float:
        """One recover step of a pack of `groups` IPC groups of `classes` classes at `resolution`
        px on `threads` threads: the recover loop itself (`recover.run_stage`: each group's view
        cut, the teachers' loss, the update), timed over `_STEPS` steps after a warm-up."""
        from fadrm_ray.recover import init_state, run_stage

        key = ("recover", classes, groups, resolution, threads, cfg.precision, cfg.compile, cfg.channels_last,
               cfg.committee, cfg.bound, cfg.init)
        if key not in self.seconds:
            size, channels = self.dataset.image_size, self.dataset.channels
            patches = torch.randint(0, 256, (groups, classes, channels, size, size), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(0)) if cfg.init == "real" else None
            state = init_state(cfg, list(range(classes)), list(range(groups)), patches, size, channels,
                               self.dataset.mean, self.dataset.std)

            def stage(steps: int) -> float:  # `steps` steps of one last stage at `resolution`
                state.budgets, state.resolutions, state.stage = [steps], [resolution], 0
                state.x = torch.nn.functional.interpolate(state.x, size=(resolution, resolution), mode="bilinear")
                started = time.perf_counter()
                run_stage(state, self.teachers, cfg, self.device)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return time.perf_counter() - started

            with torch_threads(threads):
                stage(2)  # the warm-up: the first steps of a shape cost more
                self.seconds[key] = stage(_STEPS) / _STEPS
        return self.seconds[key]

    def scoring_crop(self, cfg: DistillConfig, threads: int) -> float:
        """The patch scoring of one crop: the teachers' forward (`patches.crop_scores`, timed on a
        batch of at most `_SCORING_PROBE` crops) and its share of its image's decoding."""
        from fadrm_ray.patches import score_batch_size, crop_scores

        key = ("scoring", threads, cfg.precision, cfg.channels_last)
        if key not in self.seconds:
            size = self.dataset.image_size
            batch = min(_SCORING_PROBE, score_batch_size(size, self.device))
            crops = torch.randint(0, 256, (batch, self.dataset.channels, size, size), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(0))
            with torch_threads(threads):
                self.seconds[key] = timed(lambda: crop_scores(crops, 0, self.dataset, self.teachers, self.device,
                                                              cfg.precision, cfg.channels_last, batch_size=batch),
                                          self.device, repeats=3) / batch
        if "decode" not in self.seconds:
            candidates = torch.arange(min(len(self.dataset.train), _SCORING_PROBE))
            self.seconds["decode"] = timed(lambda: self.dataset.train.load(candidates), repeats=3) / len(candidates) \
                if len(candidates) else 0.0
        return self.seconds[key] + self.seconds["decode"] / max(1, cfg.patch_crops)


def seconds_text(seconds: float) -> str:
    """An estimate in seconds as a line says it: whole seconds, a tenth below ten."""
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _makespan(jobs: Sequence[float], workers: int) -> float:
    """The time `workers` take to run `jobs` (seconds each), each next job to the first free one."""
    free = [0.0] * max(1, workers)
    for job in jobs:
        heapq.heapreplace(free, free[0] + job)
    return max(free)


def run_seconds(cfg: DistillConfig, dataset: ImageDataset, timer: StepTimer, shape: RunShape) -> float:
    """The seconds a run of the resolved `cfg` on `dataset` takes in `shape`, from nothing done
    (module docstring)."""
    from fadrm_ray.packing import pack_limit
    from fadrm_ray.patches import scored
    from fadrm_ray.runs.units import chunks, plan_units

    device_type = timer.device.type
    units = plan_units(cfg, dataset.num_classes, image_size=dataset.image_size, workers=shape.workers,
                       device_type=device_type)
    budgets = cfg.stage_budgets()
    resolutions = cfg.stage_resolutions or [dataset.image_size] * len(budgets)

    def unit_seconds(unit) -> float:
        limit = pack_limit(cfg, len(unit.classes), dataset.image_size, dataset.channels, timer.teachers, timer.device)
        packs = chunks(unit.ipc_indices, limit, cfg.pack == "auto")
        return sum(budget * timer.recover_step(cfg, len(unit.classes), len(pack), resolution, shape.threads)
                   for pack in packs for budget, resolution in zip(budgets, resolutions) if budget)

    scoring = 0.0
    if scored(cfg):
        classes = sorted({c for unit in units for c in unit.classes})
        per_class = [cfg.patch_crops * _candidates(dataset, c, cfg) * timer.scoring_crop(cfg, shape.threads)
                     for c in classes]
        scoring = _makespan(per_class, shape.workers)
    stages = _makespan(sorted((unit_seconds(u) for u in units), reverse=True), shape.workers) if cfg.iterations else 0.0
    return (RAY_WORKER_START if shape.ray else 0.0) + scoring + stages


def _candidates(dataset: ImageDataset, label: int, cfg: DistillConfig) -> int:
    count = int((dataset.train.labels == label).sum())
    return min(count, cfg.patch_candidates) if cfg.patch_candidates else count
