"""Recover speed: the engine's fastest path against a plain reference, side by side.

    python -m bench.speed.engine_vs_reference [--quick] [--json] [--device cpu|cuda] [--ladder]
                                              [--table] [--compile] [--evaluate]
                                              [--datasets mnist-sample,digits] [--out DIR]

Settings (--datasets): `mnist-sample` and `digits` are the small-image FADRM setting of
bench/accuracy.py, a convnet-bn teacher (width 64, depth 3); `mnist32-r18` is mnist-sample
resized to 32 px with a `resnet18-cifar` teacher, the paper's CIFAR teacher (--r18-teacher PATH
uses a trained one; otherwise `squeeze` trains it, which takes long on a CPU). Teachers are
trained by `squeeze` on the real data and cached in DIR/teachers. The `fadrm` preset is resolved
for the dataset (k = 3, alpha 0.5, lr 0.25, r_bn 0.01, no MRO below 128 px), IPC 10 = ten
batches of one image per class, real-patch init with the same patches for both sides.
"Seconds per image" is quoted at the setting's budget T (500 on mnist-sample, 1000 on digits,
as bench/accuracy.py; 200 on mnist32-r18); the timed runs use fewer iterations, over the same
four stages and ARC merges, because the cost of an iteration does not depend on T.

Two paths:
  (a) reference: `reference_recover` (bench/speed/reference_loop.py), the published recover loop's
      per-iteration work (docs/method.md sections 3-4): fp32, one batch of one image per class
      at a time, the teacher frozen (`requires_grad = False`, as the published script sets it),
      BN statistics in forward hooks as the published hook takes them, the default glibc allocator.
  (b) engine: `fadrm_ray.recover` with all IPC batches packed into one forward/backward, bf16
      autocast where the CPU has it (fp16 + GradScaler on CUDA), frozen teacher, channels-last,
      glibc allocator settings, and torch.compile with --compile.

Fairness: same teacher file, patches, config, thread count and OpenMP settings on both sides.
Each side runs in its own long-lived worker process (bench/speed/sides.py) and the runs
alternate (a, b, a, b, ...), so a change of load on this shared machine hits both; the speed-up
is the median of the per-round ratios. glibc reads MALLOC_* only when a process starts, which
is why the sides are separate processes: the reference worker gets the environment without any
MALLOC_* variable and with FADRM_DEFAULT_MALLOC=1 (so the library's `tune_allocator` leaves
glibc's defaults), the engine worker gets `ALLOCATOR_ENV` of fadrm_ray/runtime.py added. Both
get OMP_WAIT_POLICY=PASSIVE (--omp-wait default leaves OpenMP alone): with two OpenMP threads
spinning on a 2-core machine that other jobs share, a step can take many times longer at
random, which would swamp both measurements.

Reported per side: ms per image-update (one optimizer step of one image), seconds per generated
image at T, peak memory (the worker's peak RSS during the run, VmHWM; on GPU the peak of
torch.cuda.max_memory_allocated), and the speed-up (b)/(a) in images per second. Quality:
both sides' final images (the last timed round with --quick, else a run at the full T) are
measured by `image_losses` (bench/speed/reference_loop.py), the same code for both: the teacher's
CE and BN loss; with --evaluate, students are trained on both image sets by
fadrm_ray.evaluation.evaluate.evaluate_images.

--ladder takes the speed-up apart, one change at a time; --table gives the engine's seconds per
image against pack size (1, 2, 5, 10) and precision (fp32, bf16 on CPU; fp32, fp16 on CUDA).
--quick finishes in about two minutes once the teachers are cached (training them the first
time takes one to three minutes more). bench.speed.imagenet times the engine alone at the
ImageNet-1K setting, bench.speed.side_by_side against the published code itself.

This file is the parent: it prepares each dataset's setup, starts the two worker processes,
alternates their runs, and writes the report.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.speed.reference_loop import image_losses
from bench.speed.workers import Worker

TEACHER = ("convnet-bn", {"width": 64, "depth": 3})  # t1 of bench/accuracy.py
R18 = ("resnet18-cifar", {})
# setting -> (dataset, image size (None: native), teacher, budget T)
SETTINGS = {"mnist-sample": ("mnist-sample", None, TEACHER, 500),   # the FADRM budgets of bench/accuracy.py
            "digits": ("digits", None, TEACHER, 1000),
            "mnist32-r18": ("mnist-sample", 32, R18, 200)}
BUDGET_T = {name: setting[3] for name, setting in SETTINGS.items()}
TEACHER_EPOCHS = {"full": {"mnist-sample": 8, "digits": 15, "mnist32-r18": 15},
                  "quick": {"mnist-sample": 3, "digits": 10, "mnist32-r18": 1}}
IPC = 10
PACKS = (1, 2, 5, 10)


def allocator_env() -> dict:
    from fadrm_ray.runtime import ALLOCATOR_ENV

    return dict(ALLOCATOR_ENV)


def bench_teacher(dataset, out: Path, epochs: int, log, teacher=TEACHER) -> tuple[Path, float]:
    """The benchmark's teacher, trained once per epoch count into DIR/teachers/<dataset>-<model>-e<epochs>/."""
    from fadrm_ray.config import SqueezeConfig
    from fadrm_ray.squeeze import ensure_teacher

    model, kwargs = teacher
    started = time.perf_counter()
    folder = f"{dataset.name}{'' if dataset.info.get('native_size') == dataset.image_size else dataset.image_size}"
    teacher = ensure_teacher(dataset, SqueezeConfig(model=model, model_kwargs=dict(kwargs), epochs=epochs, seed=0),
                             out / "teachers" / f"{folder}-{model}-e{epochs}", progress=False)
    if not teacher.reused:
        log(f"  trained the {dataset.name} teacher: {epochs} epochs, test top-1 {teacher.info.test_accuracy:.2f}% "
            f"({time.perf_counter() - started:.0f} s, cached)")
    return teacher.path, teacher.info.test_accuracy


