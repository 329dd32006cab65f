#!/usr/bin/env bash
# The GPU check: one call, about five minutes on a fresh H100 or H200 (three with --core), every
# figure kept the moment its step ends.
#
#   bench/gpu_check.sh [--dry-run] [--core] [--only STEP,STEP] [OUTDIR]
#
# OUTDIR: the argument, else $OUT (the device tool's folder that comes back), else
# bench-results/gpu-check. Each step writes OUTDIR/<n>-<step>.json as soon as it ends, ok or not
# (a failed step records its error line and the script goes on to the next), and the whole log
# goes to OUTDIR/gpu_check.log: seven files at most. Each step runs under a time budget (its
# `timeout`); the script prints its estimate of every step before it starts and the time each took.
#
#   0 env           imports everything the steps need, prints versions and the GPU  (bench.gpu_steps env)
#   1 checks        the precision paths stay finite; the fast path equals the eager step (bench.gpu_steps checks)
#   2 side_by_side  the published loop, ours eager at pack 1, ours fast at pack 1, ours fast at a fixed pack
#                   chosen once from the card's memory; profiles of the pack-1 contenders (bench.side_by_side)
#   3 end_to_end    import a torchvision teacher, distill with 2 Ray workers sharing the GPU, evaluate there
#   4 students      a student epoch on the GPU against the CPU (bench.student_speed)
#   5 share         one process against two sharing the GPU (bench.side_by_side --share 2)
#
# --core skips 3-5. --dry-run runs every step CPU-sized and uncompiled, to test this script anywhere.
# FADRM_GPU_CHECK_FAIL=STEP makes that step fail (the test that the others still write their JSON).
#
# On the lent GPU machine (its image lacks Ray, pydantic and mlxtend), prepared here first:
#   bash bench/gpu_wheels.sh          # .whl/ (about 50 MB), checked against the image's packages
#   mkdir -p .official && git --git-dir=PUBLISHED/.git archive HEAD recover models | tar -x -C .official
# then one `device` call that carries [".whl", ".official"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHON=python3 bash bench/gpu_check.sh
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DRY=0 CORE=0 ONLY="" DIR=""
while (( $# )); do
    case "$1" in
        --dry-run) DRY=1 ;;
        --core) CORE=1 ;;
        --only) ONLY=$2; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) DIR=$1 ;;
    esac
    shift
done
DIR=${DIR:-${OUT:-bench-results/gpu-check}}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fadrm-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
exec > >(tee -a "$DIR/gpu_check.log") 2>&1
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} PYTHONUNBUFFERED=1
# One compile cache for the run: the side-by-side's fast contenders find what the checks compiled.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor}
START=$SECONDS
OFFICIAL=${FADRM_OFFICIAL:-}
if [[ -z "$OFFICIAL" && -f .official/recover/utils_recover.py ]]; then OFFICIAL=$PWD/.official; fi

if (( DRY )); then
    DEVICE=cpu
    # Nothing is compiled in a dry run: on a small CPU the compiles alone would take minutes
    # (tests/test_fast_path.py checks the compiled step on the CPU).
    export TORCH_COMPILE_DISABLE=1
    SBS=(--device cpu --size 16 --batch 4 --steps 8 --rounds 1)
    SHARE=(--device cpu --size 16 --batch 4 --steps 8 --rounds 1)
    STUDENT=(--devices cpu --size 16 --images 16 --classes 4 --epochs 2)
    PACK=2
else
    DEVICE=cuda
    SBS=(--device cuda --steps 40 --rounds 3)
    SHARE=(--device cuda --steps 40 --rounds 2)
    STUDENT=(--devices cpu,cuda --size 224 --images 64 --classes 100 --epochs 3)
    # One fixed pack for the packed contender, from the card's total memory (about 2.5 GB a group at
    # 224 px, batch 100, fp16): never an automatic pack sized as if alone beside three other processes.
    total_gib=$("$PYTHON" -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2**30))" \
        2>/dev/null || echo 0)
    if (( total_gib >= 120 )); then PACK=16; elif (( total_gib >= 70 )); then PACK=8; else PACK=4; fi
fi
OURS=ours-eager-pack1,ours-fast-pack1,ours-fast-packed
if [[ -n "$OFFICIAL" ]]; then SBS+=(--official "$OFFICIAL"); else SBS+=(--no-official); fi

# name, budget (timeout, s), estimate on a fresh H100/H200 (s): see docs/benchmarks/speed.md, "The GPU check"
STEPS=(
    "env 30 8"
    "checks 100 60"
    "side_by_side 170 110"
    "end_to_end 90 45"
    "students 60 25"
    "share 45 20"
)
INSTALL_ESTIMATE=15
wanted() {
    local name=$1
    if [[ -n "$ONLY" ]]; then [[ ",$ONLY," == *",$name,"* ]]; return; fi
    if (( CORE )) && [[ "$name" == end_to_end || "$name" == students || "$name" == share ]]; then return 1; fi
    return 0
}

total=$INSTALL_ESTIMATE
echo "GPU check$( ((DRY)) && echo ' (dry run: CPU-sized)'); results in $DIR"
printf '  %-13s %7s %9s\n' step budget estimate
printf '  %-13s %7s %8ss\n' "wheel install" - "$INSTALL_ESTIMATE"
for entry in "${STEPS[@]}"; do
    read -r name budget estimate <<<"$entry"
    if wanted "$name"; then
        printf '  %-13s %6ss %8ss\n' "$name" "$budget" "$estimate"
        total=$((total + estimate))
    fi
