#!/usr/bin/env bash
# The GPU check: one call of at most 330 s on a fresh H100 or H200 with the wheel install (200 s with
# --core), every figure kept the moment it is measured.
#
#   bench/gpu_check.sh [--dry-run] [--core] [--only STEP,STEP] [--wheels DIR] [OUTDIR]
#
# OUTDIR: the argument, else $OUT (the device tool's folder that comes back), else
# bench-results/gpu-check. Each step writes OUTDIR/<n>-<step>.json when it ends, ok or not (a
# failed step records its error line and the script goes on to the next): {step, ok, seconds,
# budget, result, measured, error?}. While it runs, a step appends each figure to
# OUTDIR/<n>-<step>.jsonl the moment it has it (bench/record.py); the JSON folds those lines in as
# `measured`, so a step killed by its budget keeps everything it measured (and if the whole call is
# killed, the .jsonl stays). Profile summaries (and small traces) go to OUTDIR/profiles, the log to
# OUTDIR/gpu_check.log. Each step runs under a time budget (its `timeout`); the budgets, printed
# first, bound the call: at most 330 s with the wheel install, 200 s with --core, so that a failed
# step can be rerun within the same 15-minute lease, the machine's start included.
#
#   -  install       --wheels DIR: pip install DIR/*.whl into $FADRM_SITE (/tmp/site), on PYTHONPATH
#   0 env           imports everything the steps need, prints versions and the GPU  (bench.gpu_steps env)
#   1 checks        the precision paths stay finite; each precision's step, eager and fast, computes
#                   the eager fp32 step's losses and gradients within bounds (bench.gpu_steps checks)
#   2 side_by_side  the published loop (as released, with cuDNN autotuning, and like for like), ours
#                   eager and fast at pack 1 and fast at a fixed pack chosen once from the card's
#                   memory; whole stage schedules; profiles (bench.speed.side_by_side)
#   3 end_to_end    import a torchvision teacher, distill with 2 Ray workers sharing the GPU, evaluate there
#   4 students      a student epoch on the GPU against the CPU (bench.speed.students)
#   5 share         one process against two sharing the GPU (bench.speed.side_by_side --share 2)
#
# --core skips 3-5. --dry-run runs every step CPU-sized and uncompiled, to test this script anywhere,
# under five times the budgets (a small, shared CPU; FADRM_GPU_CHECK_BUDGET_SCALE=K sets the
# factor). FADRM_GPU_CHECK_KILL=STEP:N kills that step after its N-th figure, as its budget would
# (the test that it keeps them and that the steps after it still run). The published code is found
# in $FADRM_OFFICIAL, else .official/.
#
# On the lent GPU machine (its image lacks Ray, pydantic and mlxtend), prepared here first:
#   bash bench/gpu_wheels.sh          # .whl/ (about 50 MB), checked against the image's packages
#   mkdir -p .official && git --git-dir=PUBLISHED/.git archive HEAD recover models | tar -x -C .official
# then one `device` call that carries [".whl", ".official"]:
#   PYTHON=python3 bash bench/gpu_check.sh --wheels .whl
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DRY=0 CORE=0 ONLY="" DIR="" WHEELS=""
while (( $# )); do
    case "$1" in
        --dry-run) DRY=1 ;;
        --core) CORE=1 ;;
        --only) ONLY=$2; shift ;;
        --wheels) WHEELS=$2; shift ;;
        -h|--help) sed -n '2,39p' "$0"; exit 0 ;;
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
PUBLISHED=official,official-benchmark,official-like
OURS=ours-eager-pack1,ours-fast-pack1,ours-fast-packed
# The whole-schedule figure and the profiles: the published loop at its like-for-like best and as
# released, ours at pack 1.
SCHEDULED=official-like,ours-eager-pack1,ours-fast-pack1
PROFILED=official,ours-eager-pack1,ours-fast-pack1

if (( DRY )); then
    DEVICE=cpu SCALE=${FADRM_GPU_CHECK_BUDGET_SCALE:-5}
    # Nothing is compiled in a dry run: on a small CPU the compiles alone would take minutes
    # (tests/test_fast_path.py checks the compiled step on the CPU); the checks say so.
    export TORCH_COMPILE_DISABLE=1
    SBS=(--device cpu --size 16 --batch 4 --steps 8 --rounds 1 --schedule 16)
    SHARE=(--device cpu --size 16 --batch 4 --steps 8 --rounds 1)
    STUDENT=(--devices cpu --size 16 --images 16 --classes 4 --epochs 2)
    PACK=2
else
    DEVICE=cuda SCALE=${FADRM_GPU_CHECK_BUDGET_SCALE:-1}
    # Per-step figures over 40 steps (10 per stage) x 2 rounds; one whole schedule of T = 400
    # (100 per stage) for the scheduled contenders, measured, not extrapolated.
    SBS=(--device cuda --steps 40 --rounds 2 --schedule 400)
    SHARE=(--device cuda --steps 40 --rounds 2)
    STUDENT=(--devices cpu,cuda --size 224 --images 64 --classes 100 --epochs 3)
    # One fixed pack for the packed contender, from the card's total memory (about 2.5 GB a group at
    # 224 px, batch 100, fp16): never an automatic pack sized as if alone beside other processes.
    total_gib=$("$PYTHON" -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2**30))" \
        2>/dev/null || echo 0)
    if (( total_gib >= 120 )); then PACK=16; elif (( total_gib >= 70 )); then PACK=8; else PACK=4; fi