def prepare(name: str, out: Path, mode: str, device: str, log, teacher_path: str | None = None) -> tuple[Path, dict]:
    """Teacher, resolved config and real patches of one setting, saved for the workers."""
    from fadrm_ray.config import make_config
    from fadrm_ray.data import get_dataset
    from fadrm_ray.models import check_teacher_fits, load_teacher
    from fadrm_ray.patches import select_patches
    from fadrm_ray.frozen_teacher import FrozenTeacher

    spec, size, teacher_kind, T = SETTINGS[name]
    dataset = get_dataset(spec, image_size=size)
    if teacher_path is None:
        teacher_path, _ = bench_teacher(dataset, out, TEACHER_EPOCHS[mode][name], log, teacher_kind)
    cfg = make_config("fadrm", overrides={"ipc": IPC, "iterations": T}).resolve(
        dataset.image_size, dataset.num_classes, dataset.hflip, torch.device(device).type, channels=dataset.channels)
    model, info = load_teacher(teacher_path)
    check_teacher_fits(info, dataset)
    acc = info.test_accuracy
    teacher = FrozenTeacher(model, in_chans=info.in_chans)
    classes = list(range(dataset.num_classes))
    patches = select_patches(dataset, classes, list(range(IPC)), cfg, [teacher])  # (IPC, B, C, D, D)
    teacher.remove_hooks()
    setup = {"dataset": name, "teacher": str(teacher_path), "teacher_top1": acc, "teacher_model": info.model_name,
             "cfg": cfg.to_dict(), "classes": classes, "patches": patches, "mean": list(dataset.mean),
             "std": list(dataset.std), "image_size": dataset.image_size, "channels": dataset.channels, "ipc": IPC}
    path = out / f"setup-{name}.pt"
    torch.save(setup, path)
    return path, setup


