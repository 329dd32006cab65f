"""Golden values: the same seeds give bit-identical images and the same student result.

The hashes below were recorded once and are hard-coded, so that a change of how settings are
built or passed (not of what is computed) can be checked to leave every output unchanged. They
cover the session teacher's weights, the resolved config as saved in config.yaml, the uint8
images read back from the store with their label and IPC-index order, and one student's exact
top-1. Everything runs at fp32 on one torch thread; another CPU (other SIMD kernels) or another
torch build may round differently, in which case the values have to be recorded again there.
"""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
import yaml

from fadrm_ray.config import make_config
from fadrm_ray.distill import distill_local
from fadrm_ray.evaluate import evaluate_run
from fadrm_ray.settings import EvalConfig
from fadrm_ray.store import open_run

pytestmark = pytest.mark.usefixtures("one_thread")

RUNS = {
    "fadrm": ("fadrm", {"ipc": 2, "iterations": 30, "k": 1, "classes": [0, 1, 2], "precision": "fp32"}),
    "sre2l": ("sre2l", {"ipc": 2, "iterations": 20, "precision": "fp32"}),
    "rded": ("rded", {"ipc": 2, "precision": "fp32"}),
}

# The config hashes changed once, when `pack` and `ipc_per_unit` became "auto" by default (the
# saved config records them as asked); the image and order hashes did not.
TEACHER_SHA = "734857e283de07062e5292a36f233986262561e87af21b4621378a899bd466be"
GOLDEN = {
    "fadrm": {"config": "a82c9096b7db42248bbd5d332a881b02c7ff9ed1cbb6e54fa2b4c035f225e1d4",
              "images": "a0f6dcf146f3a74408e7790954fc22d24607079f46ffd9cf1ee55f7e622129b0",
              "order": "2a8fc4992fa37a1176ec801dfda494f685e29dfe14ec39d199b286f05402559f"},
    "sre2l": {"config": "d3eb7d4e1684f805a7cc5198284098818b506a32b005722c31ad7ae8a87a376f",
              "images": "47e9b20cda4d0b334c621c1aedead5f2b1fabaddf07146d54c7e4f0d60154e8e",
              "order": "28d365ea25fdf7208d394c22a469278bb51c9e667cffc5363a7153e4ad3d8672"},
    "rded": {"config": "4be80fc7eb3a591a7cd9c4b855ff578894c1c7f43239c0a6ab5b28ed50ece6d2",
             "images": "323049402f77e618ba1df3d0d2e3f941b58de9227fa1034ce90abc2b0c920f61",
             "order": "28d365ea25fdf7208d394c22a469278bb51c9e667cffc5363a7153e4ad3d8672"},
}
# A student on the sre2l run (20 images): 12 epochs of 2 steps, seed 0, every other setting at
# its default. Long enough to leave chance, so a change of the student's training shows.
STUDENT = {"top1_per_seed": [29.5265], "best_top1_per_seed": [29.5265], "epochs": 12, "steps_per_seed": 24,
           "curves": [[(2, 10.0279), (4, 10.3064), (6, 17.8273), (8, 25.9053), (10, 25.6267), (12, 29.5265)]]}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_sha(path) -> str:
    state = torch.load(path, weights_only=True)["state_dict"]
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].contiguous().numpy().tobytes())
    return h.hexdigest()


def run_hashes(run_dir) -> dict:
    images, labels, ipc = open_run(run_dir).read()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return {"config": sha(json.dumps(config, sort_keys=True).encode()),
            "images": sha(images.numpy().tobytes()),
            "order": sha(labels.numpy().tobytes() + ipc.numpy().tobytes())}


@pytest.fixture(scope="module")
def golden_runs(digits, digits_teacher, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("golden")
    runs = {}
    for name, (preset, overrides) in RUNS.items():
        cfg = make_config(preset, overrides=overrides)
        runs[name] = distill_local(cfg, digits, [digits_teacher[0]], root / "store", device="cpu",
                                   progress=False).run_dir
    return runs


def test_teacher_weights_are_unchanged(digits_teacher):
    assert weights_sha(digits_teacher[0]) == TEACHER_SHA


@pytest.mark.parametrize("name", list(RUNS))
def test_images_are_bit_identical(golden_runs, name):
    assert run_hashes(golden_runs[name]) == GOLDEN[name]


def test_student_result_is_identical(golden_runs, digits, digits_teacher):
    result = evaluate_run(golden_runs["sre2l"], EvalConfig(epochs=12, seeds=[0]), teachers=[digits_teacher[0]],
                          dataset=digits, progress=False)
    assert {k: result[k] for k in STUDENT} == STUDENT
