#!/usr/bin/env bash
# GPU check of the recover engine (issue #5): one script, under ten minutes on one CUDA GPU.
#
#   bench/gpu_check.sh [RESULTS.json]            results JSON: the argument, else $OUT/gpu_check.json,
#                                                else bench-results/gpu_check.json
#   bench/gpu_check.sh --dry-run [RESULTS.json]  every step CPU-sized, to test this script without a GPU
#
# Steps:
#   1. environment (nvidia-smi, torch, the GPU)
#   2. the CUDA precision paths run and stay finite: fp16 + GradScaler, bf16, fp32 (a few
#      ResNet-18 steps at 224 px, MRO 200/224)
#   3. Ray: `actors.coordinator.distill_on_ray(..., gpus_per_worker=0.5)` on a tiny digits run
#      (two DistillWorker actors share the GPU); checks every image is written
#   4. seconds per image at the ImageNet-1K setting: ResNet-18, 224 px, MRO 200/224/200/224,
#      100 classes per batch, T = 2000 timed on ITERS iterations and extrapolated linearly;
#      pack 1, 2, 4 in fp16 (the CUDA default), pack 1 and 4 in bf16, pack 1 without
#      channels-last; peak GPU memory of each
#   4b. the efficiency table of the paper's methods side by side (bench.efficiency, printed)
#   5. one JSON with everything, and a summary
#
# Knobs (environment): PYTHON (python3), ITERS (200 timed iterations; 4 stages of 50),
# GPU_CHECK_COMPILE=1 adds torch.compile at pack 1 (minutes of compiling: over the ten-minute aim).
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
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
START=$SECONDS

step() { printf '\n== [%3ds] %s\n' "$((SECONDS - START))" "$*"; }
fail() { printf '\nFAILED: %s\n' "$*" >&2; exit 1; }

if (( DRY )); then
    DEVICE=cpu; ITERS=${ITERS:-8}; TINY=(--tiny); PACKS_FP16="1,2"; LOW=bf16; PATHS="bf16,fp32"; GPUS_PER_WORKER=""
    echo "dry run: CPU-sized stand-ins for every step (no GPU needed); results -> $RESULT"
else
    DEVICE=cuda; ITERS=${ITERS:-200}; TINY=(); PACKS_FP16="1,2,4"; LOW=fp16; PATHS="fp16,bf16,fp32"; GPUS_PER_WORKER=0.5
    echo "GPU check; results -> $RESULT"
fi

step "1/5 environment"
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

step "2/5 precision paths (fp16 + GradScaler, bf16, fp32): a few steps each, must stay finite"
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

step "3/5 Ray: distill_on_ray with gpus_per_worker=${GPUS_PER_WORKER:-none (CPU)} on a tiny digits run"
"$PYTHON" - "$WORK" "$GPUS_PER_WORKER" <<'EOF' || fail "the Ray run failed (see above)"
import json, subprocess, sys, time
from pathlib import Path

work, gpw = Path(sys.argv[1]), sys.argv[2]
device = "cuda" if gpw else "cpu"
started = time.perf_counter()
fadrm = [sys.executable, "-m", "actors.cli"]
subprocess.run(fadrm + ["squeeze", "--dataset", "digits", "--epochs", "1", "--out", str(work / "teacher"), "--quiet"],
               check=True)
flags = ["--gpus-per-worker", gpw] if gpw else ["--workers", "1", "--device", "cpu"]
out = subprocess.run(fadrm + ["distill", "--dataset", "digits", "--teacher", str(work / "teacher" / "teacher.pt"),
                              "--ipc", "2", "--set", "iterations=16", "--out", str(work / "store"), "--json", "--quiet",
                              *flags], check=True, stdout=subprocess.PIPE, text=True).stdout  # stderr shown
result = json.loads(out.strip().splitlines()[-1])
run_dir = Path(result["run_dir"])
ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
workers = [e for e in ledger if e["event"] == "worker_started"]
info = {"images": result["images"], "expected": 20, "units": len(result["units_run"]),
        "seconds": round(time.perf_counter() - started, 1), "workers": len(workers),
        "worker_devices": sorted({str(e.get("device")) for e in workers}), "gpus_per_worker": float(gpw) if gpw else None}
