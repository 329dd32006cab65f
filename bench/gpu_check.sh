#!/usr/bin/env bash
# The GPU check: one script, one call, under eight minutes on one CUDA GPU.
#
#   bench/gpu_check.sh [RESULTS.json]            results JSON: the argument, else $OUT/gpu_check.json,
#                                                else bench-results/gpu_check.json
#   bench/gpu_check.sh --dry-run [RESULTS.json]  every step CPU-sized, to test this script without a GPU
#
# Steps:
#   1. environment (nvidia-smi, torch, the GPU)
#   2. the CUDA precision paths run and stay finite: fp16 + GradScaler, bf16, fp32 (a few
#      ResNet-18 steps at 224 px, MRO 200/224)
#   3. the published recover loop and ours side by side on this GPU (bench.side_by_side: ResNet-18,
#      224 px, batch 100, MRO 200/224, fp16; the published loop, ours eager at pack 1, ours on its
#      fast path at pack 1 and with the automatic pack), with a torch.profiler summary of each
#      (kernel time against wall time, launches and host syncs per step). The published code comes
#      from $FADRM_OFFICIAL, else ./.official (an export of github.com/Jiacheng8/FADRM); without
#      it ours run alone.
#   3b. the fast path (compiled; CUDA graphs on a GPU) against the eager step: one step's losses and input
#      gradient at the run's precision (inductor has had eval-mode BatchNorm bugs, pytorch#181696)
#   4. the engine at the ImageNet-1K setting against pack size: packs 1, 2, 4, 8 (fp16), seconds per
#      image at T = 2000 and peak memory (bench.recover_speed --imagenet)
#   5. a tiny end-to-end run on the GPU: a torchvision ResNet-18 teacher made by `fadrm import-teacher`
#      from a weights file, `fadrm distill` with 2 Ray workers sharing the card (--gpus-per-worker 0.5),
#      `fadrm evaluate --device cuda` (seconds per student epoch)
#   6. a student epoch on the GPU against the CPU, same student, teacher and images (bench.student_speed)
#   7. one process against two sharing the GPU (bench.side_by_side --share 2)
#   8. one JSON with everything, and a summary
#
# Knobs (environment): PYTHON (python3), ITERS (100 timed iterations in step 4), FADRM_OFFICIAL.
#
# On the lent GPU machine (its image lacks Ray, pydantic and mlxtend), prepared here first:
#   bash bench/gpu_wheels.sh                                        # .whl/, about 50 MB
#   mkdir -p .official && git --git-dir=PUBLISHED/.git archive HEAD recover models | tar -x -C .official
# then one `device` call that carries [".whl", ".official"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHON=python3 bash bench/gpu_check.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=1
    shift
fi
RESULT=${1:-}
if [[ -z "$RESULT" ]]; then
    if [[ -n "${OUT:-}" ]]; then RESULT="$OUT/gpu_check.json"; else RESULT="bench-results/gpu_check.json"; fi
fi
mkdir -p "$(dirname "$RESULT")"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fadrm-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} PYTHONUNBUFFERED=1
START=$SECONDS
OFFICIAL=${FADRM_OFFICIAL:-}
if [[ -z "$OFFICIAL" && -f .official/recover/utils_recover.py ]]; then OFFICIAL=$PWD/.official; fi

step() { printf '\n== [%3ds] %s\n' "$((SECONDS - START))" "$*"; }
fail() { printf '\nFAILED: %s\n' "$*" >&2; exit 1; }

if (( DRY )); then
    DEVICE=cpu; ITERS=${ITERS:-8}; TINY=(--tiny); PACKS="1,2"; LOW=bf16; PATHS="bf16,fp32"
    SBS=(--device cpu --size 16 --batch 4 --steps 8 --rounds 2 --ours ours-eager-pack1,ours-fast-pack1)
    SHARE=(--device cpu --size 16 --batch 4 --steps 8 --rounds 1)
    STUDENT=(--devices cpu --size 32 --images 32 --classes 10 --epochs 2)
    DISTILL_FLAGS=(--workers 2 --gpus-per-worker 0 --cpus-per-worker 1)
    EVAL_DEVICE=cpu
    echo "dry run: CPU-sized stand-ins for every step (no GPU needed); results -> $RESULT"
else
    DEVICE=cuda; ITERS=${ITERS:-100}; TINY=(); PACKS="1,2,4,8"; LOW=fp16; PATHS="fp16,bf16,fp32"
    SBS=(--device cuda --steps 40 --rounds 3)
    SHARE=(--device cuda --steps 40 --rounds 3)
    STUDENT=(--devices cpu,cuda --size 224 --images 64 --classes 100 --epochs 3)
    DISTILL_FLAGS=(--workers 2 --gpus-per-worker 0.5)
    EVAL_DEVICE=cuda
    echo "GPU check; results -> $RESULT"
fi
if [[ -n "$OFFICIAL" ]]; then SBS+=(--official "$OFFICIAL"); else SBS+=(--no-official); fi

