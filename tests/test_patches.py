"""Real-patch selection (docs/method.md section 2)."""
import pytest
import torch
import torch.nn.functional as F

from fadrm_ray.config import DistillConfig
from fadrm_ray.models import load_teacher
from fadrm_ray.patches import class_patches, select_patches
from fadrm_ray.recover import FrozenTeacher


@pytest.fixture(scope="module")
def teacher(digits_teacher):
    model, _ = load_teacher(digits_teacher[0])
    return FrozenTeacher(model)


def ce_of(patches, label, dataset, teacher):
    with torch.no_grad():
        logits, _ = teacher(dataset.normalize(patches))
    return F.cross_entropy(logits, torch.full((patches.shape[0],), label), reduction="none")


def test_easy_patches_are_ranked_by_teacher_cross_entropy(digits, teacher):
    cfg = DistillConfig(ipc=6, patch_selection="easy")
    patches = class_patches(digits, 4, cfg, [teacher])
    assert patches.shape == (6, 1, 8, 8) and patches.dtype == torch.uint8
    ce = ce_of(patches, 4, digits, teacher)
    assert torch.all(ce[1:] >= ce[:-1] - 1e-5), ce  # lowest cross-entropy first
    medium = class_patches(digits, 4, DistillConfig(ipc=6, patch_selection="medium"), [teacher])
    assert ce_of(medium, 4, digits, teacher).mean() > ce.mean()


def test_selection_is_deterministic_per_seed(digits, teacher):
    a = class_patches(digits, 2, DistillConfig(ipc=3, seed=1), [teacher])
    b = class_patches(digits, 2, DistillConfig(ipc=3, seed=1), [teacher])
    c = class_patches(digits, 2, DistillConfig(ipc=3, seed=2), [teacher])
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_whole_images_are_real_training_images_of_the_class(digits):
    patches = class_patches(digits, 7, DistillConfig(ipc=5, patch_selection="whole"))
    real = digits.train.load(digits.train.indices_of_class(7))
    for p in patches:
        assert any(torch.equal(p, r) for r in real)
    assert len({p.numpy().tobytes() for p in patches}) == 5  # five different images


def test_random_crops_need_no_teacher_and_scored_ones_do(digits):
    assert class_patches(digits, 1, DistillConfig(ipc=2, patch_selection="random")).shape == (2, 1, 8, 8)
    with pytest.raises(ValueError, match="scores crops with the teacher"):
        class_patches(digits, 1, DistillConfig(ipc=2, patch_selection="easy"))


def test_a_patch_does_not_depend_on_the_unit_that_asks_for_it(digits, teacher):
    cfg = DistillConfig(ipc=2)
    whole = select_patches(digits, list(range(10)), [0, 1], cfg, [teacher])
    part = select_patches(digits, [3, 8], [1], cfg, [teacher])
    assert whole.shape == (2, 10, 1, 8, 8) and part.shape == (1, 2, 1, 8, 8)
    assert torch.equal(part[0, 0], whole[1, 3]) and torch.equal(part[0, 1], whole[1, 8])


def test_more_ipc_than_candidates_reuses_the_ranking(digits, teacher):
    cfg = DistillConfig(ipc=5, patch_candidates=2)
    patches = class_patches(digits, 0, cfg, [teacher])
    assert torch.equal(patches[0], patches[2]) and torch.equal(patches[1], patches[3])


def test_cache_is_used(digits, teacher):
    cache = {}
    cfg = DistillConfig(ipc=2)
    select_patches(digits, [5], [0], cfg, [teacher], cache=cache)
    cache[5] = torch.zeros_like(cache[5])
    assert select_patches(digits, [5], [1], cfg, [teacher], cache=cache).sum() == 0
