"""Peak host memory of one student process against the distilled set's size, at ImageNet-1K scale.

    python -m bench.student_memory [--ipc 1,10,50] [--classes 1000] [--size 224] [--steps 4]
                                   [--work DIR] [--json]

For each IPC, a synthetic run of `--classes` classes at `--size` px is written through the
store's writer (`RunStore.write_unit`, one unit per 20 classes, then `finalize`), once: it is
kept under DIR/store and reused. No recovery runs: the images are flat colour bands, cheap to
encode and decode (their content changes only the encoded size, and the reader holds one part
file at a time). Then one fresh process per IPC (`--student RUN`) does what a student of
`fadrm evaluate` does: opens the run, reads its images (`RunReader.read`), and trains a
ResNet-18 student (`training.train_student`, online soft labels, batch 16, on the CPU) with a
random ResNet-18 teacher of `--classes` outputs for `--steps` steps, then stops. It prints its
peak RSS (VmHWM) and its RSS after the imports.

Printed per IPC: the images, the uint8 set's bytes, the peak RSS, the peak less the set (what
does not grow with the set: the model, the teacher, torch and a constant), and whether the
largest IPC's peak is within 1.3x its set plus the smallest IPC's overhead. Students held the
set as fp32 before (4x the set besides the uint8 one: about 37.5 GB at IPC 50); with
`--student RUN` and the package of another checkout first on PYTHONPATH, the same process
measures that code (this file runs as a script: `python PATH/bench/student_memory.py
--student RUN`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

UNIT_CLASSES = 20


def synthetic_image(label: int, index: int, size: int):
    """A uint8 (3, size, size) image of flat colour bands, distinct per (label, index)."""
    import torch

    image = torch.empty(3, size, size, dtype=torch.uint8)
    bands = 4 + index % 5
    for c in range(3):
        for b in range(bands):
            image[c, b * size // bands:(b + 1) * size // bands] = (37 * label + 53 * index + 91 * c + 29 * b) % 256
    return image


def write_run(root: Path, ipc: int, classes: int, size: int, log=print) -> Path:
    """The synthetic run of `ipc` images per class under `root` (written once; kept)."""
    from fadrm_ray.config import make_config
    from fadrm_ray.store import ImageRecord, RunStore
    from fadrm_ray.store.run_files import RunProvenance

    store = RunStore(root, f"ipc{ipc}-c{classes}-s{size}")
    if store.is_complete():
        return store.run_dir
    started = time.perf_counter()
    config = make_config("fadrm", overrides={"ipc": ipc})
    names = [f"class{c:04d}" for c in range(classes)]
    provenance = RunProvenance(seed=0, code_version="bench.student_memory")
    with store.session(config):
        for first in range(0, classes, UNIT_CLASSES):
            unit = f"c{first:04d}"
            if store.unit_done(unit):
                continue
            records = [ImageRecord(label=c, ipc_index=i, image=synthetic_image(c, i, size))
                       for c in range(first, min(classes, first + UNIT_CLASSES)) for i in range(ipc)]
            store.write_unit(unit, records, names, provenance)
        store.finalize({"ipc": ipc})
    log(f"  wrote {store.run_dir} ({classes * ipc} images) in {time.perf_counter() - started:.0f} s")
    return store.run_dir


class StopAfter(Exception):
    """Raised by the counting labeler once the student has taken its steps."""


def this_checkouts_timing():
    """This checkout's bench/speed/timing.py, loaded by path: the package measured may be another
    checkout's (first on PYTHONPATH), whose bench/ need not have it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("this_checkouts_timing",
                                                  Path(__file__).resolve().parent / "speed" / "timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def student(run: Path, steps: int) -> dict:
    """One student process's peak RSS over `steps` steps of `train_student` on the run's images."""
    import torch
    import torchvision

    from fadrm_ray.config import EvalConfig
    from fadrm_ray.data.base import ImageDataset, Split
    from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
    from fadrm_ray.evaluation.relabel import SoftLabeler
    from fadrm_ray.evaluation.training import train_student
    from fadrm_ray.store import open_run

    timing = this_checkouts_timing()
    peak_rss_mb, status_mb = timing.peak_rss_mb, timing.status_mb
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    imported = status_mb("VmRSS")
    started = time.perf_counter()
    images, labels, _ = open_run(run).read()
    read_seconds = time.perf_counter() - started
    after_read = status_mb("VmRSS")
    n, size, classes = images.shape[0], images.shape[-1], int(labels.max()) + 1
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    test = torch.zeros(16, 3, size, size, dtype=torch.uint8)
    dataset = ImageDataset(name="synthetic", class_names=[str(c) for c in range(classes)], image_size=size, channels=3,
                           mean=mean, std=std, train=Split.in_memory(images[:1], labels[:1]),
                           test=Split.in_memory(test, torch.arange(16) % classes), hflip=True)
    torch.manual_seed(0)
    taken = []

    class Counting(SoftLabeler):
        def __call__(self, view01):
            if len(taken) == steps:
                raise StopAfter
            taken.append(1)
            return super().__call__(view01)

    teacher = torchvision.models.resnet18(num_classes=classes)
    labeler = Counting([teacher], [mean], [std], [3], ids=["random-resnet18"], device="cpu")
    job = EvalJob(config=EvalConfig(student="resnet18", epochs=1, seeds=[0]))
    started = time.perf_counter()
    try:
        train_student(images, 0, job, EvalSpec(device="cpu", progress=False), EvalParts(dataset=dataset, labeler=labeler))
    except StopAfter:
        pass
    return {"images": n, "size": size, "classes": classes, "set_mb": images.numel() / 2**20,
            "rss_after_imports_mb": imported, "rss_after_read_mb": after_read, "peak_rss_mb": peak_rss_mb(),
            "read_seconds": read_seconds, "steps": len(taken), "step_seconds": time.perf_counter() - started,
            "torch": torch.__version__}