fi
if [[ -n "$OFFICIAL" ]]; then
    SBS+=(--official "$OFFICIAL" --published "$PUBLISHED" --schedule-for "$SCHEDULED")
    BRANCH="the published loop from $OFFICIAL ($PUBLISHED)"
else
    SCHEDULED=${SCHEDULED#official-like,} PROFILED=${PROFILED#official,}
    SBS+=(--no-official --schedule-for "$SCHEDULED")
    BRANCH="NO published code (no \$FADRM_OFFICIAL or .official/): side_by_side runs ours alone, which is not what a GPU run with .official runs"
fi

# name, budget (timeout on a fresh H100/H200, s), estimate there (s): docs/benchmarks/speed.md, "The GPU check"
INSTALL="install 25 15"
STEPS=(
    "env 15 8"
    "checks 60 40"
    "side_by_side 100 75"
    "end_to_end 60 40"
    "students 40 20"
    "share 30 15"
)
CORE_STEPS=" env checks side_by_side "
wanted() {
    local name=$1
    if [[ "$name" == install ]]; then [[ -n "$WHEELS" ]]; return; fi
    if [[ -n "$ONLY" ]]; then [[ ",$ONLY," == *",$name,"* ]]; return; fi
    if (( CORE )) && [[ "$CORE_STEPS" != *" $name "* ]]; then return 1; fi
    return 0
}

# The budgets of the whole check and of --core, wheel install included (at most 330 and 200 s).
read -r _ install_budget install_estimate <<<"$INSTALL"
all=$install_budget core=$install_budget all_est=$install_estimate core_est=$install_estimate
for entry in "${STEPS[@]}"; do
    read -r name budget estimate <<<"$entry"
    all=$((all + budget)) all_est=$((all_est + estimate))
    if [[ "$CORE_STEPS" == *" $name "* ]]; then core=$((core + budget)) core_est=$((core_est + estimate)); fi
done
echo "GPU check$( ((DRY)) && echo " (dry run: CPU-sized, nothing compiled, budgets x$SCALE)"); results in $DIR"
echo "side_by_side: $BRANCH"
printf '  %-13s %7s %9s\n' step budget estimate
for entry in "$INSTALL" "${STEPS[@]}"; do
    read -r name budget estimate <<<"$entry"
    printf '  %-13s %6ss %8ss%s\n' "$name" "$budget" "$estimate" "$(wanted "$name" || echo '  (not run)')"
done
echo "budgets on a fresh H100/H200, wheel install included: ${all} s for the whole check (at most 330), ${core} s" \
     "with --core (at most 200); estimates ${all_est} s and ${core_est} s"

# The command of each step: it writes its JSON to $1 and appends its figures to $2 as it measures them.
cmd_install() {
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl && echo '{"wheels": '"$(ls "$WHEELS"/*.whl | wc -l)"'}' >"$1"
}
cmd_env() { "$PYTHON" -m bench.gpu_steps env --device "$DEVICE" --out "$1"; }
cmd_checks() { "$PYTHON" -m bench.gpu_steps checks --device "$DEVICE" --out "$1" --record "$2"; }
cmd_side_by_side() {
    "$PYTHON" -m bench.speed.side_by_side "${SBS[@]}" --ours "$OURS" --pack "$PACK" --profile "$DIR/profiles" \
        --profile-for "$PROFILED" --record "$2" --json >"$1"
}
cmd_end_to_end() { "$PYTHON" -m bench.gpu_steps e2e --device "$DEVICE" --work "$WORK/e2e" --out "$1" --record "$2"; }
cmd_students() { "$PYTHON" -m bench.speed.students "${STUDENT[@]}" --record "$2" --json >"$1"; }
cmd_share() { "$PYTHON" -m bench.speed.side_by_side --share 2 "${SHARE[@]}" --record "$2" --json >"$1"; }

# Run one step under its budget; write DIR/<label><name>.json: {step, ok, seconds, budget, result?, measured?, error?}.
failed=()
run_step() {
    local label=$1 name=$2 budget=$(($3 * SCALE)) estimate=$4 rc
    printf '\n== [%3ds] %s (budget %ss, estimated %ss)\n' "$((SECONDS - START))" "$label$name" "$budget" "$estimate"
    local raw="$WORK/$name.raw.json" lines="$DIR/$label$name.jsonl" began=$SECONDS
    rm -f "$lines"
    local kill=${FADRM_GPU_CHECK_KILL:-}
    [[ "${kill%%:*}" == "$name" ]] && kill=${kill#*:} || kill=""
    FADRM_RECORD_KILL_AFTER=$kill timeout --kill-after=10 "$budget" bash -c "$(declare -f "cmd_$name"); \
        $(declare -p PYTHON DEVICE SBS SHARE STUDENT PACK OURS PROFILED WORK DIR WHEELS SITE); \
        cmd_$name \"\$1\" \"\$2\"" _ "$raw" "$lines" 2> >(tee "$WORK/$name.err" >&2)
    rc=$?
    local took=$((SECONDS - began))
    sleep 0.2  # the stderr tee catches up
    "$PYTHON" - "$name" "$rc" "$took" "$budget" "$raw" "$WORK/$name.err" "$DIR/$label$name.json" "$lines" <<'PY'
import json, sys
from pathlib import Path

name, rc, took, budget, raw, err, out, lines = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    Path(sys.argv[5]), Path(sys.argv[6]), Path(sys.argv[7]), Path(sys.argv[8])
record = {"step": name, "ok": rc == 0, "seconds": took, "budget": budget}
try:
    record["result"] = json.loads(raw.read_text())
except (OSError, ValueError):
    pass
measured = []
for line in (lines.read_text().splitlines() if lines.is_file() else []):
    try:
        measured.append(json.loads(line))
    except ValueError:  # a line cut short by the budget's kill
        pass
if measured:
    record["measured"] = measured
if rc:
    text = err.read_text(errors="replace").splitlines() if err.is_file() else []
    text = [l.strip() for l in text if l.strip()]
    why = f"over its budget of {budget} s (killed)" if rc in (124, 137) else (text[-1] if text else f"exit status {rc}")
    record["error"] = why[:500] + (f" ({len(measured)} figures measured before)" if rc in (124, 137) else "")
out.write_text(json.dumps(record, indent=2))
lines.unlink(missing_ok=True)  # folded into the JSON
PY
    if (( rc )); then
        failed+=("$name")
        echo "FAILED: $name ($("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['error'])" \
            "$DIR/$label$name.json" 2>/dev/null || echo "exit $rc")); going on" >&2
    else
        echo "-- $name done in ${took}s"
    fi
}

SITE=${FADRM_SITE:-/tmp/site}
if wanted install; then
    read -r name budget estimate <<<"$INSTALL"
    run_step "" "$name" "$budget" "$estimate"
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
n=0
for entry in "${STEPS[@]}"; do
    read -r name budget estimate <<<"$entry"
    index=$n
    n=$((n + 1))
    wanted "$name" && run_step "$index-" "$name" "$budget" "$estimate"
done

echo
"$PYTHON" - "$DIR" <<'PY'
import json, sys
from pathlib import Path

steps = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
print("summary:")
for name, s in steps.items():
    print(f"  {name:<13} {'ok' if s['ok'] else 'FAILED'} in {s['seconds']} s, {len(s.get('measured', []))} figures"
          + ("" if s["ok"] else f": {s['error']}"))
c = (steps.get("checks") or {}).get("result")
if c:
    f = c["fast_vs_eager"]
    for name, e in f.items():
        if isinstance(e, dict) and "grad_rel" in e:
            print(f"  {name:<13} gradient {e['grad_rel']:.2e}, statistics term {e['grad_stat_rel']:.2e} from eager fp32")
    if isinstance(f.get("fast"), str):
        print(f"  fast path     {f['fast']}")
r = (steps.get("side_by_side") or {}).get("result")
if r:
    print("  side by side (ms per step of one batch; s per image at T = 2000 extrapolated; over one whole schedule):")
    for n, c in r["contenders"].items():
        sched = c.get("schedule")
        sched = f"{sched['seconds_per_image']:.3f} s/image at T = {sched['steps']}" if sched else ""
        print(f"    {n:<18} pack {c['pack']:>2} {c['precision']:>5} {c['ms_per_step']:8.2f} ms "
              f"{c['seconds_per_image_at_T2000']:7.3f} s/image  peak {c['peak']:.2f} {c['peak_unit']}  {sched}")
    if r.get("fast_is_eager"):
        print(f"    NOTE {r['fast_is_eager']}")
    if r.get("published_best"):
        print(f"    {r['published_best']} (the fastest published setting) / ours: "
              + ", ".join(f"{o} {x:.2f}x" for o, x in r["ratios"][r["published_best"]].items()))
    for n, p in (r.get("profiles") or {}).items():
        extra = f", {p['host_syncs_per_step']:.2f} host syncs and {p['kernel_launches_per_step']:.0f} launches" \
            if "host_syncs_per_step" in p else ""
        print(f"    profile {n}: {p['op_calls_per_step']:.0f} op calls per step{extra}")
s = (steps.get("students") or {}).get("result")
if s:
    print("  student epoch: " + ", ".join(f"{x['device']} {x['seconds_per_epoch']:.3f} s" for x in s["runs"])
          + (f" (CPU / GPU {s['cpu_over_cuda']:.1f}x)" if "cpu_over_cuda" in s else ""))
PY
echo "all steps ran in $((SECONDS - START)) s; ${#failed[@]} failed${failed:+: ${failed[*]}}; JSON and log in $DIR"
(( ${#failed[@]} == 0 ))
