"""Speed of the path users run: the `fadrm distill` command as typed, against the old defaults,
across workers, and the time a run spends outside its recover stages.

    python -m bench.speed.scaling [--quick] [--datasets digits,mnist-sample] [--ipc 10] [--iterations T]
                                  [--sections defaults,workers,patches,omp] [--r18 [--teacher PATH]]
                                  [--json] [--out DIR]

Sections (each prints a table; all of them by default):

- defaults: `fadrm distill` with no speed flag (Ray, one worker per CPU, `pack`/`ipc_per_unit`
  auto) against the old defaults (`--set pack=1 --set ipc_per_unit=1`, OpenMP's own wait policy:
  FADRM_DEFAULT_OMP=1), the same two with `--local`, and `--local` with the hand-set flags that
  bench.speed.engine_vs_reference found fastest (every IPC batch in one unit and one step). Each
  is a fresh process on a fresh store, timed from start to exit, so images/s includes what a
  user waits for (Ray start, data, patch scoring, writes); "recover" is the time inside recover
  stages, from the run's unit manifests.
- workers: images/s with `--local` (1 thread), 1 and 2 Ray workers (1 CPU each) on an embedded
  Ray started once in this process (its start is not counted), so that the Ray overhead and the
  2-worker speed-up are those of the coordinator and workers alone.
- patches: 2 workers, the real patches scored once per class and shared (the default) against
  every worker scoring the classes it needs (WorkerPool(share_patches=False)): the time saved.
- omp: recover iterations/s of `fadrm distill --dataset digits --preset fadrm --ipc 2 --local`,
  idle and beside one busy single-threaded process, before (FADRM_DEFAULT_OMP=1: OpenMP's
  spinning threads) and after (the passive policy every heavy process now starts with).
- --r18: the 32-px ResNet-18 setting: `fadrm distill --local --threads 2` on an ImageFolder of
  mnist-sample resized to 32 px (4,000 training and 1,000 test PNGs, written once under DIR), a
  `resnet18-cifar` teacher (--teacher PATH, else trained by ensure_teacher: long on a CPU), IPC
  10, 200 iterations (quick: 40): the share of the run spent outside recover stages, and where.

Writes DIR/scaling.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fadrm_ray.layout import RunLayout
from fadrm_ray.store.run_files import RunManifest

ROOT = Path(__file__).resolve().parents[2]
OLD_DEFAULTS = ["--set", "pack=1", "--set", "ipc_per_unit=1"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def recover_time(run_dir) -> tuple[float, int]:
    """Seconds inside recover stages and optimizer steps, over every unit of a run."""
    from fadrm_ray.store import open_run

    seconds, steps = 0.0, 0
    for manifest in open_run(run_dir).unit_manifests().values():
        for pack in manifest.stats.packs:
            for stage in pack.stages:
                seconds += stage.seconds
                steps += stage.iterations
    return seconds, steps


def events(run_dir, name: str) -> list[dict]:
    """The ledger events `name` of a Ray run."""
    lines = RunLayout(run_dir).ledger.read_text().splitlines()
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == name]


def fadrm_distill(argv: list[str], store: Path, env: dict | None = None) -> dict:
    """Run `fadrm distill ARGV` in a fresh process on a fresh store: wall seconds, its JSON, and
    the recover seconds and steps of the run."""
    shutil.rmtree(store, ignore_errors=True)
    command = [sys.executable, "-m", "actors.cli", "distill", *argv, "--out", str(store), "--json", "--quiet"]
    started = time.perf_counter()
    proc = subprocess.run(command, env={**os.environ, **(env or {})}, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    inside, steps = recover_time(result["run_dir"])
    manifest = RunManifest.model_validate_json(RunLayout(result["run_dir"]).manifest.read_bytes())
    return {"wall": wall, "recover": inside, "steps": steps, "images": result["images"],
            "images_per_second": result["images"] / wall, "summary": manifest.summary.model_dump(mode="json"),
            "units": len(result["units_run"])}


def teacher_for(name: str, out: Path) -> str:
    from fadrm_ray.data import get_dataset
    from fadrm_ray.config import SqueezeConfig
    from fadrm_ray.squeeze import ensure_teacher

    return str(ensure_teacher(get_dataset(name), SqueezeConfig(), out / "teachers" / name, progress=False).path)


# --------------------------------------------------------------------------- sections
def section_defaults(datasets, ipc, iterations, out, work) -> dict:
    rows = {}
    for name in datasets:
        common = ["--dataset", name, "--teacher", teacher_for(name, out), "--ipc", str(ipc),
                  "--set", f"iterations={iterations}"]
        hand = ["--set", f"pack={ipc}", "--set", f"ipc_per_unit={ipc}"]
        runs = {"default": (common, {}), "old defaults": (common + OLD_DEFAULTS, {"FADRM_DEFAULT_OMP": "1"}),
                "--local": (common + ["--local"], {}),
                "--local, old defaults": (common + ["--local"] + OLD_DEFAULTS, {"FADRM_DEFAULT_OMP": "1"}),
                "--local, hand-set best (engine_vs_reference)": (common + ["--local"] + hand, {})}
        rows[name] = {}
        for label, (argv, env) in runs.items():
            rows[name][label] = fadrm_distill(argv, work / "defaults", env)
            log(f"  defaults {name} {label}: {rows[name][label]['images_per_second']:.2f} images/s")
        r = rows[name]
        r["ratios"] = {"default / old defaults": r["default"]["images_per_second"] / r["old defaults"]["images_per_second"],
                       "--local / old defaults": r["--local"]["images_per_second"]
                       / r["--local, old defaults"]["images_per_second"],
                       "--local / hand-set best": r["--local"]["images_per_second"]
                       / r["--local, hand-set best (engine_vs_reference)"]["images_per_second"]}
    return rows


def section_workers(name, ipc, iterations, out, work, patches: bool, workers: bool) -> dict:
    import ray
    import torch

    from actors import coordinator
    from actors.pool import WorkerPool
    from fadrm_ray.runs import execute
    from fadrm_ray.runs.job import ExecutionSpec, prepare_job
    from fadrm_ray.config import make_config
    from fadrm_ray.data import get_dataset

    teacher = teacher_for(name, out)
    overrides = {"ipc": ipc, "iterations": iterations}
    images = ipc * get_dataset(name).num_classes
    result: dict = {"dataset": name}
    started = time.perf_counter()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    result["ray_start_seconds"] = time.perf_counter() - started

    def on_ray(count: int, share: bool = True) -> dict:
        store = work / f"ray{count}"
        shutil.rmtree(store, ignore_errors=True)
        spec = ExecutionSpec(workers=count, cpus_per_worker=1, progress=False)
        t0 = time.perf_counter()
        job, parts = prepare_job(make_config("fadrm", overrides=overrides), get_dataset(name), name, [teacher], store,
                                 device_type=coordinator.device_type(spec))
        if share:
            run = coordinator.run(job, spec, parts)
        else:  # the pool's own switch, below the door: every worker scores the classes it needs
            run = execute.run_job(job, WorkerPool.for_job(job, spec, share_patches=False), parts)
        wall = time.perf_counter() - t0
        inside = sum(e["seconds"] for e in events(run.run_dir, "stage_done"))
        scoring = sum(e["seconds"] for e in events(run.run_dir, "patches_scored"))
        return {"wall": wall, "in_stages": inside, "scoring_tasks": scoring, "images_per_second": images / wall}

    try:
        if workers:
            torch.set_num_threads(1)
            store = work / "local"
            shutil.rmtree(store, ignore_errors=True)
            spec = ExecutionSpec(local=True, device="cpu", progress=False)
            t0 = time.perf_counter()
            job, parts = prepare_job(make_config("fadrm", overrides=overrides), get_dataset(name), name, [teacher],
                                     store, device_type=execute.device_type(spec))
            execute.run(job, spec, parts)
            local = time.perf_counter() - t0
            result["local_1_thread"] = {"wall": local, "images_per_second": images / local}
            result["ray_1_worker"], result["ray_2_workers"] = on_ray(1), on_ray(2)
            result["ray_overhead"] = result["ray_1_worker"]["wall"] / local - 1
            result["speedup_2_workers"] = result["ray_1_worker"]["wall"] / result["ray_2_workers"]["wall"]
            log(f"  workers {name}: 2 workers {result['speedup_2_workers']:.2f}x one")
        if patches:
            shared = result.get("ray_2_workers") or on_ray(2)
            each = on_ray(2, share=False)
            result["patches"] = {"shared": shared, "every_worker": each, "saved_seconds": each["wall"] - shared["wall"]}
            log(f"  patches {name}: shared scoring saves {result['patches']['saved_seconds']:.1f} s")
    finally:
        ray.shutdown()
    return result


def section_omp(iterations, out, work) -> dict:
    """Recover iterations/s idle and beside a busy process, before and after the passive policy."""
    common = ["--dataset", "digits", "--teacher", teacher_for("digits", out), "--preset", "fadrm", "--ipc", "2",
              "--local", "--set", f"iterations={iterations}"]
    rows = {}
    for load in ("idle", "beside a busy process"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load != "idle" else None
        try:
            for label, env in (("before", {"FADRM_DEFAULT_OMP": "1"}), ("after", {})):
                run = fadrm_distill(common, work / "omp", env)
                rows[f"{load}, {label}"] = {**run, "iterations_per_second": run["steps"] / run["recover"]}
                log(f"  omp {load} {label}: {rows[f'{load}, {label}']['iterations_per_second']:.1f} it/s")
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    return rows


def mnist32_folder(out: Path) -> Path:
    """mnist-sample resized to 32 px as an ImageFolder of PNGs (train/ and test/), written once."""
    import torch

    from fadrm_ray import codec
    from fadrm_ray.data import get_dataset

    folder = out / "mnist32-imagefolder"
    if (folder / "done").is_file():
        return folder
    dataset = get_dataset("mnist-sample", image_size=32)
    for split_name, split in (("train", dataset.train), ("test", dataset.test)):
        images = split.load(torch.arange(len(split)))
        for i, (image, label) in enumerate(zip(images, split.labels.tolist())):
            path = folder / split_name / dataset.class_names[label] / f"{i:05d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(codec.encode_png(image))
    (folder / "done").write_text("")
    return folder


def section_r18(iterations, out, work, teacher: str | None) -> dict:
    from fadrm_ray.data import get_dataset
    from fadrm_ray.config import SqueezeConfig
    from fadrm_ray.squeeze import ensure_teacher

    folder = mnist32_folder(out)
    if teacher is None:
        teacher = str(ensure_teacher(get_dataset("mnist-sample", image_size=32), SqueezeConfig(model="resnet18-cifar"),
                                     out / "teachers" / "mnist32-resnet18-cifar", progress=False).path)
    argv = ["--local", "--threads", "2", "--dataset", f"imagefolder:{folder}", "--teacher", teacher, "--ipc", "10",
            "--set", f"iterations={iterations}"]
    run = fadrm_distill(argv, work / "r18")
    outside = run["wall"] - run["recover"]
    result = {**run, "iterations": iterations, "outside_seconds": outside, "outside_share": outside / run["wall"],
              "patch_seconds": run["summary"].get("patch_seconds")}
    log(f"  r18: {run['wall']:.1f} s, recover {run['recover']:.1f} s, outside {100 * result['outside_share']:.1f}% "
        f"(patch scoring {result['patch_seconds']:.1f} s)")
    return result


# --------------------------------------------------------------------------- report
def report(result: dict) -> str:
    lines = [f"{result['cpus']} CPUs, load {result['load_before']} -> {result['load_after']}; "
             f"IPC {result['ipc']}, T = {result['iterations']}"]
    for name, rows in result.get("defaults", {}).items():
        lines += [f"\n{name}: `fadrm distill` as typed, fresh process and store each",
                  "| command | wall s | recover s | images/s |", "|---|---|---|---|"]
        lines += [f"| {label} | {r['wall']:.1f} | {r['recover']:.1f} | {r['images_per_second']:.2f} |"
                  for label, r in rows.items() if label != "ratios"]
        lines.append("ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in rows["ratios"].items()))
    w = result.get("workers", {})
    if "ray_2_workers" in w:
        lines += [f"\n{w['dataset']}: embedded Ray started once ({w['ray_start_seconds']:.1f} s, not counted)",
                  "| path | wall s | images/s |", "|---|---|---|"]
        lines += [f"| {k} | {w[k]['wall']:.1f} | {w[k]['images_per_second']:.2f} |"
                  for k in ("local_1_thread", "ray_1_worker", "ray_2_workers")]
        lines.append(f"Ray overhead vs --local: {100 * w['ray_overhead']:+.1f}%; 2 workers vs 1: "
                     f"{w['speedup_2_workers']:.2f}x")
    if "patches" in w:
        p = w["patches"]
        lines.append(f"{w['dataset']}, 2 workers: patches scored once and shared {p['shared']['wall']:.1f} s "
                     f"(scoring tasks {p['shared']['scoring_tasks']:.1f} s of worker time), every worker scoring "
                     f"its classes {p['every_worker']['wall']:.1f} s: {p['saved_seconds']:.1f} s saved")
    if "omp" in result:
        lines += ["\n`fadrm distill --dataset digits --preset fadrm --ipc 2 --local`: recover iterations/s",
                  "| load | before (OpenMP default) | after (passive) |", "|---|---|---|"]
        for load in ("idle", "beside a busy process"):
            lines.append(f"| {load} | {result['omp'][f'{load}, before']['iterations_per_second']:.1f} | "
                         f"{result['omp'][f'{load}, after']['iterations_per_second']:.1f} |")
    if "r18" in result:
        r = result["r18"]
        lines.append(f"\n32-px ResNet-18, `fadrm distill --local --threads 2`, IPC 10, T = {r['iterations']}: "
                     f"{r['wall']:.1f} s, recover stages {r['recover']:.1f} s, outside {r['outside_seconds']:.1f} s "
                     f"({100 * r['outside_share']:.1f}%; patch scoring {r['patch_seconds']:.1f} s)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs, to check the benchmark works")
    parser.add_argument("--datasets", default="digits,mnist-sample")
    parser.add_argument("--ipc", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=None, help="T of every run (default 500; quick 20)")
    parser.add_argument("--sections", default="defaults,workers,patches,omp")
    parser.add_argument("--r18", action="store_true", help="also: the 32-px ResNet-18 setting")
    parser.add_argument("--teacher", default=None, help="with --r18: a resnet18-cifar teacher of mnist-sample at 32 px")
    parser.add_argument("--out", default="bench-results/scaling")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    iterations = args.iterations or (20 if args.quick else 500)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fadrm-scaling-"))
    result: dict = {"cpus": os.cpu_count(), "ipc": args.ipc, "iterations": iterations,
                    "load_before": "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())}
    try:
        if "defaults" in sections:
            result["defaults"] = section_defaults(datasets, args.ipc, iterations, out, work)
        if sections & {"workers", "patches"}:
            result["workers"] = section_workers("mnist-sample", args.ipc, iterations, out, work,
                                                patches="patches" in sections, workers="workers" in sections)
        if "omp" in sections:
            result["omp"] = section_omp(40 if args.quick else 200, out, work)
        if args.r18:
            result["r18"] = section_r18(40 if args.quick else 200, out, work, args.teacher)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_after"] = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    (out / "scaling.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, default=str) if args.json else report(result))
    return result


if __name__ == "__main__":
    main()
