"""G-VBSM, EDC and CV-DD as settings of the recover loop (docs/method.md section 7c): each
preset's distinguishing mechanism is part of the objective."""
import pytest
import torch

from fadrm_ray.committee import committee_weights
from fadrm_ray.config import DistillConfig, make_config
from fadrm_ray.models import create_model
from fadrm_ray.frozen_teacher import FrozenTeacher, equip_teachers
from fadrm_ray.recover import init_state, run_stage
from fadrm_ray.statistics import (ClassStatistics, bn_layers, conv_layers, dataset_conv_targets, real_class_bn_targets,
                                  real_conv_targets)

MEAN, STD = [0.3], [0.37]


def model(seed):
    torch.manual_seed(seed)
    m = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=8, width=16)
    m.train()
    with torch.no_grad():  # non-trivial running statistics
        for _ in range(5):
            m(torch.randn(32, 1, 8, 8) * 0.7 + 0.2)
    return m.eval()


def stand_in_conv_targets(m, seed=1):
    """Convolution targets from a fixed batch of stand-in 'real' images."""
    return real_conv_targets(m, torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(seed)))


def with_conv(m, **kw):
    """A teacher of `m` built with stand-in convolution targets."""
    return FrozenTeacher(m, conv_targets=stand_in_conv_targets(m), **kw)


def cfg_for(preset, **kw):
    values = dict(iterations=6, ipc=1, precision="fp32", classes_per_batch=0)
    values.update(kw)
    return make_config(preset, overrides=values).resolve(8, 10, hflip=False, channels=1)