def _load() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def measure(cells: list[tuple], rounds: int, iterations: int) -> list[list[dict]]:
    """Run every cell (label, worker, side, overrides) once per round, cells in turn, so that a
    change of load hits all of them; returns the replies per cell."""
    replies: list[list[dict]] = [[] for _ in cells]
    for _ in range(rounds):
        for i, (_label, worker, side, overrides) in enumerate(cells):
            replies[i].append(worker.ask(side=side, iterations=iterations, overrides=overrides))
    return replies


def _summary(replies: list[dict], T: int) -> dict:
    ms = [r["ms_per_image_update"] for r in replies]
    out = {"ms_per_image_update": statistics.median(ms), "ms_per_image_update_rounds": ms,
           "seconds_per_image_at_T": statistics.median(ms) * T / 1000.0,
           "rss_peak_mb": max(r["rss_peak_mb"] for r in replies),
           "rss_before_mb": min(r["rss_before_mb"] for r in replies if r["rss_before_mb"] is not None)
           if any(r["rss_before_mb"] is not None for r in replies) else None}
    if "gpu_peak_mb" in replies[0]:
        out["gpu_peak_mb"] = max(r["gpu_peak_mb"] for r in replies)
    for key in ("precision", "pack", "channels_last", "compile"):
        out[key] = replies[0][key]
    return out


def start_side(name: str, setup_path: Path, args, env: dict, log) -> Worker:
    """One side's worker process (bench/speed/sides.py), warmed up; its hello logged."""
    worker = Worker(name, "bench.speed.sides", [str(setup_path), "--device", args.device, "--threads",
                                                str(args.threads)], env)
    hello = worker.ready()
    log(f"  worker {name}: pid {hello['pid']}, env {hello['env']}")
    return worker


