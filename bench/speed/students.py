"""Seconds per student epoch on each device, for the same student, teacher and images.

    python -m bench.speed.students [--devices cpu,cuda] [--student resnet18] [--size 224]
                                   [--images 100] [--classes 100] [--epochs 2] [--record FILE] [--json]

The student is trained by `fadrm_ray.evaluation.training.train_student`, exactly as `fadrm evaluate` trains
one (random-resized crops, flips, CutMix, the teacher's soft labels on each view, AdamW, batch
16): on CUDA in mixed precision and channels-last, with the teacher labelling on the same GPU;
on a CPU in fp32. The images are random (the cost of a step does not depend on them), the
teacher a random-weight torchvision ResNet-18 (likewise); the test split is 100 images, scored
after every epoch (its cost is in each epoch's time). The first epoch warms up (cuDNN's
choices, caches) and is left out: the figure is the mean of the others. Prints seconds per epoch on each device and, with both, the
ratio CPU / CUDA. `--record FILE` appends each device's figures to FILE (JSON lines,
bench/record.py) as soon as they are measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.speed.timing import sync


def epoch_seconds(device: str, student: str, size: int, images: int, classes: int, epochs: int,
                  threads: int | None = None) -> dict:
    import torchvision

    from fadrm_ray.data.base import ImageDataset, Split
    from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalParts, EvalSpec
    from fadrm_ray.evaluation.training import train_student
    from fadrm_ray.evaluation.relabel import SoftLabeler
    from fadrm_ray.config import EvalConfig

    gen = torch.Generator().manual_seed(0)
    train = torch.randint(0, 256, (images, 3, size, size), dtype=torch.uint8, generator=gen)
    test = torch.randint(0, 256, (100, 3, size, size), dtype=torch.uint8, generator=gen)
    labels = torch.arange(images) % classes
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    dataset = ImageDataset(name="random", class_names=[str(c) for c in range(classes)], image_size=size, channels=3,
                           mean=mean, std=std, train=Split.in_memory(train, labels),
                           test=Split.in_memory(test, torch.arange(100) % classes), hflip=True)
    torch.manual_seed(0)
    teacher = torchvision.models.resnet18(num_classes=classes)
    labeler = SoftLabeler([teacher], [mean], [std], [3], ids=["random-resnet18"], device=device)
    marks: list[float] = []
    job = EvalJob(config=EvalConfig(student=student, epochs=epochs, seeds=[0], eval_every=1))
    spec = EvalSpec(device=device, threads=threads, progress=False)

    def on_epoch(seed, epoch, total, top1):  # after each epoch's test
        sync(device)
        marks.append(time.perf_counter())

    started = time.perf_counter()
    score = train_student(train, 0, job, spec, EvalParts(dataset=dataset, labeler=labeler), EvalHooks(on_eval=on_epoch))
    total = time.perf_counter() - started
    laps = [b - a for a, b in zip(marks, marks[1:])]  # epochs 2..E; the first warmed up
    out = {"device": device, "student": student, "size": size, "images": images, "epochs": score.epochs,
           "steps": score.steps, "seconds_total": total, "seconds_per_epoch": sum(laps) / len(laps),
           "first_epoch_seconds": marks[0] - started}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.students", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--student", default="resnet18", help="a student model name (fadrm_ray.models)")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per device (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    parser.add_argument("--record", metavar="FILE", help="append each device's figures to FILE as measured")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first warms up)")
    from bench.record import Record

    rows, record = [], Record(args.record)
    for device in [d.strip() for d in args.devices.split(",") if d.strip()]:
        if device.startswith("cuda") and not torch.cuda.is_available():
            parser.error("--devices cuda: torch sees no CUDA device")
        rows.append(epoch_seconds(device, args.student, args.size, args.images, args.classes, args.epochs,
                                  args.threads))
        record("student_epoch", **rows[-1])
        print(f"  {device}: {rows[-1]['seconds_per_epoch']:.3f} s per epoch", file=sys.stderr, flush=True)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "runs": rows}
    by = {r["device"].split(":")[0]: r["seconds_per_epoch"] for r in rows}
    if "cpu" in by and "cuda" in by:
        out["cpu_over_cuda"] = by["cpu"] / by["cuda"]
    if args.json:
        print(json.dumps(out))
        return
    for r in rows:
        print(f"{r['device']:>6}: student {r['student']}, {r['images']} images at {r['size']} px, "
              f"{r['seconds_per_epoch']:.3f} s per epoch ({r['steps'] // r['epochs']} steps)")
    if "cpu_over_cuda" in out:
        print(f"a GPU epoch is {out['cpu_over_cuda']:.1f}x faster than a CPU epoch")


if __name__ == "__main__":
    main()