def stage_images(cfg, teachers):
    patches = torch.randint(0, 256, (1, 10, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    state = init_state(cfg, list(range(10)), [0], patches if cfg.init == "real" else None, 8, 1, MEAN, STD)
    return run_stage(state, teachers, cfg).x


# ------------------------------------------------------------------ convolution statistics (G-VBSM, EDC)
def test_conv_targets_are_the_real_images_statistics(monkeypatch):
    m = model(0)
    images = torch.randn(50, 1, 8, 8, generator=torch.Generator().manual_seed(3)) * 2 + 1
    targets = real_conv_targets(m, images)
    assert len(targets) == len(conv_layers(m)) > 1
    mean, var = targets[0]  # the first convolution's input is the image itself
    torch.testing.assert_close(mean, images.mean(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var, images.var(dim=(0, 2, 3), unbiased=False), rtol=1e-5, atol=1e-5)
    # Independent of the batching: fp64 sums over all pixels.
    monkeypatch.setattr("fadrm_ray.statistics._BATCH", 7)
    for (m7, v7), (m1, v1) in zip(real_conv_targets(m, images), targets):
        torch.testing.assert_close(m7, m1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v7, v1, rtol=1e-5, atol=1e-6)


def test_conv_loss_is_part_of_the_objective():
    teacher = with_conv(model(0))
    base = stage_images(cfg_for("g-vbsm", r_conv=0.01), [teacher])
    assert not torch.equal(base, stage_images(cfg_for("g-vbsm", r_conv=1.0), [teacher]))
    # r_conv = 0 is the BN-only objective, bit for bit, whether or not the hooks are attached.
    off = stage_images(cfg_for("g-vbsm", r_conv=0.0), [teacher])
    assert torch.equal(off, stage_images(cfg_for("g-vbsm", r_conv=0.0), [FrozenTeacher(model(0))]))
    assert not torch.equal(off, base)


def test_conv_loss_falls_as_the_images_match_the_targets():
    teacher = with_conv(model(0))
    x = torch.randn(10, 1, 8, 8, requires_grad=True)
    _, _, first = teacher.measure(x, 1)
    first.sum().backward()
    with torch.no_grad():
        x -= 0.05 * x.grad / x.grad.norm()
    _, _, after = teacher.measure(x, 1)
    assert after.item() < first.item()
    assert teacher(x, 1)[1].shape == (1,)  # plain calls leave the convolution hooks idle
    assert teacher.conv.finish() is None  # nothing was measured


def test_r_conv_without_targets_is_refused():
    with pytest.raises(ValueError, match="convolution targets from real images"):
        stage_images(cfg_for("g-vbsm"), [FrozenTeacher(model(0))])


def test_dataset_conv_targets_use_the_dataset(digits):
    m = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=digits.image_size, width=8).eval()
    mean, _ = dataset_conv_targets([(m, None)], digits)[0][0]
    labels = digits.train.labels
    keep = sorted(int(i) for c in range(10) for i in torch.nonzero(labels == c).flatten()[:100])
    real = digits.normalize(digits.train.load(keep))
    torch.testing.assert_close(mean, real.mean(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ committee voting (CV-DD)
def test_committee_weights_follow_the_priors():
    w = committee_weights([70.0, 60.0], 5.0)
    assert w[0] > w[1] and abs(float(w.sum()) - 1) < 1e-6
    torch.testing.assert_close(w, torch.softmax(torch.tensor([14.0, 12.0]), 0))
    assert torch.equal(committee_weights([60.0, 70.0], 5.0), w.flip(0))
    assert committee_weights([70.0, 60.0], 50.0)[0] < w[0]  # a higher temperature votes more evenly
    with pytest.raises(ValueError, match="prior"):
        committee_weights([70.0, float("nan")], 5.0)


def test_committee_vote_is_weighted_by_the_priors():
    def run(p0, p1):
        teachers = [FrozenTeacher(model(0), prior=p0), FrozenTeacher(model(7), prior=p1)]
        return stage_images(cfg_for("cv-dd"), teachers)

    a = run(90.0, 40.0)
    assert not torch.equal(a, run(40.0, 90.0))
    # softmax weights: the same gaps give the same vote.
    torch.testing.assert_close(a, run(80.0, 30.0), rtol=0, atol=1e-5)


def test_committee_uses_every_teacher_each_step():
    one = [FrozenTeacher(model(0), prior=50.0)]
    # Round robin with one teacher and a committee of one are the same objective...
    rr = stage_images(cfg_for("cv-dd", committee="round-robin"), one)
    torch.testing.assert_close(stage_images(cfg_for("cv-dd"), one), rr, rtol=0, atol=1e-6)
    # ...but with two, the committee is not the turn-taking of round robin.
    two = [FrozenTeacher(model(0), prior=50.0), FrozenTeacher(model(7), prior=50.0)]
    assert not torch.allclose(stage_images(cfg_for("cv-dd"), two),
                              stage_images(cfg_for("cv-dd", committee="round-robin"), two))


# ------------------------------------------------------------------ presets
def test_presets_set_their_mechanisms():
    g, e, c = (make_config(p) for p in ("g-vbsm", "edc", "cv-dd"))
    assert g.r_conv > 0 and g.init == "noise" and g.committee == "round-robin" and not g.uses_arc
    assert e.r_conv > 0 and e.init == "real" and e.patch_crop_scale == (0.5, 1.0) and not e.uses_arc
    assert c.committee == "prior" and c.r_conv == 0 and c.init == "real" and c.patch_selection == "medium"


def test_new_fields_keep_old_run_ids():
    for preset in ("fadrm", "fadrm+", "sre2l", "cda", "sre2l++", "rded", "random-real", "fadrm-paper"):
        ident = make_config(preset).identity()
        assert not {"r_conv", "committee", "committee_temperature"} & set(ident), preset
    assert "r_conv" in make_config("g-vbsm").identity()
    assert "committee" in make_config("cv-dd").identity()


def test_new_fields_are_validated():
    for bad in ({"r_conv": -1.0}, {"r_conv": float("inf")}, {"committee_temperature": 0.0},
                {"committee": "majority"}):
        with pytest.raises(ValueError):
            DistillConfig(**bad)


def test_equip_teachers_brings_priors_and_targets(digits):
    from types import SimpleNamespace
    m = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=digits.image_size, width=8).eval()
    infos = [SimpleNamespace(test_accuracy=61.5, in_chans=None)]
    plain = equip_teachers([m], infos, digits, make_config("fadrm"))
    assert plain[0].conv is None and plain[0].prior == 61.5
    edc = equip_teachers([m], infos, digits, make_config("edc"))[0]
    keep = sorted(int(i) for c in range(10) for i in torch.nonzero(digits.train.labels == c).flatten()[:100])
    torch.testing.assert_close(edc.conv.targets[0][0], digits.normalize(digits.train.load(keep)).mean(dim=(0, 2, 3)),
                               rtol=1e-5, atol=1e-5)


def test_a_teacher_takes_its_targets_when_built_and_only_those_that_fit():
    m = model(0)
    teacher = with_conv(m)
    with pytest.raises(AttributeError):
        teacher.conv = None  # nothing is attached to a teacher after it is built
    with pytest.raises(AttributeError):
        teacher.category = None
    with pytest.raises(ValueError, match="convolution targets for"):
        FrozenTeacher(model(0), conv_targets=stand_in_conv_targets(m)[:-1])
    with pytest.raises(ValueError, match="class-wise targets"):
        FrozenTeacher(model(0), category=ClassStatistics(class_targets(m, 0.5).targets[:-1], 0.5))


# ------------------------------------------------------------------ class-wise BN targets (EDC)
def test_class_bn_targets_are_each_class_mean_of_per_image_statistics(monkeypatch):
    m = model(3)
    images = torch.randn(30, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    labels = torch.arange(30) % 3
    monkeypatch.setattr("fadrm_ray.statistics._BATCH", 7)  # batching must not matter
    targets = real_class_bn_targets(m, images, labels, 3)
    seen = []
    bns = [b for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d)]
    hooks = [b.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach())) for b in bns]
    with torch.no_grad():
        m(images)
    for h in hooks:
        h.remove()
    assert len(targets) == len(bns) == len(seen)
    for (mean, var), a in zip(targets, seen):
        for c in range(3):
            mine = a[labels == c].double()
            assert torch.allclose(mean[c].double(), mine.mean(dim=(2, 3)).mean(0), atol=1e-5)
            assert torch.allclose(var[c].double(), mine.var(dim=(2, 3), unbiased=False).mean(0), atol=1e-5)


def class_targets(m, weight, running=False):
    """Class-wise targets of `m` from stand-in 'real' images, or (`running`) equal to the running statistics."""
    if running:
        targets = [(b.running_mean.repeat(10, 1), b.running_var.repeat(10, 1)) for b in bn_layers(m)]
    else:
        images = torch.randn(50, 1, 8, 8, generator=torch.Generator().manual_seed(5)) * 0.5
        targets = real_class_bn_targets(m, images, torch.arange(50) % 10, 10)
    return ClassStatistics(targets, weight)


def test_category_matching_is_part_of_the_objective():
    cfg = cfg_for("edc")
    assert cfg.bn_category == 0.5
    plain = stage_images(cfg_for("edc", bn_category=0.0), [with_conv(model(0))])
    m = model(0)
    same = stage_images(cfg, [with_conv(m, category=class_targets(m, 0.5, running=True))])
    m = model(0)
    blended = stage_images(cfg, [with_conv(m, category=class_targets(m, 0.5))])
    # Class targets equal to the running statistics leave the loss (and the images) as they were;
    # the real class statistics change them.
    assert torch.allclose(plain, same, atol=1e-6)
    assert (plain - blended).abs().max() > 1e-4


def test_category_blend_weights_the_two_losses():
    from fadrm_ray.statistics import StatisticsLoss
    # Layer 0 (weight 2) has running statistics mean (1, 4), var (1, 1); layer 1 (weight 1) has
    # three channels whose running statistics the batch matches exactly.
    category = ClassStatistics([(torch.tensor([[0.0, 0.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 3.0]])),
                                (torch.zeros(2, 3), torch.ones(2, 3))], 0.25)
    matching = StatisticsLoss([(torch.tensor([1.0, 4.0]), torch.tensor([1.0, 1.0])),
                               (torch.zeros(3), torch.ones(3))], first_weight=2.0, category=category)
    # One forward of one group, as the teacher's hooks hand the layers' inputs over: layer 0's
    # two channels have mean (1, 0) and variance (1, 1), layer 1's three mean 0 and variance 1.
    matching.observe(0, torch.tensor([[[[0.0, 2.0]], [[-1.0, 1.0]]]], requires_grad=True), groups=1)
    matching.observe(1, torch.tensor([[-1.0, 1.0]] * 3).view(1, 3, 1, 2).requires_grad_(), groups=1)
    # The batch holds classes 0 and 1: layer 0's class target is mean (1, 0), var (1, 2): class
    # loss 0 + 1 = 1 against the running loss 4 + 0 = 4; layer 1 matches both.
    loss = matching.loss(torch.tensor([0, 1]))
    assert loss.tolist() == pytest.approx([2.0 * (0.75 * 4.0 + 0.25 * 1.0)])
    assert matching.loss() is None  # each forward's statistics are taken once


def test_bn_category_without_targets_is_refused():
    with pytest.raises(ValueError, match="class-wise BN targets"):
        stage_images(cfg_for("edc"), [with_conv(model(0))])


def test_equip_teachers_brings_class_targets_for_edc_only(digits):
    from types import SimpleNamespace
    m = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=digits.image_size, width=8).eval()
    infos = [SimpleNamespace(test_accuracy=61.5, in_chans=None)]
    assert equip_teachers([m], infos, digits, make_config("g-vbsm"))[0].category is None
    edc = equip_teachers([m], infos, digits, make_config("edc"))[0]
    assert edc.category is not None and edc.category.weight == 0.5
    assert edc.category.targets[0][0].shape == (10, edc.bn_layers[0].num_features)