def compare(name: str, setup_path: Path, setup: dict, args, out: Path, log) -> dict:
    """Reference and engine side by side; then, as asked, the quality run, ladder and table."""
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if args.omp_wait == "passive":
        base_env["OMP_WAIT_POLICY"] = "PASSIVE"
    ref_env, eng_env = dict(base_env, FADRM_DEFAULT_MALLOC="1"), dict(base_env, **allocator_env())
    low = "fp16" if args.device.startswith("cuda") else "bf16"
    fast = {"pack": IPC, "channels_last": not args.no_channels_last, "compile": args.compile,
            "precision": args.precision or "auto"}
    if fast["precision"] == "auto":
        fast.pop("precision")  # the config's own auto: bf16 on a CPU that has it, fp16 on CUDA
    T = BUDGET_T[name]
    result = {"dataset": name, "image_size": setup["image_size"], "classes": len(setup["classes"]), "ipc": IPC,
              "teacher": {"model": setup["teacher_model"], "path": setup["teacher"], "test_top1": setup["teacher_top1"]},
              "T": T, "timed_iterations": args.iterations, "rounds": args.rounds, "load_before": _load(),
              "engine_overrides": fast}
    log(f"{name}: {setup['image_size']} px, {len(setup['classes'])} classes, IPC {IPC}, teacher top-1 "
        f"{setup['teacher_top1']:.1f}%, T = {T}; timed on {args.iterations} iterations x {args.rounds} rounds "
        f"(load {result['load_before']})")
    ref = start_side("reference", setup_path, args, ref_env, log)
    eng = start_side("engine", setup_path, args, eng_env, log)
    try:
        q_iters = args.quality_iterations if args.quality_iterations is not None else (args.iterations if args.quick else T)
        rounds, defaults = [], []
        for r in range(args.rounds):
            keep = r == args.rounds - 1 and q_iters == args.iterations  # the quality images come from this round
            a = ref.ask(side="reference", iterations=args.iterations,
                        save=str(out / f"images-{name}-reference.pt") if keep else None)
            b = eng.ask(side="engine", iterations=args.iterations, overrides=fast,
                        save=str(out / f"images-{name}-engine.pt") if keep else None)
            c = eng.ask(side="engine", iterations=args.iterations, overrides={})  # what a default run does
            rounds.append((a, b))
            defaults.append(c)
            log(f"  round {r + 1}: reference {a['ms_per_image_update']:.3f} ms/img-update, engine "
                f"{b['ms_per_image_update']:.3f} -> {a['ms_per_image_update'] / b['ms_per_image_update']:.2f}x, "
                f"engine defaults {c['ms_per_image_update']:.3f} (load {_load()})")
        result["reference"] = _summary([a for a, _ in rounds], T)
        result["engine"] = _summary([b for _, b in rounds], T)
        result["engine_defaults"] = _summary(defaults, T)
        result["defaults_vs_hand_set"] = statistics.median(
            b["ms_per_image_update"] / c["ms_per_image_update"] for (_, b), c in zip(rounds, defaults))
        if args.compile:
            # The first warm-up call compiled every stage shape; without compiling, its steps cost `steady`.
            first, steady = rounds[0][1], result["engine"]["ms_per_image_update"]
            result["engine"]["compile_seconds"] = max(0.0, first["warmup_seconds"]
                                                      - first["warmup_image_updates"] * steady / 1000.0)
        ratios = [a["ms_per_image_update"] / b["ms_per_image_update"] for a, b in rounds]
        result["speedup"] = statistics.median(ratios)
        result["speedup_rounds"] = ratios
        result["speedup_of_medians"] = result["reference"]["ms_per_image_update"] / result["engine"]["ms_per_image_update"]

        if q_iters == args.iterations:
            qa, qb = rounds[-1]
        else:
            log(f"  quality: both sides once more, at {q_iters} iterations (load {_load()})")
            qa = ref.ask(side="reference", iterations=q_iters, save=str(out / f"images-{name}-reference.pt"))
            qb = eng.ask(side="engine", iterations=q_iters, overrides=fast, save=str(out / f"images-{name}-engine.pt"))
        result["quality"] = quality(name, setup, out, args, log)
        result["quality"].update(iterations=q_iters, seconds={"reference": qa["seconds"], "engine": qb["seconds"]},
                                 speedup=qa["seconds"] / qb["seconds"])

        if args.ladder:
            base = {"pack": 1, "precision": "fp32", "channels_last": False, "compile": False}
            cells = [("reference (a)", ref, "reference", {}),
                     ("engine fp32, pack 1, contiguous", ref, "engine", base),
                     ("+ channels-last", ref, "engine", dict(base, channels_last=True)),
                     (f"+ pack {IPC}", ref, "engine", dict(base, channels_last=True, pack=IPC)),
                     (f"+ {low}", ref, "engine", dict(base, channels_last=True, pack=IPC, precision=low)),
                     ("+ allocator env", eng, "engine", dict(base, channels_last=True, pack=IPC, precision=low))]
            if args.compile:
                cells.append(("+ compile", eng, "engine", dict(base, channels_last=True, pack=IPC, precision=low,
                                                                compile=True)))
            log(f"  ladder: {len(cells)} settings x {args.table_rounds} rounds of {args.table_iterations} iterations")
            replies = measure(cells, args.table_rounds, args.table_iterations)
            result["ladder"] = [{"setting": c[0], **_summary(rep, T)} for c, rep in zip(cells, replies)]
        if args.table:
            precisions = ("fp32", low)
            cells = [(f"{prec} pack {p}", eng, "engine",
                      {"pack": p, "precision": prec, "channels_last": not args.no_channels_last, "compile": False})
                     for prec in precisions for p in PACKS]
            log(f"  table: {len(cells)} settings x {args.table_rounds} rounds of {args.table_iterations} iterations")
            replies = measure(cells, args.table_rounds, args.table_iterations)
            result["table"] = [{"pack": c[3]["pack"], **_summary(rep, T)} for c, rep in zip(cells, replies)]
    finally:
        ref.close()
        eng.close()
    result["load_after"] = _load()
    return result


