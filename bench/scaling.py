"""Scaling of the Ray path: images per second with 1 and 2 workers, and the Ray overhead
against `--local` on the same work.

    python -m bench.scaling [--quick] [--iterations T] [--repeats N] [--json] [--out DIR]

Every run distills the same config into a fresh store (nothing is skipped) and starts from the
dataset spec, as `fadrm distill` does. The local run uses one torch thread, like one Ray worker
with one CPU, and the same allocator settings (`fadrm_ray.runtime`), so the difference between
them is the cost of the Ray layer: actor start, the run context's transfer, stage checkpoints
and scheduling. The embedded Ray is started once and its start-up time is reported separately.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fadrm_ray.config import make_config
from fadrm_ray.data import get_dataset
from fadrm_ray.distill import distill_local
from fadrm_ray.layout import RunLayout
from fadrm_ray.settings import SqueezeConfig
from fadrm_ray.squeeze import ensure_teacher


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute per path)")
    parser.add_argument("--dataset", default="mnist-sample")
    parser.add_argument("--ipc", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds of (local, Ray 1 worker), in alternating order (default 3; quick 2)")
    parser.add_argument("--out", default="bench-results/scaling")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import ray
    from actors.coordinator import Coordinator
    from fadrm_ray.runtime import ALLOCATOR_ENV

    args.repeats = args.repeats or (2 if args.quick else 3)
    ipc = args.ipc or (4 if args.quick else 10)
    iterations = args.iterations or (200 if args.quick else 500)
    out = Path(args.out)
    dataset = get_dataset(args.dataset)
    teacher, teacher_info, _ = ensure_teacher(dataset, SqueezeConfig(), out / "teacher", progress=False)
    teacher_acc = teacher_info.test_accuracy
    overrides = {"ipc": ipc, "iterations": iterations}
    images = ipc * dataset.num_classes
    work = Path(tempfile.mkdtemp(prefix="fadrm-scaling-"))

    def fresh(name: str) -> Path:
        path = work / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    torch.set_num_threads(1)
    started = time.perf_counter()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ALLOCATOR_ENV})
    ray_start = time.perf_counter() - started

    def run_local() -> float:
        t0 = time.perf_counter()
        distill_local(make_config("fadrm", overrides=overrides), get_dataset(args.dataset), [teacher],
                      fresh("local"), device="cpu", progress=False)
        return time.perf_counter() - t0

    def run_ray(workers: int) -> tuple[float, float]:
        """Wall seconds, and the seconds the workers spent inside recover stages (from the ledger)."""
        t0 = time.perf_counter()
        result = Coordinator(make_config("fadrm", overrides=overrides), args.dataset, [teacher],
                             fresh(f"ray{workers}"), workers=workers, cpus_per_worker=1, progress=False).run()
        wall = time.perf_counter() - t0
        ledger = [json.loads(line) for line in RunLayout(result.run_dir).ledger.read_text().splitlines()]
        return wall, sum(e["seconds"] for e in ledger if e["event"] == "stage_done")

    # Rounds of (local, Ray with 1 worker), in alternating order, so that a change of load on a
    # shared machine hits both sides; the overhead is the median of the per-round ratios.
    rounds = []
    try:
        for r in range(args.repeats):
            if r % 2 == 0:
                local, (ray1, inside) = run_local(), run_ray(1)
            else:
                (ray1, inside), local = run_ray(1), run_local()
            rounds.append({"local": local, "ray_1_worker": ray1, "ray_1_worker_in_stages": inside,
                           "overhead": ray1 / local - 1.0})
        ray2, _ = run_ray(2)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    local = statistics.median(r["local"] for r in rounds)
    ray1 = statistics.median(r["ray_1_worker"] for r in rounds)
    outside = statistics.median(r["ray_1_worker"] - r["ray_1_worker_in_stages"] for r in rounds)
    result = {
        "dataset": args.dataset, "ipc": ipc, "iterations": iterations, "images": images,
        "teacher_test_accuracy": teacher_acc, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
        "ray_start_seconds": ray_start, "rounds": rounds,
        "seconds": {"local_1_thread": local, "ray_1_worker": ray1, "ray_2_workers": ray2},
        "images_per_second": {"local_1_thread": images / local, "ray_1_worker": images / ray1,
                              "ray_2_workers": images / ray2},
        "ray_overhead": statistics.median(r["overhead"] for r in rounds),
        # Time of a 1-worker run spent outside recover stages: actor start, the run context,
        # scheduling, checkpoints and the final write. Machine noise barely touches it.
        "ray_seconds_outside_stages": outside,
        "speedup_2_workers": ray1 / ray2,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        ips = result["images_per_second"]
        print(f"{args.dataset}, IPC {ipc}, T={iterations}: {images} images per run, {args.repeats} rounds "
              f"(Ray start {ray_start:.1f} s, not counted)")
        print("| path | seconds (median) | images/s |\n|---|---|---|")
        print(f"| --local, 1 thread | {local:.1f} | {ips['local_1_thread']:.2f} |")
        print(f"| Ray, 1 worker | {ray1:.1f} | {ips['ray_1_worker']:.2f} |")
        print(f"| Ray, 2 workers | {ray2:.1f} | {ips['ray_2_workers']:.2f} |")
        print("per-round overhead: " + ", ".join(f"{100 * r['overhead']:+.1f}%" for r in rounds))
        print(f"Ray overhead vs --local: {100 * result['ray_overhead']:+.1f}% (median of rounds); "
              f"time outside recover stages: {outside:.1f} s ({100 * outside / ray1:.1f}% of the run); "
              f"2 workers vs 1: {result['speedup_2_workers']:.2f}x")
    return result


if __name__ == "__main__":
    main()
