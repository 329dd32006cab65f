"""The recover loop of docs/method.md sections 3-5, on tiny teachers and 8-px images."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fadrm_ray.augment import crop_box
from fadrm_ray.config import DistillConfig, make_config
from fadrm_ray.models import create_model
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.recover import (RecoverState, augment, cda_scale_min, cosine, final_images,
                               init_state, recover, run_stage)

MEAN, STD = [0.3], [0.37]


@pytest.fixture(scope="module")
def teacher_model():
    torch.manual_seed(0)
    model = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=8, width=16)
    model.train()
    with torch.no_grad():  # give the BN layers non-trivial running statistics
        for _ in range(10):
            model(torch.randn(32, 1, 8, 8) * 0.7 + 0.2)
    return model.eval()


def patches(g=2, b=10, seed=0):
    return torch.randint(0, 256, (g, b, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def cfg_for(**kw):
    base = dict(iterations=24, ipc=2, precision="fp32")
    base.update(kw)
    return DistillConfig(**base).resolve(8, 10, hflip=False, channels=1)


def state_for(cfg, g=2, classes=range(10)):
    return init_state(cfg, list(classes), list(range(g)), patches(g, len(list(classes))) if cfg.init == "real" else None,
                      8, 1, MEAN, STD)


def test_bn_loss_matches_a_hand_computation():
    torch.manual_seed(1)
    bn1, bn2 = nn.BatchNorm2d(2), nn.BatchNorm2d(2)
    model = nn.Sequential(bn1, nn.Conv2d(2, 2, 1, bias=False), bn2, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3))
    bn1.running_mean.copy_(torch.tensor([0.5, -1.0]))
    bn1.running_var.copy_(torch.tensor([2.0, 0.5]))
    bn2.running_mean.copy_(torch.tensor([0.1, 0.2]))
    bn2.running_var.copy_(torch.tensor([1.5, 3.0]))
    teacher = FrozenTeacher(model, first_bn_weight=10.0)
    x = torch.randn(6, 2, 3, 3)
    _, loss = teacher(x, groups=2)
    teacher.remove_hooks()

    def layer_loss(a, bn):  # statistics over N, H, W; biased variance; plain L2 norms
        mean = a.mean(dim=(0, 2, 3))
        var = a.var(dim=(0, 2, 3), unbiased=False)
        return torch.norm(mean - bn.running_mean) + torch.norm(var - bn.running_var)

    for g, chunk in enumerate(x.chunk(2)):
        hidden = model[1](bn1(chunk))
        expected = 10.0 * layer_loss(chunk, bn1) + layer_loss(hidden, bn2)
        assert loss[g].item() == pytest.approx(expected.item(), rel=1e-5)


def test_teacher_without_batchnorm_is_refused():
    with pytest.raises(ValueError, match="no BatchNorm"):
        FrozenTeacher(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))


def test_arc_merge_is_alpha_mix_with_the_resampled_patch(teacher_model):
    """Same run with ARC (alpha 0.5) and without (alpha 1): the stage-0 optimization is identical,
    so after the merge x_arc = 0.5 * x_plain + 0.5 * resize(P) at the next stage's size."""
    teacher = FrozenTeacher(teacher_model)
    res = [6, 8]
    arc, plain = cfg_for(k=1, alpha=0.5, stage_resolutions=res), cfg_for(k=1, alpha=1.0, stage_resolutions=res)
    s_arc, s_plain = state_for(arc), state_for(plain)
    run_stage(s_arc, [teacher], arc)
    run_stage(s_plain, [teacher], plain)
    assert s_arc.x.shape[-1] == 8 and s_plain.x.shape[-1] == 8
    p = (s_arc.patches.float() / 255 - MEAN[0]) / STD[0]
    expected = 0.5 * s_plain.x + 0.5 * F.interpolate(p, size=(8, 8), mode="bilinear", align_corners=False)
    assert torch.allclose(s_arc.x, expected, atol=1e-6)
    assert s_arc.history[0]["merged_after"] and not s_plain.history[0]["merged_after"]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_arc_happens_exactly_k_times_and_not_after_the_last_stage(teacher_model, k):
    cfg = cfg_for(k=k)
    state = recover(state_for(cfg), [FrozenTeacher(teacher_model)], cfg)
    merges = [h["merged_after"] for h in state.history]
    assert len(merges) == k + 1 and sum(merges) == k and merges[-1] is False
    assert sum(h["iterations"] for h in state.history) == cfg.iterations