def quality(name: str, setup: dict, out: Path, args, log) -> dict:
    """Teacher losses (and, with --evaluate, student top-1) of both sides' final images."""
    from fadrm_ray.models import load_teacher

    model, _ = load_teacher(setup["teacher"])
    model.eval()
    labels = torch.tensor(setup["classes"]).repeat(IPC)
    batch = len(setup["classes"])
    patches = setup["patches"].reshape(-1, *setup["patches"].shape[2:])
    images = {side: torch.load(out / f"images-{name}-{side}.pt") for side in ("reference", "engine")}
    q = {side: image_losses(model, images[side], labels, setup["mean"], setup["std"], batch) for side in images}
    q["patches"] = image_losses(model, patches, labels, setup["mean"], setup["std"], batch)
    if args.evaluate:
        try:
            from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
            from fadrm_ray.evaluation.evaluate import evaluate_images
            from fadrm_ray.config import EvalConfig
        except ImportError:
            log("  (fadrm_ray.evaluation.evaluate.evaluate_images is not available: losses only)")
        else:
            for side in ("reference", "engine"):
                job = EvalJob(config=EvalConfig(seeds=args.eval_seeds), dataset=name, teacher_paths=[setup["teacher"]])
                ev = evaluate_images(images[side], labels, job, EvalSpec(progress=False))
                q[side]["student_top1_mean"] = ev.top1_mean
                q[side]["student_top1_per_seed"] = ev.top1_per_seed
                log(f"  student top-1 on the {side} images: {ev.top1_mean:.2f}% (seeds {ev.top1_per_seed})")
    return q


