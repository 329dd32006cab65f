"""The steps of bench/gpu_check.sh that are not benchmarks of their own, one subcommand each; each
writes one JSON object to `--out` and exits non-zero when its check fails; `--record FILE`
appends each figure to FILE (JSON lines, bench/record.py) the moment it is measured.

    python -m bench.gpu_steps env --device cuda --out env.json
    python -m bench.gpu_steps checks --device cuda --out checks.json [--record checks.jsonl]
    python -m bench.gpu_steps e2e --device cuda --work DIR --out e2e.json [--record e2e.jsonl]

- `env`: imports everything the other steps need (torch, torchvision, timm, pyarrow, Ray,
  pydantic, pydantic-settings, mlxtend, the project's packages) and prints their versions, the
  GPU, its memory, driver and CUDA: a missing wheel shows here in seconds, not minutes later.
- `checks`: the precision paths stay finite (fp16 with its gradient scaler on CUDA, bf16, fp32:
  a few recover steps of a ResNet-18 with MRO), and each precision computes what the eager fp32
  step computes, within BOUNDS: one step's losses and the input gradients of the whole loss and
  of the statistics term alone, taken as the run takes them (its autocast, its held weights, its
  GradScaler scaling the loss and unscaling the gradient; each gradient cloned), eager in every
  low precision of the device and on the fast path (compiled; CUDA graphs on CUDA) in fp32 and
  the run's low precision, the fast path also within 1.5x the eager step's own error plus 0.02
  (a miscompiled eval-mode BatchNorm shows as errors of order one; fp16 without its scaler loses
  the statistics term's gradient to underflow at 224 px). Where torch.compile is disabled (the
  dry run) the fast path is the eager step: the result says that it compared nothing there.
- `e2e`: a tiny end-to-end run: a torchvision ResNet-18 teacher made by `fadrm import-teacher`
  from a weights file, `fadrm distill` with 2 Ray workers sharing the device, and `fadrm
  evaluate` there (seconds per student epoch).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.record import Record

MODULES = ("torch", "torchvision", "timm", "pyarrow", "ray", "pydantic", "pydantic_settings", "mlxtend", "yaml",
           "tqdm", "matplotlib", "PIL", "sklearn", "fadrm_ray", "actors.cli", "tune", "bench.speed.side_by_side",
           "bench.speed.students")


def env(args) -> dict:
    versions, missing = {}, {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a missing wheel: say which, go on with the rest
            missing[name] = f"{type(exc).__name__}: {exc}"
            continue
        versions[name] = getattr(module, "__version__", None)
    import torch

    info = {"python": sys.version.split()[0], "versions": versions, "missing": missing,
            "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("torch sees no CUDA device (torch.cuda.is_available() is False); use --dry-run here")
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                    bf16_supported=torch.cuda.is_bf16_supported(), memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["nvidia_smi"] = f"not run: {exc}"
    if missing:
        info["error"] = "missing: " + ", ".join(sorted(missing))
    return info


# How far each precision's input gradient (of the whole loss and of the statistics term alone) and
# losses may be from the eager fp32 step's (relative L2). fp32: the fast path's TF32 convolutions.
# fp16 with its GradScaler is within a few percent; without the scaler the statistics term's
# gradient (about 2e-8 per pixel at 224 px) underflows and is off by about 1. bf16 keeps 8 bits.
BOUNDS = {"fp32": 2e-2, "fp16": 0.1, "bf16": 0.5}
LOSS_BOUNDS = {"fp32": 2e-2, "fp16": 0.02, "bf16": 0.05}


def gradients(teacher, view, labels, cfg, amp=None) -> dict:
    """One recover step as the run takes it (`recover.run_stage`): the teacher's loss under the
    run's autocast, its weights held in the run's dtype, the loss scaled by the run's GradScaler
    and the gradient unscaled as `scaler.step` unscales it (`amp`: (autocast factory, scaler);
    default `recover.mixed_precision` of `cfg`). Returns the CE and BN losses and the input
    gradients, cloned, of the whole loss (`grad`) and of the statistics term alone (`grad_stat`):
    the term a low precision loses first."""
    import torch

    from fadrm_ray.recover import held_dtype, mixed_precision, step_loss, teacher_loss

    device = view.device
    autocast, scaler = amp or mixed_precision(cfg.precision, device)
    fn = teacher_loss(teacher, cfg)
    out = {}
    for term in ("grad", "grad_stat"):
        # compiled: the first calls trace and, with CUDA graphs, record; the graphs' buffers are
        # reused by later replays, so each gradient is cloned before the next call
        for _ in range(3 if cfg.compile else 1):
            for _attempt in range(4):  # where the scaled gradient overflows the run skips the step and halves the scale
                x = view.clone().requires_grad_(True)
                opt = torch.optim.Adam([x])  # what the scaler unscales, as in the run
                with teacher.weights_in(held_dtype(cfg)):
                    with autocast():
                        ce, bn, stat = step_loss(fn, x, labels, 1, cfg)
                    loss = (ce + stat).sum() if term == "grad" else stat.sum()
                    if scaler is None:
                        loss.backward()
                    else:
                        scaler.scale(loss).backward()
                        scaler.unscale_(opt)
                g = x.grad.detach().clone()
                if scaler is None:
                    break
                scaler.update()
                if torch.isfinite(g).all():
                    break
        out[term] = g
        out["ce"], out["bn"] = float(ce.detach().float().mean()), float(bn.detach().float().mean())
    return out


def compare(got: dict, ref: dict) -> dict:
    """Relative errors of `gradients` against the reference's."""
    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    return {"ce_rel": abs(got["ce"] - ref["ce"]) / abs(ref["ce"]), "bn_rel": abs(got["bn"] - ref["bn"]) / abs(ref["bn"]),
            "grad_rel": rel(got["grad"], ref["grad"]), "grad_stat_rel": rel(got["grad_stat"], ref["grad_stat"]),
            "grad_stat_norm_ratio": float(got["grad_stat"].norm() / ref["grad_stat"].norm().clamp_min(1e-30))}