def test_edc_teachers_read_the_real_images_once_for_both_kinds_of_targets(digits, decodes_counted):
    from types import SimpleNamespace
    m = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=digits.image_size, width=8).eval()
    keep = sorted(int(i) for c in range(10) for i in torch.nonzero(digits.train.labels == c).flatten()[:100])
    images = digits.normalize(digits.train.load(keep))
    read = decodes_counted(digits.train)
    edc = equip_teachers([m], [SimpleNamespace(test_accuracy=None, in_chans=None)], digits, make_config("edc"))[0]
    assert sum(read) == len(keep)  # one read of the images for the convolution and the class-wise targets
    for (cm, cv), (em, ev) in zip(real_conv_targets(m, images), edc.conv.targets):
        torch.testing.assert_close((em, ev), (cm, cv), rtol=0, atol=0)
    for (cm, cv), (em, ev) in zip(real_class_bn_targets(m, images, digits.train.labels[keep], 10), edc.category.targets):
        torch.testing.assert_close((em, ev), (cm, cv), rtol=0, atol=0)

# ------------------------------------------------------------------ batch-specific soft labels (CV-DD)
def test_batch_statistics_labels_use_the_batch_and_leave_the_teacher_as_it_was():
    from fadrm_ray.evaluation.relabel import SoftLabeler
    m = model(2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    running = SoftLabeler([m], [MEAN], [STD], [1], ids=["t"])
    batch = running.with_batch_statistics()
    view = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(6))
    reference = model(2)  # the same teacher, its BN layers normalizing with the batch's statistics by hand
    for b in reference.modules():
        if isinstance(b, torch.nn.BatchNorm2d):
            b.forward = (lambda mod: lambda inp: torch.nn.functional.batch_norm(
                inp, None, None, mod.weight, mod.bias, True, 0.0, mod.eps))(b)
    with torch.no_grad():
        want = reference((view - MEAN[0]) / STD[0])
    assert torch.allclose(batch(view), want, atol=1e-5)
    assert (batch(view) - running(view)).abs().max() > 1e-3
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # running stats untouched
    assert not any(b.training for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d))
    assert running.key_ids == ["t"] and batch.key_ids == ["t", "bn=batch"]


def test_teacher_bn_names_its_evaluations_apart_and_running_keeps_the_old_key():
    from fadrm_ray.config import EvalConfig
    assert "teacher_bn" not in EvalConfig().key_values()
    assert EvalConfig(teacher_bn="batch").key_values()["teacher_bn"] == "batch"
    with pytest.raises(ValueError):
        EvalConfig(teacher_bn="train")