def report(results: list[dict], args) -> str:
    gpu = args.device.startswith("cuda")
    mem = "gpu_peak_mb" if gpu else "rss_peak_mb"

    def row(label, s, width=34):
        extra = f"{s['rss_before_mb']:>9.0f}" if not gpu and s.get("rss_before_mb") is not None else ""
        return (f"    {label:<{width}} {s['ms_per_image_update']:>9.3f} {s['seconds_per_image_at_T']:>11.3f} "
                f"{s[mem]:>9.0f}{extra}")

    head = f"    {'':<34} {'ms/upd':>9} {'s/img @T':>11} {'peak MB':>9}" + ("" if gpu else f" {'start MB':>8}")
    lines = []
    for r in results:
        lines.append(f"\n{r['dataset']}: {r['image_size']} px, {r['classes']} classes, IPC {r['ipc']}, {r['teacher']['model']} teacher "
                     f"({r['teacher']['test_top1']:.1f}% top-1), T = {r['T']}; {r['rounds']} alternating rounds of "
                     f"{r['timed_iterations']} iterations; load {r['load_before']} -> {r['load_after']}")
        lines.append("  ms/upd = ms per image-update (one optimizer step of one image); s/img @T = seconds per "
                     f"generated image at T; peak MB = peak {'GPU memory allocated' if gpu else 'RSS of the worker during the run'}")
        lines.append(head)
        for side in ("reference", "engine", "engine_defaults"):
            s = r[side]
            settings = (f"{s['precision']}, pack {s['pack']}, channels_last {s['channels_last']}, compile {s['compile']}"
                        + (f", compile took {s['compile_seconds']:.0f} s once" if "compile_seconds" in s else ""))
            lines.append(row("engine, default settings" if side == "engine_defaults" else side, s) + f"   {settings}")
        lines.append(f"  SPEED-UP (images/s, engine / reference): {r['speedup']:.2f}x   per round: "
                     + ", ".join(f"{v:.2f}" for v in r["speedup_rounds"])
                     + f"; default settings at {r['defaults_vs_hand_set']:.2f}x the engine's hand-set speed")
        q = r["quality"]
        lines.append(f"  quality at {q['iterations']} iterations (teacher on the final images, same measure; "
                     f"this run {q['speedup']:.2f}x):")
        for k in ("reference", "engine", "patches"):
            lines.append(f"    {k:<10} CE {q[k]['ce_mean']:.4f} (median {q[k]['ce_median']:.4f})  BN {q[k]['bn_mean']:.3f}"
                         + (f"  student top-1 {q[k]['student_top1_mean']:.2f}%" if "student_top1_mean" in q[k] else ""))
        if "ladder" in r:
            lines.append("  where the speed comes from (each row adds one change; same rounds):")
            lines.append(head)
            for c in r["ladder"]:
                lines.append(row(c["setting"], c))
        if "table" in r:
            lines.append(f"  engine: seconds per image at T = {r['T']} against pack size (ms/upd in brackets):")
            precs = list(dict.fromkeys(c["precision"] for c in r["table"]))
            lines.append("    " + f"{'pack':>6}" + "".join(f"{p:>22}" for p in precs))
            for pack in PACKS:
                cells = {c["precision"]: c for c in r["table"] if c["pack"] == pack}
                lines.append("    " + f"{pack:>6}" + "".join(
                    f"{cells[p]['seconds_per_image_at_T']:>12.3f} ({cells[p]['ms_per_image_update']:.3f})" for p in precs))
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.speed.engine_vs_reference", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="about two minutes: fewer iterations and rounds")
    p.add_argument("--json", action="store_true", help="print one JSON object (with a `speedup` key)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--datasets", default="mnist-sample,digits",
                   help=f"settings, of {', '.join(SETTINGS)}; the first one gives the headline speed-up")
    p.add_argument("--r18-teacher", default=None,
                   help="a resnet18-cifar checkpoint trained on mnist-sample at 32 px, for mnist32-r18")
    p.add_argument("--out", default="bench-results/engine_vs_reference", help="teachers, patches, images and results")
    p.add_argument("--iterations", type=int, default=None, help="timed iterations per run (default 100; quick 40)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 2)")
    p.add_argument("--quality-iterations", type=int, default=None,
                   help="iterations of the quality run (default: T; quick: --iterations)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of both sides")
    p.add_argument("--precision", default=None,
                   help="engine precision (default: the config's auto)")
    p.add_argument("--compile", action="store_true", help="engine with torch.compile (compile time is reported)")
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--omp-wait", choices=("passive", "default"), default="passive",
                   help="OMP_WAIT_POLICY of both sides (passive: no spinning threads on a shared machine)")
    p.add_argument("--ladder", action="store_true", help="also: the speed-up taken apart, one change at a time")
    p.add_argument("--table", action="store_true", help="also: seconds per image against pack size and precision")
    p.add_argument("--table-iterations", type=int, default=None, help="per ladder/table run (default 40; quick 20)")
    p.add_argument("--table-rounds", type=int, default=None, help="ladder/table rounds (default 2; quick 1)")
    p.add_argument("--evaluate", action="store_true", help="train students on both image sets (evaluate_images)")
    p.add_argument("--eval-seeds", type=int, default=2)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    mode = "quick" if args.quick else "full"
    args.iterations = args.iterations or (40 if args.quick else 100)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.table_iterations = args.table_iterations or (20 if args.quick else 40)
    args.table_rounds = args.table_rounds or (1 if args.quick else 2)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for name in datasets:
        if name not in SETTINGS:
            p.error(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    started = time.perf_counter()
    results = []
    for name in datasets:
        setup_path, setup = prepare(name, out, mode, args.device, log,
                                    args.r18_teacher if name == "mnist32-r18" else None)
        results.append(compare(name, setup_path, setup, args, out, log))
    summary = {"speedup": results[0]["speedup"], "dataset": results[0]["dataset"], "device": args.device,
               "threads": args.threads, "omp_wait": args.omp_wait, "allocator_env": allocator_env(),
               "torch": torch.__version__, "cpu_bf16": _cpu_bf16(), "mode": mode,
               "seconds": round(time.perf_counter() - started, 1), "results": results}
    (out / "engine_vs_reference.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary))
    else:
        print(report(results, args))
        print(f"\nheadline: {results[0]['dataset']} speed-up {summary['speedup']:.2f}x "
              f"({summary['seconds']:.0f} s in all; JSON in {out / 'engine_vs_reference.json'})")
    return summary


def _cpu_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


if __name__ == "__main__":
    main()