print(json.dumps(info))
json.dump(info, open(work / "ray.json", "w"))
assert result["images"] == 20, f"expected 20 images, the run wrote {result['images']}"
assert not workers or all(d == device for d in info["worker_devices"]), info
EOF

step "4/5 ImageNet-1K setting: seconds per image (T = 2000 timed on $ITERS iterations)"
TEACHER_FLAG=()
if [[ -n "${GPU_CHECK_TEACHER:-}" ]]; then
    [[ -f "$GPU_CHECK_TEACHER" ]] || fail "GPU_CHECK_TEACHER=$GPU_CHECK_TEACHER is not a file"
    TEACHER_FLAG=(--imagenet-teacher "$GPU_CHECK_TEACHER")
    echo "teacher: $GPU_CHECK_TEACHER"
fi
"$PYTHON" -m bench.recover_speed --imagenet "${TINY[@]}" "${TEACHER_FLAG[@]}" --device "$DEVICE" \
    --packs "$PACKS_FP16" --iterations "$ITERS" --precision "$LOW" --json-out "$WORK/imagenet-main.json"
"$PYTHON" -m bench.recover_speed --imagenet "${TINY[@]}" --device "$DEVICE" --packs 1 \
    --iterations "$ITERS" --precision "$LOW" --no-channels-last --json-out "$WORK/imagenet-contiguous.json"
if (( ! DRY )); then
    "$PYTHON" -m bench.recover_speed --imagenet --device cuda --packs 1,4 --iterations "$ITERS" --precision bf16 \
        --json-out "$WORK/imagenet-bf16.json"
fi
if [[ "${GPU_CHECK_COMPILE:-0}" == 1 ]]; then
    "$PYTHON" -m bench.recover_speed --imagenet "${TINY[@]}" --device "$DEVICE" --packs 1 --iterations "$ITERS" \
        --precision "$LOW" --compile --json-out "$WORK/imagenet-compile.json"
fi

step "4b/5 the paper's efficiency table: every method on one small setting (bench.efficiency)"
"$PYTHON" -m bench.efficiency --device "$DEVICE" --scale 0.05 | tee "$WORK/efficiency.txt" \
    || fail "bench.efficiency failed (see above)"

step "5/5 results"
"$PYTHON" - "$WORK" "$RESULT" "$DRY" "$((SECONDS - START))" <<'EOF'
import json, sys
from pathlib import Path
work, result, dry, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
out = {"dry_run": dry, "seconds": seconds, "env": json.loads((work / "env.json").read_text()),
       "precision_paths": json.loads((work / "paths.json").read_text())["runs"],
       "ray": json.loads((work / "ray.json").read_text()), "imagenet": []}
for name in ("main", "contiguous", "bf16", "compile"):
    path = work / f"imagenet-{name}.json"
    if path.exists():
        out["imagenet"] += json.loads(path.read_text())["runs"]
out["published"] = {"fadrm_seconds_per_image": 0.47, "fadrm_peak_gb": 2.9, "sre2l++_seconds_per_image": 2.52,
                    "hardware": "one RTX 4090 (docs/method.md section 4)"}
Path(result).write_text(json.dumps(out, indent=2))
mem = "gpu_peak_gb" if not dry else "rss_peak_mb"
print(f"{'precision':>9} {'pack':>4} {'layout':>14} {'compile':>7} {'ms/step':>9} {'s/image@T2000':>14} {'images/hour':>12} {mem:>12}")
for r in out["imagenet"]:
    print(f"{r['precision']:>9} {r['pack']:>4} {'channels-last' if r['channels_last'] else 'contiguous':>14} "
          f"{str(r['compile']):>7} {r['ms_per_step']:>9.1f} {r['seconds_per_image_at_T2000']:>14.3f} "
          f"{r['images_per_hour']:>12.0f} {r[mem]:>12.2f}")
print(f"published FADRM: 0.47 s/image at 2.9 GB on one RTX 4090 (batch 100, pack 1)")
print(f"ray: {out['ray']['images']} images by {out['ray']['workers']} worker(s) on {out['ray']['worker_devices']}")
print(f"all checks passed in {seconds} s; JSON: {result}")
EOF