def measure(run: Path, steps: int, env: dict | None = None) -> dict:
    """`student` in a fresh process (this file as a script, so `env`'s PYTHONPATH picks the package)."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--student", str(run), "--steps", str(steps)],
                          stdout=subprocess.PIPE, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.student_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ipc", default="1,10,50", help="IPCs, comma-separated")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=4, help="student steps per process")
    parser.add_argument("--work", default="bench-results/student-memory", help="where the synthetic runs are kept")
    parser.add_argument("--student", metavar="RUN", help=argparse.SUPPRESS)  # the measured process itself
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.student:
        print(json.dumps(student(Path(args.student), args.steps)))
        return
    from bench.decode import cpu_name

    ipcs = sorted(int(v) for v in args.ipc.split(",") if v.strip())
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parent.parent),
                                                                   os.environ.get("PYTHONPATH")) if p)}
    rows = []
    for ipc in ipcs:
        run = write_run(Path(args.work) / "store", ipc, args.classes, args.size, log)
        rows.append({"ipc": ipc, **measure(run, args.steps, env)})
        r = rows[-1]
        log(f"  IPC {ipc}: {r['images']} images, set {r['set_mb']:.0f} MB, peak RSS {r['peak_rss_mb']:.0f} MB")
    for r in rows:
        r["overhead_mb"] = r["peak_rss_mb"] - r["set_mb"]
    low, high = rows[0], rows[-1]
    bound = 1.3 * high["set_mb"] + low["overhead_mb"]
    out = {"cpu": cpu_name(), "rows": rows, "bound_mb": bound, "within": high["peak_rss_mb"] <= bound}
    if args.json:
        print(json.dumps(out))
        return
    print(f"one student process ({args.steps} steps of a ResNet-18 student, teacher ResNet-18, batch 16, CPU), "
          f"{args.classes} classes at {args.size} px, {cpu_name()}")
    print(f"{'IPC':>4} {'images':>7} {'uint8 set MB':>13} {'peak RSS MB':>12} {'peak - set MB':>14} {'read s':>7}")
    for r in rows:
        print(f"{r['ipc']:>4} {r['images']:>7} {r['set_mb']:>13.0f} {r['peak_rss_mb']:>12.0f} {r['overhead_mb']:>14.0f} "
              f"{r['read_seconds']:>7.1f}")
    print(f"IPC {high['ipc']}: peak {high['peak_rss_mb']:.0f} MB against 1.3 x set + IPC {low['ipc']}'s overhead = "
          f"{bound:.0f} MB: {'within' if out['within'] else 'OVER'}")


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script: this checkout's bench beside whichever package is first
        sys.path.append(str(Path(__file__).resolve().parent.parent))
    main()
