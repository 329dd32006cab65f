"""Stored soft labels kept small: top-k logits per view, a fixed number of epochs, one packed file."""
import math

import pytest
import torch
import torch.nn.functional as F

from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.training import train_student
from fadrm_ray.evaluation.relabel import AugmentSpec, OnlineSoftLabels, SoftLabeler
from fadrm_ray.config import EvalConfig, LabelStorage
from fadrm_ray.evaluation.soft_labels import (SoftLabelError, StoredSoftLabels, folders_of, pack_soft_labels,
                                        precompute_soft_labels, topk_compress, topk_expand)


@pytest.fixture(scope="module")
def labeler(digits, digits_teacher):
    return SoftLabeler.from_paths([digits_teacher[0]], digits)


def images_of(digits, per_class=3):
    idx = torch.cat([digits.train.indices_of_class(c)[:per_class] for c in range(digits.num_classes)])
    return digits.train.load(idx)


def test_topk_keeps_the_kept_probabilities_and_shares_the_rest():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=gen) * 30
    for k, t in ((1, 20.0), (3, 20.0), (5, 4.0)):
        values, classes, rest = topk_compress(logits, k, t)
        back = topk_expand(values, classes, rest, 10)
        p, q = F.softmax(logits / t, dim=1), F.softmax(back / t, dim=1)
        assert torch.allclose(p.gather(1, classes), q.gather(1, classes), atol=1e-6)
        others = q.scatter(1, classes, float("nan"))
        rest_q = others[~others.isnan()].view(6, 10 - k)
        assert torch.allclose(rest_q, rest_q[:, :1].expand_as(rest_q), atol=1e-7)  # shared equally
        assert torch.allclose(q.sum(1), torch.ones(6), atol=1e-5)
        # The expanded logits' KD target differs from the exact one only outside the kept classes.
        assert float((p - q).abs().gather(1, classes).max()) < 1e-6
    assert math.isclose(float(topk_expand(*topk_compress(logits, 9, 20.0), 10)[0].max()), float(logits[0].max()),
                        rel_tol=1e-6)


def test_top_k_and_fewer_epochs_are_stored_read_back_and_smaller(digits, labeler, tmp_path):
    images = images_of(digits)
    spec = AugmentSpec(out_size=8, hflip=digits.hflip)
    online = OnlineSoftLabels(images, labeler, spec, batch_size=8, seed=1)
    full = StoredSoftLabels(precompute_soft_labels(online, 4, tmp_path / "full"), images)
    small_store = LabelStorage(topk=2, epochs=2, temperature=20.0)
    small = StoredSoftLabels(precompute_soft_labels(online, 4, tmp_path / "small", small_store), images)
    assert (full.epochs, small.epochs) == (4, 2) and small.meta.topk == 2 and small.meta.num_classes == 10
    assert small.bytes_per_image() < full.bytes_per_image()
    # Same views as the online source; epochs past the stored two read them again in turn.
    for epoch, stored_epoch in ((0, 0), (1, 1), (3, 1)):
        reference = list(online.epoch(stored_epoch))
        for a, b in zip(reference, small.epoch(epoch), strict=True):
            assert torch.equal(a.view01, b.view01)
            top = a.logits.topk(2, dim=1).indices
            assert torch.equal(b.logits.topk(2, dim=1).indices.sort(1).values, top.sort(1).values)
            assert torch.allclose(b.logits.gather(1, top), a.logits.gather(1, top), rtol=2e-3, atol=2e-2)
    # k at or above the class count keeps every logit: the full store under its own key.
    every = LabelStorage(topk=10)
    assert StoredSoftLabels(precompute_soft_labels(online, 1, tmp_path / "k10", every), images).meta.topk is None


def test_a_packed_file_serves_each_seed_and_refuses_other_images_or_seeds(digits, labeler, tmp_path):
    images = images_of(digits)
    spec = AugmentSpec(out_size=8, hflip=digits.hflip)
    storage = LabelStorage(topk=3, epochs=2)
    folders = [precompute_soft_labels(OnlineSoftLabels(images, labeler, spec, 8, seed), 2, tmp_path, storage)
               for seed in (0, 1)]
    packed = tmp_path / "labels.parquet"
    packed.write_bytes(pack_soft_labels(folders))
    for seed, folder in zip((0, 1), folders):
        from_file, from_folder = StoredSoftLabels(packed, images, seed=seed), StoredSoftLabels(folder, images)
        for a, b in zip(from_file.epoch(1), from_folder.epoch(1), strict=True):
            assert torch.equal(a.view01, b.view01) and torch.equal(a.logits, b.logits)
    with pytest.raises(SoftLabelError, match=r"seed\(s\) \[0, 1\], not seed 5"):
        StoredSoftLabels(packed, images, seed=5)
    other = images.clone()
    other[0, 0, 0, 0] ^= 1
    with pytest.raises(SoftLabelError, match="made for other images"):
        StoredSoftLabels(packed, other, seed=0)
    with pytest.raises(SoftLabelError, match="not a soft-label file"):
        StoredSoftLabels(folders[0] / "epoch=00000.parquet", images)


def test_a_student_trains_on_top_k_labels_of_a_few_epochs(digits, labeler, tmp_path):
    images = images_of(digits, per_class=4)
    cfg = EvalConfig(epochs=40, soft_labels="stored", soft_label_topk=2, soft_label_epochs=2)
    parts = EvalParts(dataset=digits, labeler=labeler, soft_label_dir=tmp_path)
    score = train_student(images, 0, EvalJob(config=cfg), EvalSpec(progress=False), parts)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert sorted(p.name for p in folder.glob("epoch=*")) == ["epoch=00000.parquet", "epoch=00001.parquet"]
    # Found again by what its meta records; other settings or another seed find nothing.
    assert folders_of(tmp_path, images, cfg.model_copy(update={"seeds": [0]}), labeler.ids) == [folder]
    with pytest.raises(SoftLabelError, match=r"seed\(s\) \[1\]"):
        folders_of(tmp_path, images, cfg.model_copy(update={"seeds": [0, 1]}), labeler.ids)
    with pytest.raises(SoftLabelError):
        folders_of(tmp_path, images, cfg.model_copy(update={"seeds": [0], "soft_label_topk": 3}), labeler.ids)
    # Beside labels of every epoch with the same k, each setting finds its own folder.
    every = cfg.model_copy(update={"soft_label_epochs": None, "seeds": [0]})
    train_student(images, 0, EvalJob(config=every), EvalSpec(progress=False), parts)
    (longer,) = [p for p in tmp_path.iterdir() if p.is_dir() and p != folder]
    assert folders_of(tmp_path, images, every, labeler.ids) == [longer]
    assert folders_of(tmp_path, images, cfg.model_copy(update={"seeds": [0]}), labeler.ids) == [folder]
    assert score.epochs == 40 and score.final_top1 > 25.0  # chance is 10 %
    # The storage settings are part of the recipe: cached evaluations made before them stay named alike.
    assert "soft_label_topk" not in EvalConfig().key_values() and "soft_label_topk" in cfg.key_values()