step "1/8 environment"
if (( ! DRY )); then
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
fi
"$PYTHON" - "$DEVICE" "$WORK/env.json" <<'EOF'
import json, os, sys, torch
device, out = sys.argv[1], sys.argv[2]
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
if device == "cuda":
    if not torch.cuda.is_available():
        sys.exit("torch sees no CUDA device (torch.cuda.is_available() is False); use --dry-run on a CPU machine")
    info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                bf16_supported=torch.cuda.is_bf16_supported(),
                memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
print(json.dumps(info))
json.dump(info, open(out, "w"))
EOF

step "2/8 precision paths (fp16 + GradScaler, bf16, fp32): a few steps each, must stay finite"
"$PYTHON" -m bench.recover_speed --imagenet "${TINY[@]}" --device "$DEVICE" --packs 1 --iterations 8 \
    --precision "$PATHS" --json-out "$WORK/paths.json" \
    || fail "a precision path raised (see above)"
"$PYTHON" - "$WORK/paths.json" <<'EOF' || fail "a precision path produced non-finite images"
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
bad = [r["precision"] for r in runs if not r["finite"]]
print("precision paths:", ", ".join(f"{r['precision']} ok (final CE {r['final_ce']:.3f})" for r in runs if r["finite"]))
sys.exit(f"non-finite images with {bad}" if bad else 0)
EOF

step "3/8 side by side: the published loop and ours (${OFFICIAL:-the published code absent: ours alone})"
"$PYTHON" -m bench.side_by_side "${SBS[@]}" --profile "$WORK/profile" --json > "$WORK/side_by_side.json" \
    || fail "bench.side_by_side failed (see above)"
"$PYTHON" -c "import json, sys; from bench.side_by_side import report; print(report(json.load(open(sys.argv[1]))))" \
    "$WORK/side_by_side.json"

step "3b/8 the fast path computes what the eager step computes (compiled, as CUDA graphs on a GPU)"
"$PYTHON" - "$DEVICE" "$WORK/fast_vs_eager.json" <<'EOF' || fail "the fast path differs from the eager step (see above)"
import json, sys
import torch, torchvision
from fadrm_ray.config import make_config
from fadrm_ray.packing import fast_path
from fadrm_ray.recover import FrozenTeacher, low_precision_dtype, mixed_precision, step_loss, teacher_loss

# One step's losses and input gradient, compiled and eager, against the eager fp32 step: a
# miscompiled eval-mode BatchNorm (pytorch#181696) shows as errors of order one. In fp32 the two
# must agree to rounding; in the run's low precision the input gradient is itself noisy (bf16 on a
# CPU: 18% from fp32), so the fast path must be as close to fp32 as the eager step is. A few
# Adam steps would amplify mere rounding (Adam divides by the gradient's own scale).
device, out = sys.argv[1], sys.argv[2]
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
        with teacher.weights_in(low_precision_dtype(cfg.precision)):
            with autocast():
                ce, bn, stat = step_loss(fn, x, labels, 1, cfg)
            (ce + stat).sum().backward()
    return float(ce.detach()), float(bn.detach()), x.grad.float()


low = make_config("fadrm").resolve(size, 1000, True, torch.device(device).type, channels=3).precision
fast = fast_path(device)
ref = one_step("fp32", {})
runs = {"fast fp32": one_step("fp32", fast), f"eager {low}": one_step(low, {}), f"fast {low}": one_step(low, fast)}
info = {"device": device, "precision": low, "reference": "eager fp32", "ce": ref[0], "bn": ref[1]}
for name, (ce, bn, g) in runs.items():
    info[name] = {"ce_rel": abs(ce - ref[0]) / abs(ref[0]), "bn_rel": abs(bn - ref[1]) / abs(ref[1]),
                  "grad_rel": float((g - ref[2]).norm() / ref[2].norm())}
print(json.dumps(info))
json.dump(info, open(out, "w"))
exact, eager, fast_low = info["fast fp32"], info[f"eager {low}"], info[f"fast {low}"]
bad = [k for k in ("ce_rel", "bn_rel", "grad_rel") if exact[k] > 2e-2]  # TF32 convolutions on a GPU
bad += [f"{low} {k}" for k in ("ce_rel", "bn_rel", "grad_rel") if fast_low[k] > 1.5 * eager[k] + 0.02]
sys.exit(f"the fast path differs from eager: {bad}" if bad else 0)
EOF

step "4/8 ImageNet-1K setting: seconds per image at packs $PACKS (T = 2000 timed on $ITERS iterations)"
"$PYTHON" -m bench.recover_speed --imagenet "${TINY[@]}" --device "$DEVICE" --packs "$PACKS" --iterations "$ITERS" \
    --precision "$LOW" --json-out "$WORK/imagenet.json"

step "5/8 end to end: import a torchvision ResNet-18 teacher, distill with 2 workers, evaluate on $EVAL_DEVICE"
"$PYTHON" - "$WORK" "$EVAL_DEVICE" "${DISTILL_FLAGS[@]}" <<'EOF' || fail "the end-to-end run failed (see above)"
import json, subprocess, sys, time
from pathlib import Path

import torch
import torchvision