def test_mro_stages_run_at_their_resolutions(teacher_model):
    seen = []
    hook = teacher_model.features[0].register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-1]))
    try:
        cfg = cfg_for(k=3, iterations=8, stage_resolutions=[5, 8, 6, 8])
        state = recover(state_for(cfg), [FrozenTeacher(teacher_model)], cfg)
    finally:
        hook.remove()
    assert seen == [5, 5, 8, 8, 6, 6, 8, 8]
    assert [h["resolution"] for h in state.history] == [5, 8, 6, 8]
    assert state.x.shape[-1] == 8  # the last stage is always at full resolution


def plain_sre2l_plus_plus(x, labels, teacher_model, cfg, gen):
    """A straightforward loop (docs/method.md section 3): one stage, one Adam, cosine, and a clamp
    or (bound = sigmoid) pixel logits as the parameters."""
    sigmoid = cfg.bound == "sigmoid"
    if sigmoid:
        z = torch.logit((x * STD[0] + MEAN[0]).clamp(1 / 1024, 1 - 1 / 1024)).requires_grad_(True)
    else:
        z = x.clone().requires_grad_(True)
    opt = torch.optim.Adam([z], lr=cfg.lr, betas=(0.5, 0.9))
    bns = [m for m in teacher_model.modules() if isinstance(m, nn.BatchNorm2d)]
    acts = []
    hooks = [bn.register_forward_hook(lambda m, i, o: acts.append((m, i[0]))) for bn in bns]
    lo, hi = (0 - MEAN[0]) / STD[0], (1 - MEAN[0]) / STD[0]
    try:
        for t in range(cfg.iterations):
            opt.param_groups[0]["lr"] = 0.5 * cfg.lr * (1 + math.cos(math.pi * t / cfg.iterations))
            acts.clear()
            x = (torch.sigmoid(z) - MEAN[0]) / STD[0] if sigmoid else z
            view = augment(x, 1, [gen], 8, cfg.crop_scale_min, cfg.flip, cfg.jitter)  # the same random draws
            ce = F.cross_entropy(teacher_model(view), labels)
            bn_loss = 0
            for i, (m, a) in enumerate(acts):
                w = cfg.first_bn_weight if i == 0 else 1.0
                bn_loss = bn_loss + w * (torch.norm(a.mean(dim=(0, 2, 3)) - m.running_mean)
                                         + torch.norm(a.var(dim=(0, 2, 3), unbiased=False) - m.running_var))
            opt.zero_grad()
            (ce + cfg.r_bn * bn_loss).backward()
            opt.step()
            if not sigmoid:
                with torch.no_grad():
                    z.clamp_(lo, hi)
    finally:
        for h in hooks:
            h.remove()
    return ((torch.sigmoid(z) - MEAN[0]) / STD[0] if sigmoid else z).detach()


@pytest.mark.parametrize("bound", ["clamp", "sigmoid"])
def test_k0_and_alpha1_reduce_to_plain_sre2l_plus_plus(teacher_model, bound):
    for overrides in ({"k": 0}, {"k": 0, "alpha": 1.0}):
        cfg = make_config("sre2l++", overrides={"iterations": 12, "precision": "fp32", "bound": bound,
                                                **overrides}).resolve(8, 10, hflip=False, channels=1)
        state = state_for(cfg, g=1)
        gen = torch.Generator().set_state(state.rng_states[0])
        expected = plain_sre2l_plus_plus(state.x, state.labels, teacher_model, cfg, gen)
        recover(state, [FrozenTeacher(teacher_model)], cfg)
        assert torch.allclose(state.x, expected, atol=1e-5)


def test_alpha_one_never_merges(teacher_model):
    cfg = cfg_for(k=3, alpha=1.0)
    state = recover(state_for(cfg), [FrozenTeacher(teacher_model)], cfg)
    assert not any(h["merged_after"] for h in state.history)


