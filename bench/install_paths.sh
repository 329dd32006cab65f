#!/usr/bin/env bash
# What each install path of the README downloads and installs: for each, the wheels pip fetches
# (`pip download`: their count and size, and the torch, triton and nvidia-* ones among them), then
# a fresh virtualenv installed from them with the README's command (seconds, size on disk).
#
#     bash bench/install_paths.sh OUT [--cpu-wheels DIR]
#
# The default path is the README's `pip install -c constraints.txt -e .` (PyPI's torch, built for
# CUDA). The CPU path adds PyTorch's CPU index (https://download.pytorch.org/whl/cpu) to the same
# command; where that index cannot be reached, `--cpu-wheels DIR` names a folder of CPU wheels
# of torch (and torchvision) to take instead, whose versions then replace the pins of those two
# (say so beside any figure it gives). The times are of installing from wheels already fetched:
# a network's download time comes on top. Name the machine of any figure.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"; shift
CPU_WHEELS=""
if [[ "${1:-}" == "--cpu-wheels" ]]; then CPU_WHEELS="$(cd "$2" && pwd)"; fi
PYTHON=${PYTHON:-python3.11}

path() {  # NAME, then the pip arguments that pick the wheels
  local name=$1; shift
  rm -rf "${OUT:?}/$name"; mkdir -p "$OUT/$name"
  "$PYTHON" -m venv "$OUT/$name/venv"
  local pip="$OUT/$name/venv/bin/pip"
  (cd "$REPO" && "$pip" download -q --no-cache-dir -d "$OUT/$name/wheels" "$@" .) > "$OUT/$name/download.log" 2>&1
  rm -f "$OUT/$name/wheels"/fadrm_ray-*  # the project itself, built from the checkout
  local start end
  start=$(date +%s.%N)
  (cd "$REPO" && "$pip" install -q --no-cache-dir --no-index --find-links "$OUT/$name/wheels" "$@" -e .) \
    > "$OUT/$name/install.log" 2>&1
  end=$(date +%s.%N)
  local wheels heavy
  wheels=$(find "$OUT/$name/wheels" -name '*.whl' | wc -l)
  heavy=$(find "$OUT/$name/wheels" -name '*.whl' \( -name 'torch-*' -o -name 'torchvision-*' -o -name 'triton-*' \
          -o -name 'nvidia_*' -o -name 'cuda_*' \) -printf '%f\n' | sort | tr '\n' ' ')
  echo "$name: $wheels wheels, $(du -sh "$OUT/$name/wheels" | cut -f1) downloaded, of which torch, triton and CUDA" \
       "$(find "$OUT/$name/wheels" \( -name 'torch-*' -o -name 'torchvision-*' -o -name 'triton-*' -o -name 'nvidia_*' \
          -o -name 'cuda_*' \) -printf '%s\n' | awk '{s+=$1} END {printf "%.0f MB", s/1e6}')"
  echo "$name: installed in $(awk "BEGIN {printf \"%.0f\", $end - $start}") s, virtualenv $(du -sh "$OUT/$name/venv" | cut -f1)," \
       "torch $("$OUT/$name/venv/bin/python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
  echo "$name: $heavy"
}

echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) ($(nproc) CPUs), $("$PYTHON" --version)"
path default -c constraints.txt
if [[ -n "$CPU_WHEELS" ]]; then
  # The CPU wheels of this folder in place of the index: their versions replace the two pins.
  torch=$(find "$CPU_WHEELS" -name 'torch-*.whl' -printf '%f\n' | head -1 | cut -d- -f2)
  vision=$(find "$CPU_WHEELS" -name 'torchvision-*.whl' -printf '%f\n' | head -1 | cut -d- -f2)
  sed -e "s/^torch==.*/torch==$torch/" "$REPO/constraints.txt" > "$OUT/constraints-cpu.txt"
  if [[ -n "$vision" ]]; then sed -i "s/^torchvision==.*/torchvision==$vision/" "$OUT/constraints-cpu.txt"
  else  # the torchvision release made with that torch (torch 2.N goes with torchvision 0.N+15), PyPI's build
    minor=$(echo "$torch" | cut -d. -f2)
    sed -i "s/^torchvision==.*/torchvision==0.$((minor + 15)).0/" "$OUT/constraints-cpu.txt"
  fi
  echo "cpu: CPU wheels from $CPU_WHEELS: torch==$torch, torchvision $(grep '^torchvision==' "$OUT/constraints-cpu.txt")"
  path cpu -c "$OUT/constraints-cpu.txt" --find-links "$CPU_WHEELS"
else
  path cpu -c constraints.txt --extra-index-url https://download.pytorch.org/whl/cpu
fi
