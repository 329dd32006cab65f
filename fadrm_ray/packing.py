"""How a run's work is cut and packed: the `auto` values of `ipc_per_unit` and `pack`.

Neither changes an image (groups are independent, docs/method.md section 3, and the run id
leaves both out): they decide how busy the workers and the device are. Explicit integers in the
config always win.

- A *unit* is a class shard times a block of IPC indices, the work one worker carries from
  stage to stage. `block_size` cuts the IPC indices a request still needs into as many equal
  blocks as it takes for every worker to hold one (IPC 10 on 2 workers: two units of 5, not one
  of 10). On a CPU a block is also no larger than one step holds: a larger unit would not run
  faster, and a one-process run writes each unit as soon as it is done.
- A *pack* is the IPC groups of a unit that share one forward/backward. `pack_limit`: on a CPU,
  groups are added until a step holds CPU_STEP_PIXELS input pixels; past that, larger steps gain
  little and cost memory (`bench.speed.engine_vs_reference --table` gives the gain against pack size). On
  CUDA, one probe step of a single group measures the memory a group adds, and as many groups
  are packed as fit CUDA_MEMORY_FRACTION of what this process may use.
"""
from __future__ import annotations

from typing import Sequence

import torch

from fadrm_ray.config import DistillConfig

CPU_STEP_PIXELS = 1 << 18      # input pixels of one CPU step: 25 groups of 10 classes at 32 px
CUDA_MEMORY_FRACTION = 0.6     # of the memory free (and of this process's GPU share), for packed steps


def group_pixels(classes: int, cfg: DistillConfig, image_size: int) -> int:
    """Input pixels of one group (one image per class) at the largest stage resolution."""
    resolution = max(cfg.stage_resolutions or [image_size])
    return classes * resolution * resolution


def cpu_pack_limit(classes: int, cfg: DistillConfig, image_size: int) -> int:
    return max(1, CPU_STEP_PIXELS // group_pixels(classes, cfg, image_size))


def block_size(cfg: DistillConfig, missing: int, shards: int, workers: int, classes: int, image_size: int,
               device_type: str = "cpu") -> int:
    """IPC indices per unit when `missing` indices of each of `shards` shards are still to do."""
    if isinstance(cfg.ipc_per_unit, int):
        return cfg.ipc_per_unit
    blocks = max(1, -(-max(1, workers) // max(1, shards)))  # blocks per shard that give every worker one
    size = max(1, -(-missing // blocks))
    if device_type == "cpu":
        limit = cfg.pack if isinstance(cfg.pack, int) else cpu_pack_limit(classes, cfg, image_size)
        size = min(size, limit)
    return size


def split_evenly(items: Sequence, size: int) -> list[list]:
    """`items` cut into ceil(len / size) consecutive pieces whose lengths differ by at most one."""
    items = list(items)
    if not items:
        return []
    parts = -(-len(items) // max(1, size))
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def pack_limit(cfg: DistillConfig, classes: int, image_size: int, channels: int, teachers: Sequence,
               device: str | torch.device = "cpu", gpu_share: float = 1.0) -> int:
    """The most IPC groups one forward/backward may hold on `device` (`cfg.pack` when explicit)."""
    if isinstance(cfg.pack, int):
        return cfg.pack
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_pack_limit(classes, cfg, image_size)
    per_group = group_bytes(cfg, teachers, classes, channels, max(cfg.stage_resolutions or [image_size]), device)
    free, total = torch.cuda.mem_get_info(device)
    return cuda_pack_limit(per_group, free, total, gpu_share)


def cuda_pack_limit(per_group_bytes: int, free_bytes: int, total_bytes: int, gpu_share: float = 1.0) -> int:
    """Groups that fit the memory budget: a fraction of the free memory, and of this process's share
    of the device when several workers share it (fractional --gpus-per-worker)."""
    budget = CUDA_MEMORY_FRACTION * min(free_bytes, total_bytes * min(1.0, max(gpu_share, 0.0)))
    return max(1, int(budget // max(1, per_group_bytes)))


_MEASURED: dict[tuple, int] = {}


def group_bytes(cfg: DistillConfig, teachers: Sequence, classes: int, channels: int, resolution: int,
                device: torch.device) -> int:
    """Peak CUDA memory one group adds to a recover step, measured once per process and setting by a
    probe forward/backward of each teacher (the largest counts: FADRM+ runs one at a time)."""
    key = (tuple(id(t) for t in teachers), classes, channels, resolution, cfg.precision, cfg.channels_last, str(device))
    if key in _MEASURED:
        return _MEASURED[key]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    worst = 0
    for teacher in teachers:
        torch.cuda.reset_peak_memory_stats(device)
        probe_step(cfg, teacher, classes, channels, resolution, device)
        torch.cuda.synchronize(device)
        worst = max(worst, torch.cuda.max_memory_allocated(device) - base)
    _MEASURED[key] = max(1, int(worst))
    return _MEASURED[key]


def probe_step(cfg: DistillConfig, teacher, classes: int, channels: int, resolution: int,
               device: torch.device) -> torch.Tensor:
    """One recover step's forward/backward of one group of random images through `teacher`, with the
    step's own loss (`recover.step_loss`); returns the images' gradient. Runs on any device."""
    from fadrm_ray.recover import held_dtype, mixed_precision, step_loss, teacher_loss

    autocast, _ = mixed_precision(cfg.precision, device)
    labels = torch.zeros(classes, dtype=torch.long, device=device)
    x = torch.randn(classes, channels, resolution, resolution, device=device, requires_grad=True)
    with teacher.weights_in(held_dtype(cfg)):
        with autocast():
            ce, _, stat = step_loss(teacher_loss(teacher, cfg), x, labels, 1, cfg)
        (ce + stat).sum().backward()
    return x.grad


def fast_path(device: str | torch.device) -> dict:
    """The speed-only settings of the engine's fastest step on `device` (docs/benchmarks/speed.md,
    `bench.speed.side_by_side`): the teacher's loss compiled, and on CUDA replayed as CUDA graphs.
    Compiling costs seconds to a minute per stage resolution, once per process, so it pays on
    long runs; the defaults stay eager."""
    return {"compile": True, "cuda_graphs": torch.device(device).type == "cuda"}