def judge(name: str, precision: str, errors: dict, eager: dict | None = None) -> list[str]:
    """What is out of bounds in one variant's `compare` (the fast path's also against the eager
    step's own error in its precision, `eager`)."""
    bad = [f"{name} {k} {errors[k]:.3g} > {LOSS_BOUNDS[precision]}" for k in ("ce_rel", "bn_rel")
           if not errors[k] <= LOSS_BOUNDS[precision]]
    bad += [f"{name} {k} {errors[k]:.3g} > {BOUNDS[precision]}" for k in ("grad_rel", "grad_stat_rel")
            if not errors[k] <= BOUNDS[precision]]
    if eager is not None:
        bad += [f"{name} {k} {errors[k]:.3g} > 1.5 x eager's {eager[k]:.3g} + 0.02" for k in ("grad_rel", "grad_stat_rel")
                if not errors[k] <= 1.5 * eager[k] + 0.02]
    return bad


def checks(args) -> dict:
    import torch
    import torchvision

    from bench.speed.side_by_side import compile_disabled
    from bench.speed.imagenet import ImagenetTiming, imagenet_timing
    from fadrm_ray.config import make_config
    from fadrm_ray.frozen_teacher import FrozenTeacher
    from fadrm_ray.packing import fast_path

    device, tiny, record = args.device, args.device != "cuda", Record(args.record)
    size, classes = (224, 100) if device == "cuda" else (32, 10)

    def config(precision, extra):
        return make_config("fadrm", overrides={"classes": list(range(classes)), "precision": precision, **extra}).resolve(
            size, 1000, True, torch.device(device).type, channels=3)

    low = config("auto", {}).precision  # what a run computes in here (fp16 on CUDA)
    eager_low = ["fp16", "bf16"] if device == "cuda" else ["bf16"]  # every low precision a run may take here
    out = {"precision_paths": []}
    for precision in dict.fromkeys([low, *eager_low, "fp32"]):  # the run's own precision first
        run = imagenet_timing(ImagenetTiming(device=device, packs=[1], iterations=8, precisions=[precision], tiny=tiny),
                              log=lambda m: print(m, file=sys.stderr))["runs"][0]
        out["precision_paths"].append({k: run[k] for k in ("precision", "finite", "final_ce", "ms_per_step")})
        record("precision_path", **out["precision_paths"][-1])
    bad = [f"non-finite images with {r['precision']}" for r in out["precision_paths"] if not r["finite"]]

    torch.manual_seed(0)
    teacher = FrozenTeacher(torchvision.models.resnet18().to(device))
    view = torch.randn(classes, 3, size, size, device=device)
    labels = torch.arange(classes, device=device)
    started = time.perf_counter()
    ref = gradients(teacher, view, labels, config("fp32", {}))
    compare_out = {"device": device, "size": size, "batch": classes, "reference": "eager fp32", "ce": ref["ce"],
                   "bn": ref["bn"], "bounds": BOUNDS, "loss_bounds": LOSS_BOUNDS}
    for precision in eager_low:
        errors = compare(gradients(teacher, view, labels, config(precision, {})), ref)
        compare_out[f"eager {precision}"] = errors
        record("gradients", variant=f"eager {precision}", **errors)
        bad += judge(f"eager {precision}", precision, errors)
    why_not = compile_disabled()
    if why_not:
        compare_out["fast"] = f"not compared: {why_not}, so the fast path is the eager step here"
        print(f"fast vs eager: {compare_out['fast']}", file=sys.stderr)
        record("gradients", variant="fast", compared=False, why=compare_out["fast"])
    else:
        for precision in dict.fromkeys((low, "fp32")):  # the run's own precision first: it matters most
            errors = compare(gradients(teacher, view, labels, config(precision, fast_path(device))), ref)
            compare_out[f"fast {precision}"] = errors
            record("gradients", variant=f"fast {precision}", **errors)
            bad += judge(f"fast {precision}", precision, errors, compare_out.get(f"eager {precision}"))
    compare_out["seconds"] = time.perf_counter() - started
    out["fast_vs_eager"] = compare_out
    if bad:
        out["error"] = "; ".join(bad)
    return out


