"""The `--imagenet` mode of bench/recover_speed.py: the engine alone at the ImageNet-1K setting,
timed against pack size and precision (bench/gpu_check.sh runs it on a GPU).
"""
from __future__ import annotations

import time

import torch
from pydantic import BaseModel, ConfigDict

from bench.speed_worker import peak_rss_mb, sync


class ImagenetTiming(BaseModel):
    """What `imagenet_timing` times: on which device, which pack sizes and precisions, how many
    iterations, with channels-last and torch.compile or not, the CPU-sized stand-in (`tiny`), and
    a teacher checkpoint instead of the random ResNet-18."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str
    packs: list[int]
    iterations: int = 200
    precisions: list[str]
    channels_last: bool = True
    compile: bool = False
    tiny: bool = False
    teacher: str | None = None


def imagenet_timing(setup: ImagenetTiming, log=print) -> dict:
    """Seconds per image of the engine at the ImageNet-1K setting of docs/method.md section 4.

    ResNet-18 (torchvision, random init: the cost of a step does not depend on the weights),
    224 px, MRO stages 200/224/200/224, k = 3, alpha 0.5, jitter 32, 100 classes per batch (one
    image per class) and `pack` batches per forward/backward. The published T = 2000 is timed
    on `iterations` (split over the same four stages) after a warm-up of two steps per stage,
    and extrapolated linearly: time / iterations * 2000 / images. `setup.tiny` is a CPU-sized
    stand-in (32 px, stages 28/32/28/32, 10 classes) to test this code without a GPU.
    `setup.teacher`: a teacher checkpoint (e.g. made by `fadrm import-teacher` from torchvision's
    ResNet-18 weights) used instead of the random ResNet-18, with its own normalization.
    """
    import torchvision

    device, packs, iterations, precisions = setup.device, setup.packs, setup.iterations, setup.precisions
    channels_last, compile, tiny, teacher = setup.channels_last, setup.compile, setup.tiny, setup.teacher

    from fadrm_ray.config import make_config
    from fadrm_ray.frozen_teacher import FrozenTeacher
    from fadrm_ray.recover import init_state, recover

    size, low, classes, num_classes, T = (32, 28, 10, 10, 2000) if tiny else (224, 200, 100, 1000, 2000)
    described = "torchvision resnet18 (random init)"
    if teacher is None:
        model = torchvision.models.resnet18(weights=None, num_classes=num_classes).to(device)
        mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    else:
        from fadrm_ray.models import load_teacher

        model, info = load_teacher(teacher, device=device)
        if info.in_chans != 3 or info.num_classes < classes:
            raise SystemExit(f"teacher {teacher}: needs 3 input channels and at least {classes} classes, has "
                             f"{info.in_chans} and {info.num_classes}")
        num_classes, mean, std = info.num_classes, list(info.mean), list(info.std)
        described = f"{info.model_name} from {teacher} (test top-1 {info.test_accuracy:.2f}%)"
    teacher = FrozenTeacher(model)
    runs = []
    for precision in precisions:
        for pack in packs:
            overrides = {"ipc": pack, "pack": pack, "iterations": iterations, "precision": precision,
                         "channels_last": channels_last, "compile": compile, "downsample_size": low,
                         "classes": list(range(classes))}
            cfg = make_config("fadrm", overrides=overrides).resolve(size, num_classes, True, torch.device(device).type,
                                                                 channels=3)
            gen = torch.Generator().manual_seed(pack)
            patches = torch.randint(0, 256, (pack, classes, 3, size, size), dtype=torch.uint8, generator=gen)

            def once(c):
                state = init_state(c, list(range(classes)), list(range(pack)), patches, size, 3, mean, std)
                sync(device)
                started = time.perf_counter()
                recover(state, [teacher], c, device)
                sync(device)
                return time.perf_counter() - started, state

            warm_cfg = make_config("fadrm", overrides=dict(overrides, iterations=2 * (cfg.k + 1))).resolve(
                size, num_classes, True, torch.device(device).type, channels=3)
            warm_seconds, _ = once(warm_cfg)
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            seconds, state = once(cfg)
            images = pack * classes
            finite = bool(torch.isfinite(state.x).all())
            last = state.history[-1]
            run = {"precision": cfg.precision, "pack": pack, "images_per_step": images, "iterations": iterations,
                   "resolutions": cfg.stage_resolutions, "seconds": seconds, "warmup_seconds": warm_seconds,
                   "ms_per_step": 1000.0 * seconds / iterations,
                   "ms_per_image_update": 1000.0 * seconds / (iterations * images),
                   "seconds_per_image_at_T2000": seconds / iterations * T / images,
                   "images_per_hour": 3600.0 / (seconds / iterations * T / images),
                   "final_ce": last["ce"][-1] if last["ce"] else None, "final_bn": last["bn"][-1] if last["bn"] else None,
                   "finite": finite, "channels_last": channels_last, "compile": compile}
            if device.startswith("cuda"):
                run["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            else:
                run["rss_peak_mb"] = peak_rss_mb()
            runs.append(run)
            log(f"  {cfg.precision:>5} pack {pack}: {run['ms_per_step']:.1f} ms/step ({images} images), "
                f"{run['seconds_per_image_at_T2000']:.3f} s/image at T=2000"
                + (f", peak {run['gpu_peak_gb']:.2f} GB" if "gpu_peak_gb" in run else "")
                + ("" if finite else "  NOT FINITE"))
    teacher.remove_hooks()
    info = {"device": device, "tiny": tiny, "model": described, "image_size": size,
            "classes_per_batch": classes, "T": T, "cudnn_benchmark": device.startswith("cuda"),
            "torch": torch.__version__, "runs": runs}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info