work, device, flags = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
fadrm = [sys.executable, "-m", "actors.cli"]


def call(*args):
    out = subprocess.run(fadrm + list(args) + ["--json", "--quiet"], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


started = time.perf_counter()
torch.manual_seed(0)
torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), work / "r18.pth")
teacher = call("import-teacher", "--model", "torchvision:resnet18", "--weights", str(work / "r18.pth"),
               "--dataset", "digits", "--out", str(work / "r18.pt"), "--accept-chance", "--device", device)
imported = time.perf_counter()
result = call("distill", "--dataset", "digits", "--teacher", str(work / "r18.pt"), "--ipc", "2",
              "--set", "iterations=16", "--out", str(work / "store"), *flags)
distilled = time.perf_counter()
run_dir = Path(result["run_dir"])
ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
workers = [e for e in ledger if e["event"] == "worker_started"]
evaluation = call("evaluate", "--run", str(run_dir), "--device", device, "--seeds", "1", "--epochs", "3",
                  "--no-baselines")
done = time.perf_counter()
seeds = len(evaluation["seeds"]) - len(evaluation["seeds_reused"])  # trained now
info = {"teacher_top1": teacher["top1"], "images": result["images"], "expected": 20,
        "workers": len(workers), "worker_devices": sorted({str(e.get("device")) for e in workers}),
        "import_seconds": imported - started, "distill_seconds": distilled - imported,
        "evaluate_seconds": done - distilled, "student_top1": evaluation["top1_mean"],
        "student_seconds_per_epoch": evaluation["seconds"] / max(1, seeds * evaluation["epochs"]),
        "eval_device": device}
print(json.dumps(info))
json.dump(info, open(work / "e2e.json", "w"))
assert result["images"] == 20, f"expected 20 images, the run wrote {result['images']}"
assert len(workers) == 2, f"expected 2 workers, the ledger shows {len(workers)}"
EOF

step "6/8 a student epoch on each device (bench.student_speed)"
"$PYTHON" -m bench.student_speed "${STUDENT[@]}" --json > "$WORK/student.json" || fail "bench.student_speed failed"

step "7/8 one process against two sharing the $DEVICE (bench.side_by_side --share 2)"
"$PYTHON" -m bench.side_by_side --share 2 "${SHARE[@]}" --json > "$WORK/share.json" || fail "the share run failed"

step "8/8 results"
"$PYTHON" - "$WORK" "$RESULT" "$DRY" "$((SECONDS - START))" <<'EOF'
import json, sys
from pathlib import Path
work, result, dry, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
read = lambda name: json.loads((work / name).read_text())  # noqa: E731
sbs = read("side_by_side.json")
out = {"dry_run": dry, "seconds": seconds, "env": read("env.json"), "precision_paths": read("paths.json")["runs"],
       "side_by_side": sbs, "fast_vs_eager": read("fast_vs_eager.json"), "imagenet": read("imagenet.json")["runs"],
       "end_to_end": read("e2e.json"),
       "student_speed": read("student.json"), "share": read("share.json"),
       "published": {"fadrm_seconds_per_image": 0.47, "fadrm_peak_gb": 2.9, "hardware": "one RTX 4090"}}
Path(result).write_text(json.dumps(out, indent=2))
mem = "gpu_peak_gb" if not dry else "rss_peak_mb"
print(f"{'precision':>9} {'pack':>4} {'ms/step':>9} {'s/image@T2000':>14} {'images/hour':>12} {mem:>12}")
for r in out["imagenet"]:
    print(f"{r['precision']:>9} {r['pack']:>4} {r['ms_per_step']:>9.1f} {r['seconds_per_image_at_T2000']:>14.3f} "
          f"{r['images_per_hour']:>12.0f} {r[mem]:>12.2f}")
ratio = sbs.get("ratio_pack1")
print(f"side by side: official {sbs['official_ms'] or float('nan'):.2f} ms/step, ours eager pack 1 "
      f"{sbs['ours_pack1_ms']:.2f}, fast pack 1 {sbs['ours_fast_pack1_ms']:.2f}, best {sbs['ours_best_ms']:.2f} "
      f"({sbs['ours_best']})" + (f"; official / ours at pack 1 {ratio:.2f}x" if ratio else ""))
e2e, st, sh = out["end_to_end"], out["student_speed"], out["share"]
print(f"end to end: {e2e['images']} images by {e2e['workers']} workers on {e2e['worker_devices']}; student on "
      f"{e2e['eval_device']}: {e2e['student_seconds_per_epoch']:.3f} s/epoch")
print("student epoch: " + ", ".join(f"{r['device']} {r['seconds_per_epoch']:.3f} s" for r in st["runs"])
      + (f" (CPU / GPU {st['cpu_over_cuda']:.1f}x)" if "cpu_over_cuda" in st else ""))
print(f"sharing: {sh['processes']} processes {sh['shared_ms_per_step']:.2f} ms per batch-step against "
      f"{sh['one_ms_per_step']:.2f} alone ({sh['gain']:.2f}x)")
print(f"all checks passed in {seconds} s; JSON: {result}")
EOF
