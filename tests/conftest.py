"""Shared fixtures: the real `digits` dataset and a tiny teacher trained on it once per session."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def digits():
    from fadrm_ray.data import get_dataset
    return get_dataset("digits")


@pytest.fixture(scope="session")
def digits_teacher(digits, tmp_path_factory):
    """A small convnet-bn trained on digits for a few epochs: (checkpoint path, test accuracy)."""
    from fadrm_ray.settings import SqueezeConfig
    from fadrm_ray.squeeze import squeeze
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("teacher")
    result = squeeze(digits, SqueezeConfig(model="convnet-bn", epochs=4, model_kwargs={"width": 32}, seed=0),
                     out_dir=out, progress=False, num_threads=1)
    return result.path, result.test_accuracy


@pytest.fixture
def one_thread():
    """One torch thread for the test, then the old count (results repeat for a fixed count)."""
    from fadrm_ray.runtime import torch_threads

    with torch_threads(1):
        yield
