"""A student never holds a float copy of the whole distilled set: the images stay uint8 (on the
student's device) and each step converts only the pixels of its own views, whether its soft labels
are computed online or stored, or its labels are hard (fadrm_ray/evaluation/relabel.py). The
conversion is per element, so the views are the floats a converted set would give: the golden
students (tests/test_golden.py) are unchanged. bench/student_memory.py measures the memory."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fadrm_ray.config import EvalConfig
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.hard_labels import HardLabels
from fadrm_ray.evaluation.relabel import SoftLabeler, to_unit
from fadrm_ray.evaluation.training import train_student

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = EvalSpec(progress=False)


class FloatCopies(TorchDispatchMode):
    """Every floating-point tensor an operator returns with the shape of the whole set."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.seen = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) == self.shape:
                self.seen.append(str(func))
        return out


@pytest.fixture(scope="module")
def distilled(digits):
    """37 real digits (an odd count: no batch of 16, and no test chunk, has the set's shape)."""
    idx = torch.randperm(len(digits.train), generator=torch.Generator().manual_seed(0))[:37]
    images, labels = digits.train.load(idx), digits.train.labels[idx]
    assert len(digits.test) != 37
    return images, labels


def test_the_watch_sees_a_float_copy_of_the_set(distilled):
    images, _ = distilled
    with FloatCopies(images.shape) as watch:
        to_unit(images)
    assert watch.seen  # what converting the whole set, as students did, looks like


@pytest.mark.parametrize("labels", ["online", "stored", "hard"])
def test_a_student_never_holds_a_float_copy_of_the_whole_set(digits, digits_teacher, distilled, tmp_path, labels):
    images, classes = distilled
    parts = EvalParts(dataset=digits, labeler=SoftLabeler.from_paths([digits_teacher[0]], digits),
                      soft_label_dir=tmp_path, targets=HardLabels(classes) if labels == "hard" else None)
    config = EvalConfig(epochs=2, soft_labels="stored" if labels == "stored" else "online")
    with FloatCopies(images.shape) as watch:
        score = train_student(images, 0, EvalJob(config=config), QUIET, parts)
    assert score.steps == 2 * 3 and watch.seen == []


def test_stored_labels_share_the_online_sources_held_set(digits, digits_teacher, distilled, tmp_path):
    """The stored source cuts its views from the very uint8 tensor the online source holds (on a
    GPU: one copy of the set on the card, not two)."""
    from fadrm_ray.evaluation.relabel import AugmentSpec, OnlineSoftLabels
    from fadrm_ray.evaluation.soft_labels import soft_label_source

    images, _ = distilled
    online = OnlineSoftLabels(images, SoftLabeler.from_paths([digits_teacher[0]], digits), AugmentSpec(out_size=8), 16, 0)
    stored = soft_label_source("stored", online, 1, tmp_path)
    assert online.images.dtype == torch.uint8 and stored.images is online.images
    first = next(stored.epoch(0)).view01
    assert torch.equal(first, next(online.epoch(0)).view01)