done
printf '  %-13s %7s %8ss  (estimated on a fresh H100/H200, wheel install included)\n' total "" "$total"

# The command of each step: it writes its JSON to $1.
cmd_env() { "$PYTHON" -m bench.gpu_steps env --device "$DEVICE" --out "$1"; }
cmd_checks() { "$PYTHON" -m bench.gpu_steps checks --device "$DEVICE" --out "$1"; }
cmd_side_by_side() {
    "$PYTHON" -m bench.side_by_side "${SBS[@]}" --ours "$OURS" --pack "$PACK" --profile "$WORK/profile" --json >"$1"
}
cmd_end_to_end() { "$PYTHON" -m bench.gpu_steps e2e --device "$DEVICE" --work "$WORK/e2e" --out "$1"; }
cmd_students() { "$PYTHON" -m bench.student_speed "${STUDENT[@]}" --json >"$1"; }
cmd_share() { "$PYTHON" -m bench.side_by_side --share 2 "${SHARE[@]}" --json >"$1"; }

# Run one step under its budget; write DIR/<n>-<name>.json: {step, ok, seconds, budget, error?, result?}.
n=0
failed=()
for entry in "${STEPS[@]}"; do
    read -r name budget estimate <<<"$entry"
    index=$n
    n=$((n + 1))
    wanted "$name" || continue
    printf '\n== [%3ds] %d %s (budget %ss, estimated %ss)\n' "$((SECONDS - START))" "$index" "$name" "$budget" "$estimate"
    raw="$WORK/$name.raw.json"
    began=$SECONDS
    if [[ "${FADRM_GPU_CHECK_FAIL:-}" == "$name" ]]; then
        echo "FADRM_GPU_CHECK_FAIL=$name: this step fails on purpose" | tee "$WORK/$name.err" >&2
        rc=3
    else
        timeout --kill-after=10 "$budget" bash -c "$(declare -f "cmd_$name"); $(declare -p PYTHON DEVICE SBS SHARE \
            STUDENT PACK OURS WORK); cmd_$name \"\$1\"" _ "$raw" 2> >(tee "$WORK/$name.err" >&2)
        rc=$?
    fi
    took=$((SECONDS - began))
    sleep 0.2  # the stderr tee catches up
    "$PYTHON" - "$name" "$rc" "$took" "$budget" "$raw" "$WORK/$name.err" "$DIR/$index-$name.json" <<'EOF'
import json, sys
from pathlib import Path

name, rc, took, budget, raw, err, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    Path(sys.argv[5]), Path(sys.argv[6]), Path(sys.argv[7])
record = {"step": name, "ok": rc == 0, "seconds": took, "budget": budget}
try:
    record["result"] = json.loads(raw.read_text())
except (OSError, ValueError):
    pass
if rc:
    lines = [l.strip() for l in (err.read_text(errors="replace").splitlines() if err.is_file() else []) if l.strip()]
    why = f"over its budget of {budget} s" if rc in (124, 137) else (lines[-1] if lines else f"exit status {rc}")
    record["error"] = why[:500]
out.write_text(json.dumps(record, indent=2))
EOF
    if (( rc )); then
        failed+=("$name")
        echo "FAILED: $name ($("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['error'])" \
            "$DIR/$index-$name.json" 2>/dev/null || echo "exit $rc")); going on" >&2
    else
        echo "-- $name done in ${took}s"
    fi
done

echo
"$PYTHON" - "$DIR" <<'EOF'
import json, sys
from pathlib import Path

steps = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
print("summary:")
for name, s in steps.items():
    print(f"  {name:<13} {'ok' if s['ok'] else 'FAILED'} in {s['seconds']} s" + ("" if s["ok"] else f": {s['error']}"))
r = (steps.get("side_by_side") or {}).get("result")
if r:
    rows = r["contenders"]
    print("  side by side (ms per step of one batch; s per image at T = 2000):")
    for n, c in rows.items():
        print(f"    {n:<18} pack {c['pack']:>2} {c['precision']:>5} {c['ms_per_step']:8.2f} ms "
              f"{c['seconds_per_image_at_T2000']:7.3f} s/image  peak {c['peak']:.2f} {c['peak_unit']}")
    if r.get("official_ms"):
        print(f"    published / ours: eager pack 1 {r['ratio_pack1']:.2f}x, fast pack 1 {r['ratio_fast_pack1'] or 0:.2f}x")
    for n, p in (r.get("profiles") or {}).items():
        extra = f", {p['host_syncs_per_step']:.2f} host syncs and {p['kernel_launches_per_step']:.0f} launches" \
            if "host_syncs_per_step" in p else ""
        print(f"    profile {n}: {p['op_calls_per_step']:.0f} op calls per step{extra}")
s = (steps.get("students") or {}).get("result")
if s:
    print("  student epoch: " + ", ".join(f"{x['device']} {x['seconds_per_epoch']:.3f} s" for x in s["runs"])
          + (f" (CPU / GPU {s['cpu_over_cuda']:.1f}x)" if "cpu_over_cuda" in s else ""))
EOF
echo "all steps ran in $((SECONDS - START)) s; ${#failed[@]} failed${failed:+: ${failed[*]}}; JSON and log in $DIR"
(( ${#failed[@]} == 0 ))