def e2e(args) -> dict:
    import torch
    import torchvision

    from fadrm_ray.events import WorkerStarted, read_ledger
    from fadrm_ray.layout import RunLayout

    work, device = Path(args.work), args.device
    work.mkdir(parents=True, exist_ok=True)
    fadrm = [sys.executable, "-m", "actors.cli"]
    flags = ["--workers", "2", "--gpus-per-worker", "0.5"] if device == "cuda" else \
        ["--workers", "2", "--gpus-per-worker", "0", "--cpus-per-worker", "1"]

    def call(*argv):
        done = subprocess.run(fadrm + list(argv) + ["--json", "--quiet"], stdout=subprocess.PIPE, text=True)
        if done.returncode:
            raise SystemExit(f"fadrm {argv[0]} exited {done.returncode} (its error is above)")
        return json.loads(done.stdout.strip().splitlines()[-1])

    started = time.perf_counter()
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), work / "r18.pth")
    teacher = call("import-teacher", "--model", "torchvision:resnet18", "--weights", str(work / "r18.pth"),
                   "--dataset", "digits", "--out", str(work / "r18.pt"), "--accept-chance", "--device", device)
    imported = time.perf_counter()
    record = Record(args.record)
    record("import_teacher", seconds=imported - started, top1=teacher["top1"])
    result = call("distill", "--dataset", "digits", "--teacher", str(work / "r18.pt"), "--ipc", "2",
                  "--set", "iterations=16", "--device", device, "--out", str(work / "store"), *flags)
    distilled = time.perf_counter()
    record("distill", seconds=distilled - imported, images=result["images"])
    run_dir = Path(result["run_dir"])
    workers = list(read_ledger(RunLayout(run_dir).ledger, WorkerStarted))
    evaluation = call("evaluate", "--run", str(run_dir), "--device", device, "--seeds", "1", "--epochs", "3",
                      "--no-baselines")
    done = time.perf_counter()
    trained = len(evaluation["seeds"]) - len(evaluation["seeds_reused"])
    out = {"teacher_top1": teacher["top1"], "images": result["images"], "expected": 20, "workers": len(workers),
           "worker_devices": sorted({str(w.device) for w in workers}), "import_seconds": imported - started,
           "distill_seconds": distilled - imported, "evaluate_seconds": done - distilled,
           "student_top1": evaluation["top1_mean"], "eval_device": device,
           "student_seconds_per_epoch": evaluation["seconds"] / max(1, trained * evaluation["epochs"])}
    if result["images"] != 20 or len(workers) != 2:
        out["error"] = f"expected 20 images by 2 workers, the run wrote {result['images']} by {len(workers)}"
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("env", "checks", "e2e"))
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--work", default=None, help="e2e: a folder for its teacher and store")
    parser.add_argument("--out", required=True, help="the step's JSON")
    parser.add_argument("--record", default=None, help="a JSON-lines file each figure is appended to as measured")
    args = parser.parse_args(argv)
    if args.step == "e2e" and not args.work:
        parser.error("e2e needs --work DIR")
    info = {"env": env, "checks": checks, "e2e": e2e}[args.step](args)
    Path(args.out).write_text(json.dumps(info, indent=2))
    print(json.dumps({k: v for k, v in info.items() if k != "precision_paths"}), file=sys.stderr)
    if "error" in info:
        raise SystemExit(f"{args.step}: {info['error']}")


if __name__ == "__main__":
    main()
