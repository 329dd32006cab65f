"""Teacher training (squeeze) and top-1 evaluation."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from fadrm_ray.data.base import ImageDataset, Split
from fadrm_ray.models import check_teacher_fits, evaluate_top1, load_teacher
from fadrm_ray.config import SqueezeConfig
from fadrm_ray.squeeze import cutmix, ensure_teacher, random_crop_flip, squeeze, teacher_matches

FAST = dict(model="convnet-bn", epochs=8, model_kwargs={"width": 32})
RUN = dict(progress=False, num_threads=1)


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    out = tmp_path_factory.mktemp("squeeze")
    return squeeze(digits, SqueezeConfig(seed=0, **FAST), out_dir=out / "a", **RUN), out


def test_squeeze_learns_digits_and_writes_a_fitting_teacher(trained, digits):
    result, _ = trained
    assert result.test_accuracy >= 85.0  # chance is 10 %
    assert result.epochs == 8 and result.train_seconds > 0
    assert result.path.name == "teacher.pt" and result.path.is_file()
    model, info = load_teacher(result.path)
    check_teacher_fits(info, digits)
    assert info.class_names == digits.class_names and info.dataset_fingerprint == digits.fingerprint()
    assert info.model_kwargs == {"width": 32} and info.sha256 == result.info.sha256
    assert evaluate_top1(model, digits.test, digits) == pytest.approx(result.test_accuracy)
    assert info.test_accuracy == pytest.approx(result.test_accuracy, abs=1e-3)


def test_squeeze_is_deterministic_for_a_seed(trained, digits):
    first, out = trained
    again = squeeze(digits, SqueezeConfig(seed=0, **FAST), out_dir=out / "b", **RUN)
    assert again.test_accuracy == first.test_accuracy
    a = torch.load(first.path, weights_only=True)["state_dict"]
    b = torch.load(again.path, weights_only=True)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = squeeze(digits, SqueezeConfig(seed=1, **dict(FAST, epochs=1)), out_dir=out / "c", **RUN)
    c = torch.load(other.path, weights_only=True)["state_dict"]
    assert not torch.equal(a["classifier.weight"], c["classifier.weight"])


def test_squeeze_feeds_grey_data_to_an_rgb_model(digits, tmp_path):
    cfg = SqueezeConfig(model="convnet-bn", epochs=1, model_kwargs={"width": 8, "depth": 2, "in_chans": 3})
    result = squeeze(digits, cfg, out_dir=tmp_path, progress=False, num_threads=1)
    assert result.info.in_chans == 3 and "in_chans" not in result.info.model_kwargs
    model, info = load_teacher(result.path)
    check_teacher_fits(info, digits)
    assert next(m for m in model.modules() if isinstance(m, nn.Conv2d)).in_channels == 3
    assert evaluate_top1(model, digits.test, digits) == pytest.approx(result.test_accuracy)
    with pytest.raises(ValueError):
        squeeze(digits, SqueezeConfig(epochs=0), out_dir=tmp_path, progress=False)


class _Constant(nn.Module):
    """Always predicts class ``k``."""

    def __init__(self, k: int, n: int):
        super().__init__()
        self.k, self.n = k, n
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        out = torch.zeros(x.shape[0], self.n)
        out[:, self.k] = 1.0
        return out + self.w


def test_evaluate_top1_counts_exactly():
    labels = torch.tensor([0, 1, 1, 2, 1, 0, 1])
    split = Split.in_memory(torch.zeros((7, 1, 4, 4), dtype=torch.uint8), labels)
    ds = ImageDataset(name="t", class_names=["a", "b", "c"], image_size=4, channels=1, mean=(0.5,), std=(0.5,),
                      train=split, test=split)
    model = _Constant(1, 3).train()
    assert evaluate_top1(model, split, ds, batch_size=3) == pytest.approx(100 * 4 / 7)
    assert model.training  # mode restored


def test_random_crop_is_a_shifted_window_and_flip_is_optional():
    gen = torch.Generator().manual_seed(0)
    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).view(2, 1, 6, 6) + 1
    out = random_crop_flip(x, 1, False, gen)
    assert out.shape == x.shape
    for i in range(2):
        padded = torch.nn.functional.pad(x[i], (1, 1, 1, 1))
        windows = [padded[:, r:r + 6, c:c + 6] for r in range(3) for c in range(3)]
        assert any(torch.equal(out[i], w) for w in windows)
    flipped = random_crop_flip(x[:1].expand(64, -1, -1, -1), 0, True, torch.Generator().manual_seed(0))
    n_flipped = sum(torch.equal(f, x[0].flip(-1)) for f in flipped)
    assert 10 < n_flipped < 54


def test_cutmix_lambda_matches_pasted_area():
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(8, 1, 10, 10)
    x[4:] = 1.0
    y = torch.tensor([0] * 4 + [1] * 4)
    for _ in range(5):
        mixed, y_a, y_b, lam = cutmix(x, y, gen)
        assert torch.equal(y_a, y) and 0.0 <= lam <= 1.0
        for i in range(8):
            if y_b[i] != y[i]:  # the pasted box came from the other class: its share is 1 - lam
                own = float((mixed[i] == x[i, 0, 0, 0]).float().mean())
                assert own == pytest.approx(lam)


def test_the_checkpoint_records_the_whole_squeeze_config(trained):
    result, _ = trained
    _, info = load_teacher(result.path)
    assert SqueezeConfig.model_validate(info.squeeze_config) == result.config == SqueezeConfig(seed=0, **FAST)


def test_ensure_teacher_reuses_only_the_teacher_squeeze_would_train(digits, tmp_path):
    cfg = SqueezeConfig(model="convnet-bn", epochs=1, model_kwargs={"width": 8, "depth": 2})
    first = ensure_teacher(digits, cfg, tmp_path, progress=False, num_threads=1)
    assert not first.reused and first.path == tmp_path / "teacher.pt"
    again = ensure_teacher(digits, cfg, tmp_path, progress=False, num_threads=1)
    assert again.reused and again.info.sha256 == first.info.sha256
    other = cfg.model_copy(update={"seed": 1})  # any setting the checkpoint records counts
    assert not teacher_matches(first.info, digits, other)
    retrained = ensure_teacher(digits, other, tmp_path, progress=False, num_threads=1)
    assert not retrained.reused and retrained.info.sha256 != first.info.sha256
    unrecorded = retrained.info.model_copy(update={"squeeze_config": None})  # judged on data, model and kwargs
    assert teacher_matches(unrecorded, digits, cfg)
    assert not teacher_matches(unrecorded, digits, cfg.model_copy(update={"model_kwargs": {"width": 16}}))
