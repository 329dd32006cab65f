"""The engine alone at the ImageNet-1K setting, timed against pack size and precision.

    python -m bench.speed.imagenet [--device cuda] [--packs 1,2,4] [--precision fp16,bf16]
                                   [--iterations 200] [--no-channels-last] [--compile] [--tiny]
                                   [--teacher PATH] [--json-out FILE] [--json]

The loop is bench.speed.side_by_side's `ours` (`contender.OurLoop`: the released ImageNet-1K
recover script's setting, docs/method.md section 4): a ResNet-18 (torchvision, random init: the
cost of a step does not depend on the weights), 224 px, MRO stages 200/224/200/224, k = 3, alpha
0.5, jitter 32, 100 classes per batch (one image per class) and `pack` batches per
forward/backward, here in this process, one setting after another. The published T = 2000 is
timed on `--iterations` (split over the same four stages) after a warm-up of two steps per stage,
`init_state` outside the timed window, and extrapolated linearly: time / iterations * 2000 /
images. `--tiny` is the side-by-side's CPU size (32 px, stages 29/32/29/32, 10 classes), to test
this code without a GPU; `--teacher` a teacher checkpoint (e.g. made by `fadrm import-teacher`
from torchvision's ResNet-18 weights) instead of the random ResNet-18, with its own normalization.
bench/gpu_check.sh's checks run it for the precision paths.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from bench.speed.contender import ContenderSetup, OurLoop, inputs, run_once

T = 2000  # the published iteration budget the seconds per image are quoted at


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
    """Seconds per image of the engine at the ImageNet-1K setting (module docstring), per precision
    and pack."""
    device = setup.device
    size, classes = (32, 10) if setup.tiny else (224, 100)
    runs, described = [], None
    with tempfile.TemporaryDirectory(prefix="fadrm-imagenet-timing-") as tmp:
        shared = {"device": device, "size": size, "batch": classes, "steps": setup.iterations,
                  "jitter": 32 if size >= 128 else 4, "teacher": setup.teacher, **inputs(Path(tmp), size, classes)}
        for precision in setup.precisions:
            for pack in setup.packs:
                loop = OurLoop(ContenderSetup(
                    contender=f"{precision} pack {pack}", overrides={
                        "pack": pack, "precision": precision, "channels_last": setup.channels_last,
                        "compile": setup.compile}, **shared), torch.device(device))
                described = loop.described
                runs.append(_timed(loop, setup, classes, log))
                loop.teacher.remove_hooks()
    info = {"device": device, "tiny": setup.tiny, "model": described, "image_size": size,
            "classes_per_batch": classes, "T": T, "cudnn_benchmark": device.startswith("cuda"),
            "torch": torch.__version__, "runs": runs}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _timed(loop: OurLoop, setup: ImagenetTiming, classes: int, log) -> dict:
    """One pack and precision: a warm-up of two steps per stage, then `setup.iterations` timed."""
    device, iterations = torch.device(setup.device), setup.iterations
    warm = run_once(loop, 2 * 4, device)
    timed = run_once(loop, iterations, device)
    cfg, seconds, images = loop.cfg, timed["seconds"], loop.pack * classes
    last = loop.state.history[-1]
    run = {"precision": cfg.precision, "pack": loop.pack, "images_per_step": images, "iterations": iterations,
           "resolutions": cfg.stage_resolutions, "seconds": seconds, "warmup_seconds": warm["seconds"],
           "ms_per_step": 1000.0 * seconds / iterations,
           "ms_per_image_update": 1000.0 * seconds / (iterations * images),
           "seconds_per_image_at_T2000": seconds / iterations * T / images,
           "images_per_hour": 3600.0 / (seconds / iterations * T / images),
           "final_ce": last["ce"][-1] if last["ce"] else None, "final_bn": last["bn"][-1] if last["bn"] else None,
           "finite": timed["finite"], "channels_last": cfg.channels_last, "compile": cfg.compile}
    if "peak_gb" in timed:
        run["gpu_peak_gb"] = timed["peak_gb"]
    else:
        run["rss_peak_mb"] = timed["peak_rss_mb"]
    log(f"  {cfg.precision:>5} pack {loop.pack}: {run['ms_per_step']:.1f} ms/step ({images} images), "
        f"{run['seconds_per_image_at_T2000']:.3f} s/image at T=2000"
        + (f", peak {run['gpu_peak_gb']:.2f} GB" if "gpu_peak_gb" in run else "")
        + ("" if run["finite"] else "  NOT FINITE"))
    return run


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.speed.imagenet", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--packs", default="1,2,4", help="pack sizes, comma-separated")
    p.add_argument("--precision", default="auto", help="precisions, comma-separated (auto: the config's own)")
    p.add_argument("--iterations", type=int, default=200, help="timed iterations per setting")
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--compile", action="store_true", help="the teacher's loss with torch.compile")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized stand-in, to test the code")
    p.add_argument("--teacher", default=None,
                   help="a teacher checkpoint (e.g. from `fadrm import-teacher`) instead of a random ResNet-18")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else print
    setup = ImagenetTiming(device=args.device, packs=[int(v) for v in args.packs.split(",")],
                           iterations=args.iterations, precisions=args.precision.split(","),
                           channels_last=not args.no_channels_last, compile=args.compile, tiny=args.tiny,
                           teacher=args.teacher)
    result = imagenet_timing(setup, log)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