def test_recover_loss_falls_and_pixels_stay_in_range(digits, digits_teacher):
    from fadrm_ray.models import load_teacher
    model, _ = load_teacher(digits_teacher[0])
    teacher = FrozenTeacher(model)
    cfg = make_config("fadrm", overrides={"iterations": 60, "ipc": 1, "precision": "fp32", "lr": 0.1}).resolve(8, 10, hflip=False, channels=1)
    real = torch.stack([digits.train.load(digits.train.indices_of_class(c)[:1])[0] for c in range(10)])
    state = init_state(cfg, list(range(10)), [0], real.unsqueeze(0), 8, 1, digits.mean, digits.std)
    # start from noisy versions of real digits so there is something to optimize
    state.x = state.x + 0.8 * torch.randn(state.x.shape, generator=torch.Generator().manual_seed(0))
    _, ce_before, bn_before = final_images(state, [teacher])
    recover(state, [teacher], cfg)
    images, ce_after, bn_after = final_images(state, [teacher])
    first = [sum(h["ce"][:5]) / 5 + cfg.r_bn * sum(h["bn"][:5]) / 5 for h in state.history[:1]][0]
    last = sum(state.history[-1]["ce"][-5:]) / 5 + cfg.r_bn * sum(state.history[-1]["bn"][-5:]) / 5
    assert last < first
    assert bn_after.mean() < bn_before.mean()
    lo = (torch.tensor(0.0) - digits.mean[0]) / digits.std[0]
    hi = (torch.tensor(1.0) - digits.mean[0]) / digits.std[0]
    assert state.x.min() >= lo - 1e-6 and state.x.max() <= hi + 1e-6
    assert images.dtype == torch.uint8 and images.shape == (10, 1, 8, 8)


def test_sigmoid_bound_leaves_saturated_pixels_where_clamping_lets_them_drift(teacher_model):
    # Patches with saturated pixels: a black left half and a white band. Adam moves every pixel by
    # about lr per step whatever its gradient; a clamp keeps only the moves into [0, 1], so black
    # and white pixels drift inward. Through a sigmoid they stay unless the loss keeps pushing them.
    start = patches()
    start[..., :4] = 0
    start[..., 4:6] = 255
    saturated = (start == 0) | (start == 255)
    drift = {}
    for bound in ("clamp", "sigmoid"):
        cfg = cfg_for(bound=bound, lr=0.1, k=1, iterations=40)
        state = init_state(cfg, list(range(10)), [0, 1], start, 8, 1, MEAN, STD)
        recover(state, [FrozenTeacher(teacher_model)], cfg)
        images, _, _ = final_images(state, [FrozenTeacher(teacher_model)])
        change = (images.float() - start.view_as(images).float()).abs() / 255
        drift[bound] = float(change[saturated.view_as(images)].mean())
        assert float(change[~saturated.view_as(images)].mean()) > 0.01  # the other pixels are optimized
        low, high = (0 - MEAN[0]) / STD[0], (1 - MEAN[0]) / STD[0]
        assert state.x.min() >= low - 1e-5 and state.x.max() <= high + 1e-5
    assert drift["sigmoid"] < drift["clamp"] / 4


def test_bf16_autocast_runs_on_cpu(teacher_model):
    cfg = cfg_for(precision="bf16", k=1, iterations=4)
    state = recover(state_for(cfg), [FrozenTeacher(teacher_model)], cfg)
    assert state.x.dtype == torch.float32 and torch.isfinite(state.x).all()  # images stay fp32 (MPT)


def test_fp16_needs_cuda(teacher_model):
    cfg = cfg_for(precision="fp16")
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        run_stage(state_for(cfg), [FrozenTeacher(teacher_model)], cfg)


def test_teachers_take_turns(teacher_model):
    calls = []

    class Spy(FrozenTeacher):
        def __init__(self, model, tag):
            super().__init__(model)
            self.tag = tag
        def __call__(self, x, groups=1, labels=None):
            calls.append(self.tag)
            return super().__call__(x, groups, labels)
    cfg = cfg_for(k=0, iterations=6)
    recover(state_for(cfg, g=1), [Spy(teacher_model, "a"), Spy(teacher_model, "b")], cfg)
    assert calls == ["a", "b"] * 3  # FADRM+ round robin (section 5)


