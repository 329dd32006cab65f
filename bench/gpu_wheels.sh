#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, for `device`'s carry (its image: Python 3.12 with torch,
# torchvision, timm, pyarrow, scikit-learn and opencv, but no Ray, pydantic or mlxtend).
#
#   bash bench/gpu_wheels.sh          # writes .whl/ (git-ignored), under the 64 MiB a call carries, and checks
#                                     # them with the image's packages (bench/gpu_image.py)
#
# Then, with `device`: carry [".whl", ".official"] and run
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHON=python3 bash bench/gpu_check.sh
# Ray's wheel carries Java jars that nothing here uses; they are left out so that it fits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pin() { grep -i -E "^${1//-/[-_]}==" constraints.txt | head -1; }
mkdir -p .whl
rm -f .whl/*.whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
NAMES=(ray pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection jsonschema
       jsonschema-specifications referencing rpds-py mlxtend aiohttp-cors colorful opencensus opencensus-context)
SPECS=()
for name in "${NAMES[@]}"; do SPECS+=("$(pin "$name")"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --platform any -d .whl "${SPECS[@]}"
# Ray without its jars (they are most of its size).
ray_wheel=$(ls .whl/ray-*.whl)
work=$(mktemp -d)
python3 - "$ray_wheel" "$work/$(basename "$ray_wheel")" <<'PY'
import sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if item.filename.endswith(".jar"):
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):  # the jars' lines go with them
            data = b"\n".join(l for l in data.split(b"\n") if b".jar," not in l)
        zout.writestr(item, data)
PY
mv "$work/$(basename "$ray_wheel")" "$ray_wheel"
rm -rf "$work"
du -ch .whl/*.whl | tail -1
# Together with the image's packages, they must hold everything the GPU check imports.
python3 -m bench.gpu_image --wheels .whl
