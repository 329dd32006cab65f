"""Shared fixtures: the real `digits` dataset and a tiny teacher trained on it once per session."""
from __future__ import annotations

import os
import sys
import tempfile

import pytest
# setuptools before anything imports pip: test_deploy_checks parses pip commands with pip's own
# parser, and once pip is imported setuptools' distutils shim stands aside, so the setuptools that
# torch.compile's C++ builder imports later would fail its own check of distutils.
import setuptools  # noqa: F401
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Folder listings the tests cache (fadrm_ray/data/listing.py) stay in a folder of this session.
os.environ.setdefault("FADRM_CACHE", tempfile.mkdtemp(prefix="fadrm-test-cache-"))


@pytest.fixture(scope="session")
def digits():
    from fadrm_ray.data import get_dataset
    return get_dataset("digits")


@pytest.fixture(scope="session")
def digits_teacher(digits, tmp_path_factory):
    """A small convnet-bn trained on digits for a few epochs: (checkpoint path, test accuracy)."""
    from fadrm_ray.config import SqueezeConfig
    from fadrm_ray.squeeze import squeeze
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("teacher")
    result = squeeze(digits, SqueezeConfig(model="convnet-bn", epochs=4, model_kwargs={"width": 32}, seed=0),
                     out_dir=out, progress=False, num_threads=1)
    return result.path, result.test_accuracy


@pytest.fixture(autouse=True)
def compiles_only_when_marked(request):
    """A test that compiles a graph with torch.compile (in this process) is marked `compile`, so
    that the fast lane compiles nothing: the compile lane runs it (.ci/run)."""
    if request.node.get_closest_marker("compile"):
        yield
        return

    def graphs() -> int:  # torch.compile loads dynamo: a process that never did has compiled nothing
        dynamo = sys.modules.get("torch._dynamo.utils")
        return dynamo.counters["stats"]["unique_graphs"] if dynamo is not None else 0

    before = graphs()
    yield
    assert graphs() == before, "this test compiles: mark it @pytest.mark.compile"


@pytest.fixture
def one_thread():
    """One torch thread for the test, then the old count (results repeat for a fixed count)."""
    from fadrm_ray.runtime import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def small_run(digits, digits_teacher, tmp_path_factory):
    """A finished run of two units (digits, IPC 3 in units of 2 and 1) to copy and damage."""
    from fadrm_ray.config import make_config
    from fadrm_ray.runs import execute
    from fadrm_ray.runs.job import ExecutionSpec, prepare_job
    from fadrm_ray.runtime import torch_threads

    cfg = make_config("fadrm", overrides={"ipc": 3, "iterations": 8, "ipc_per_unit": 2, "precision": "fp32"})
    spec = ExecutionSpec(local=True, device="cpu", progress=False)
    with torch_threads(1):
        job, parts = prepare_job(cfg, digits, "digits", [digits_teacher[0]], tmp_path_factory.mktemp("small-run"),
                                 device_type=execute.device_type(spec))
        result = execute.run(job, spec, parts)
    return result.run_dir


@pytest.fixture
def run_copy(small_run, tmp_path):
    """A copy of `small_run` under a store of its own, with the same run id (so it can be repaired)."""
    import shutil

    target = tmp_path / "store" / small_run.name
    shutil.copytree(small_run, target)
    return target


@pytest.fixture(scope="session")
def api_service(digits_teacher, tmp_path_factory):
    """A real `fadrm serve` (uvicorn, its own local Ray head) shared by the API tests."""
    from tests.api_helpers import running_service

    # A rate limit far above what the tests send (schemathesis included), so that no test meets
    # it by chance while every request still goes through the limiter; tests of the limit start
    # a server of their own.
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api"), max_ipc=5, max_images=20,
                         max_running=1, max_queued=2, rate_limit=1000, rate_burst=2000) as server:
        yield server


@pytest.fixture(scope="module")
def local_ray():
    """A real embedded local Ray of two CPUs, shared by the tests of one module."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024 * 1024)
    yield
    ray.shutdown()


@pytest.fixture
def decodes_counted(monkeypatch):
    """`counted = decodes_counted(split)`: from then on each call of `split.load` appends the number
    of images it decodes to `counted` (reads counted, not timed)."""
    def count(split) -> list[int]:
        counted, real_load = [], split.load

        def counting(indices):
            counted.append(len(indices))
            return real_load(indices)

        monkeypatch.setattr(split, "load", counting)
        return counted

    return count


@pytest.fixture(scope="module")
def teacher_model():
    """A small convnet-bn (10 classes, 8 px, grey) with non-trivial BatchNorm running statistics:
    the teacher of the recover tests, one per module (they change its memory format)."""
    from fadrm_ray.models import create_model

    torch.manual_seed(0)
    model = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=8, width=16)
    model.train()
    with torch.no_grad():
        for _ in range(10):
            model(torch.randn(32, 1, 8, 8) * 0.7 + 0.2)
    return model.eval()


# Fixtures that start Ray (in this process, or in the server process they run): a test that uses
# one is a Ray test (`-m ray`) wherever it is, whether or not its module says so.
RAY_FIXTURES = {"local_ray", "api_service"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
