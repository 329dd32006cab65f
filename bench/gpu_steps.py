"""The steps of bench/gpu_check.sh that are not benchmarks of their own, one subcommand each; each
writes one JSON object to `--out` and exits non-zero when its check fails.

    python -m bench.gpu_steps env --device cuda --out env.json
    python -m bench.gpu_steps checks --device cuda --out checks.json
    python -m bench.gpu_steps e2e --device cuda --work DIR --out e2e.json

- `env`: imports everything the other steps need (torch, torchvision, timm, pyarrow, Ray,
  pydantic, pydantic-settings, mlxtend, the project's packages) and prints their versions, the
  GPU, its memory, driver and CUDA: a missing wheel shows here in seconds, not minutes later.
- `checks`: the precision paths stay finite (fp16 with its gradient scaler on CUDA, bf16, fp32:
  a few recover steps of a ResNet-18 with MRO), and the fast path computes what the eager step
  computes (one step's losses and input gradient, compiled and eager, against the eager fp32
  step: a miscompiled eval-mode BatchNorm shows as errors of order one; in fp32 the two agree to
  rounding, in the run's low precision the fast path is as close to fp32 as the eager step is).
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

MODULES = ("torch", "torchvision", "timm", "pyarrow", "ray", "pydantic", "pydantic_settings", "mlxtend", "yaml",
           "tqdm", "matplotlib", "PIL", "sklearn", "fadrm_ray", "actors.cli", "tune", "bench.side_by_side",
           "bench.student_speed")


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


def checks(args) -> dict:
    import torch
    import torchvision

    from bench.speed_imagenet import ImagenetTiming, imagenet_timing
    from fadrm_ray.config import make_config
    from fadrm_ray.packing import fast_path
    from fadrm_ray.frozen_teacher import FrozenTeacher
    from fadrm_ray.recover import held_dtype, mixed_precision, step_loss, teacher_loss

    device, tiny = args.device, args.device != "cuda"
    paths = ["fp16", "bf16", "fp32"] if device == "cuda" else ["bf16", "fp32"]
    runs = imagenet_timing(ImagenetTiming(device=device, packs=[1], iterations=8, precisions=paths, tiny=tiny),
                           log=lambda m: print(m, file=sys.stderr))["runs"]
    out = {"precision_paths": [{k: r[k] for k in ("precision", "finite", "final_ce", "ms_per_step")} for r in runs]}

    size, classes = (224, 100) if device == "cuda" else (32, 10)
    torch.manual_seed(0)
    teacher = FrozenTeacher(torchvision.models.resnet18().to(device))
    view = torch.randn(classes, 3, size, size, device=device)
    labels = torch.arange(classes, device=device)

    def one_step(precision, extra):
        cfg = make_config("fadrm", overrides={"classes": list(range(classes)), "precision": precision, **extra}).resolve(
            size, 1000, True, torch.device(device).type, channels=3)
        autocast, _ = mixed_precision(cfg.precision, torch.device(device))
        fn = teacher_loss(teacher, cfg)
        for _ in range(3):  # compiled: the first calls trace and, on CUDA, record the graphs
            x = view.clone().requires_grad_(True)
            with teacher.weights_in(held_dtype(cfg)):
                with autocast():
                    ce, bn, stat = step_loss(fn, x, labels, 1, cfg)
                (ce + stat).sum().backward()
        return float(ce.detach()), float(bn.detach()), x.grad.float()

    low = make_config("fadrm").resolve(size, 1000, True, torch.device(device).type, channels=3).precision
    fast = fast_path(device)
    ref = one_step("fp32", {})
    started = time.perf_counter()
    variants = {"fast fp32": one_step("fp32", fast), f"eager {low}": one_step(low, {}), f"fast {low}": one_step(low, fast)}
    compare = {"device": device, "precision": low, "reference": "eager fp32", "ce": ref[0], "bn": ref[1],
               "seconds": time.perf_counter() - started}
    for name, (ce, bn, g) in variants.items():
        compare[name] = {"ce_rel": abs(ce - ref[0]) / abs(ref[0]), "bn_rel": abs(bn - ref[1]) / abs(ref[1]),
                         "grad_rel": float((g - ref[2]).norm() / ref[2].norm())}
    out["fast_vs_eager"] = compare
    exact, eager, fast_low = compare["fast fp32"], compare[f"eager {low}"], compare[f"fast {low}"]
    bad = [f"non-finite images with {r['precision']}" for r in runs if not r["finite"]]
    bad += [f"fast fp32 {k}" for k in ("ce_rel", "bn_rel", "grad_rel") if exact[k] > 2e-2]  # TF32 convolutions
    bad += [f"fast {low} {k}" for k in ("ce_rel", "bn_rel", "grad_rel") if fast_low[k] > 1.5 * eager[k] + 0.02]
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
    result = call("distill", "--dataset", "digits", "--teacher", str(work / "r18.pt"), "--ipc", "2",
                  "--set", "iterations=16", "--device", device, "--out", str(work / "store"), *flags)
    distilled = time.perf_counter()
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