def test_noise_init_and_cda_curriculum(teacher_model):
    cfg = make_config("cda", overrides={"iterations": 6, "precision": "fp32"}).resolve(8, 10, hflip=False, channels=1)
    state = state_for(cfg, g=1)
    assert state.patches is None and abs(float(state.x.std()) - 1.0) < 0.3
    recover(state, [FrozenTeacher(teacher_model)], cfg)
    assert cda_scale_min(0.08, 0, 100) == pytest.approx(1.0)
    assert cda_scale_min(0.08, 100, 100) == pytest.approx(0.08)
    assert cda_scale_min(0.08, 50, 100) == pytest.approx(0.54)


def test_converged_arc_timing_passes_unused_iterations_on(teacher_model):
    cfg = cfg_for(k=3, iterations=40, arc_timing="converged", arc_ce_threshold=100.0, arc_bn_threshold=1e9)
    state = recover(state_for(cfg), [FrozenTeacher(teacher_model)], cfg)
    # every stage but the last converges at once; the last takes what the others left
    assert [h["iterations"] for h in state.history] == [1, 1, 1, 37]
    assert state.iteration == 40


def test_state_round_trips_through_the_runs_stage_checkpoint(teacher_model, tmp_path):
    from fadrm_ray.layout import RunLayout
    from fadrm_ray.runs.stages import checkpoint_of, states_of
    from fadrm_ray.store.checkpoints import latest_checkpoints, load_checkpoint, save_checkpoint

    cfg = cfg_for(k=3, iterations=16)
    teacher = FrozenTeacher(teacher_model)
    straight = recover(state_for(cfg), [teacher], cfg)
    moved, layout = state_for(cfg), RunLayout(tmp_path)
    for _ in range(2):
        run_stage(moved, [teacher], cfg)
        save_checkpoint(layout, *checkpoint_of("u0", [moved]))
    assert [p.name for p in layout.checkpoints()] == ["u0.after2.safetensors"] and latest_checkpoints(layout) == {"u0": 2}
    (moved,) = states_of(*load_checkpoint(layout, "u0", 2))
    assert isinstance(moved, RecoverState) and moved.history[0]["iterations"] > 0 and moved.patches is not None
    recover(moved, [teacher], cfg)
    assert torch.equal(moved.x, straight.x)


def test_a_stage_checkpoint_of_the_earlier_format_resumes_the_same(teacher_model, tmp_path):
    from fadrm_ray.layout import RunLayout
    from fadrm_ray.runs.stages import states_of
    from fadrm_ray.store.checkpoints import latest_checkpoints, load_checkpoint

    cfg = cfg_for(k=3, iterations=16)
    teacher = FrozenTeacher(teacher_model)
    straight = recover(state_for(cfg), [teacher], cfg)
    moved, layout = state_for(cfg), RunLayout(tmp_path)
    run_stage(moved, [teacher], cfg)
    layout.checkpoints_dir.mkdir()
    old = {k: getattr(moved, k) for k in moved.__dataclass_fields__}  # torch.save of the states as plain dicts
    torch.save({"unit_id": "u0", "stage": 1, "states": [{**old, "x": moved.x.detach().cpu()}]},
               layout.legacy_checkpoint("u0", 1))
    assert latest_checkpoints(layout) == {"u0": 1}
    (moved,) = states_of(*load_checkpoint(layout, "u0", 1))
    recover(moved, [teacher], cfg)
    assert torch.equal(moved.x, straight.x)


def test_groups_are_independent_of_packing(teacher_model):
    """Packing two IPC groups in one batch gives each group the result of its own run."""
    cfg = cfg_for(k=1, iterations=10)
    teacher = FrozenTeacher(teacher_model)
    both = recover(init_state(cfg, list(range(10)), [0, 1], patches(2), 8, 1, MEAN, STD), [teacher], cfg)
    alone = recover(init_state(cfg, list(range(10)), [1], patches(2)[1:], 8, 1, MEAN, STD), [teacher], cfg)
    assert torch.allclose(both.x[10:], alone.x, atol=1e-5)


def test_schedule_and_crop_helpers():
    assert cosine(0.25, 0, 100) == pytest.approx(0.25)
    assert cosine(0.25, 50, 100) == pytest.approx(0.125)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        top, left, h, w = crop_box(8, 8, 0.08, gen)
        assert 0 <= top and top + h <= 8 and 0 <= left and left + w <= 8 and h > 0 and w > 0
