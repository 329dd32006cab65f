"""Whether the wheels in .whl/ and the lent GPU machine's image together hold everything the GPU
check imports: run here, before a lease, by bench/gpu_wheels.sh.

    python -m bench.gpu_image [--wheels .whl]

The image ('cuda', Python 3.12) is not reachable from here: its package names are listed below as
the device tool's KINDS.md gives them (read on a machine running it on 2026-11-17). Needed: the
project's runtime dependencies (pyproject.toml) and, for every wheel carried, what its metadata
requires on Python 3.12 on Linux (extras left out). Prints what is missing and exits 1 if anything is.
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
IMAGE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split()
# What the GPU check does not import, though something carried declares it: the REST service's
# stack (the project's), and opencensus's Google client (Ray's metrics exporter, never started by
# a local Ray here: Ray ran on the last H200 lease without it).
NOT_IMPORTED = {"fastapi", "uvicorn", "google-api-core"}
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    return canonical(path.name.split("-")[0])


def wheel_requires(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(meta).decode("utf-8", "replace").splitlines()
    return [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(MARKERS)


def missing(wheels: Path) -> dict[str, str]:
    """Needed package -> who needs it, for what neither a wheel nor the image holds."""
    carried = {wheel_name(p): p for p in sorted(wheels.glob("*.whl"))}
    have = set(carried) | {canonical(n) for n in IMAGE_PACKAGES}
    needs: dict[str, str] = {}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for spec in project:
        req = Requirement(spec)
        if applies(req) and canonical(req.name) not in NOT_IMPORTED:
            needs.setdefault(canonical(req.name), "fadrm-ray")
    for name, path in carried.items():
        for req in wheel_requires(path):
            if applies(req) and canonical(req.name) not in NOT_IMPORTED:
                needs.setdefault(canonical(req.name), name)
    return {name: who for name, who in sorted(needs.items()) if name not in have}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", default=str(ROOT / ".whl"))
    args = parser.parse_args(argv)
    gaps = missing(Path(args.wheels))
    if gaps:
        for name, who in gaps.items():
            print(f"missing on the GPU image: {name} (needed by {who}); add it to bench/gpu_wheels.sh", file=sys.stderr)
        raise SystemExit(1)
    print(f"the wheels in {args.wheels} and the GPU image hold everything the GPU check needs")


if __name__ == "__main__":
    main()
