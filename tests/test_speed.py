"""The speed work of recover.py changes how fast the loop runs, not what it computes.

- the fused BN-statistics function gives the loss and the input gradient of the plain formula
  (contiguous and channels-last activations, fp32 and bf16, several groups);
- packing: 4 IPC groups with different crops, through four stages with ARC merges and MRO
  resolutions, give each group the images of its own separate run;
- channels-last and contiguous runs agree; the teacher stays frozen; no per-step host sync is
  needed for the loss curves;
- the speed benchmark's reference loop is a working FADRM loop (bench/speed/reference_loop.py).
"""
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fadrm_ray.config import ConfigError, DistillConfig
from fadrm_ray.models import create_model
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.recover import final_images, init_state, recover

MEAN, STD = [0.3], [0.37]
CLASSES = list(range(10))


pytestmark = pytest.mark.usefixtures("one_thread")  # results are repeatable for a fixed thread count


def patches(g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (g, 10, 1, 8, 8), dtype=torch.uint8, generator=gen)


def cfg_for(**kw):
    # The published recover settings at every size: the engine is compared with the published loop.
    base = dict(iterations=24, ipc=4, precision="fp32", k=3, alpha=0.5, stage_resolutions=[6, 8, 7, 8],
                lr=0.25, crop_scale_min=0.08)
    base.update(kw)
    return DistillConfig(**base).resolve(8, 10, hflip=True, channels=1)


def plain_bn_loss(model, x, groups, first_bn_weight=10.0):
    """The formula of docs/method.md section 3 with plain autograd ops, per group."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((m, i[0])))
             for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    total = 0
    for i, (m, a) in enumerate(seen):
        a = a.float().reshape(groups, a.shape[0] // groups, *a.shape[1:])
        mean = a.mean(dim=(1, 3, 4))
        var = a.var(dim=(1, 3, 4), unbiased=False)
        w = first_bn_weight if i == 0 else 1.0
        total = total + w * (torch.linalg.vector_norm(mean - m.running_mean, dim=1)
                             + torch.linalg.vector_norm(var - m.running_var, dim=1))
    return total


# --------------------------------------------------------------------------- BN statistics
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_bn_statistics_match_the_plain_formula_and_its_gradient(teacher_model, channels_last, dtype):
    torch.manual_seed(3)
    x0 = torch.randn(30, 1, 8, 8) * 0.8 + 0.1
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    teacher = FrozenTeacher(teacher_model)
    teacher.set_memory_format(fmt)
    try:
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            _, bn = teacher(x.contiguous(memory_format=fmt), groups=3)
        bn.sum().backward()
        y = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            expected = plain_bn_loss(teacher_model, y.contiguous(memory_format=fmt), groups=3)
        expected.sum().backward()
    finally:
        teacher.set_memory_format(torch.contiguous_format)
        teacher.remove_hooks()
    assert bn.shape == (3,) and bn.dtype == torch.float32
    rtol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the gradient itself is rounded to bf16
    assert torch.allclose(bn, expected, rtol=rtol)
    scale = y.grad.abs().max()
    assert torch.allclose(x.grad, y.grad, rtol=rtol, atol=rtol * scale)


def test_teacher_is_frozen_and_only_the_input_gets_a_gradient(teacher_model):
    cfg = cfg_for(k=0, stage_resolutions=None, iterations=3)
    teacher = FrozenTeacher(teacher_model)
    assert not any(p.requires_grad for p in teacher_model.parameters())
    recover(init_state(cfg, CLASSES, [0], patches(1), 8, 1, MEAN, STD), [teacher], cfg)
    assert all(p.grad is None for p in teacher_model.parameters())
    assert not any(m.training for m in teacher_model.modules())


# --------------------------------------------------------------------------- packing
def run(cfg, teacher, ipc_indices, group_patches):
    state = init_state(cfg, CLASSES, ipc_indices, group_patches, 8, 1, MEAN, STD)
    return recover(state, [teacher], cfg)


@pytest.mark.parametrize("channels_last", [False, True])
def test_four_packed_groups_equal_four_separate_runs(teacher_model, channels_last):
    """Four groups, four stages (ARC after the first three, MRO at 6/8/7/8 px), flips on: each
    group draws its own crops, and packing them in one batch changes nothing but rounding."""
    cfg = cfg_for(channels_last=channels_last)
    teacher = FrozenTeacher(teacher_model)
    p = patches(4)
    packed = run(cfg, teacher, [0, 1, 2, 3], p)
    assert [h["resolution"] for h in packed.history] == [6, 8, 7, 8]
    assert [h["merged_after"] for h in packed.history] == [True, True, True, False]
    for g in range(4):
        alone = run(cfg, teacher, [g], p[g:g + 1])
        assert torch.allclose(packed.x[10 * g:10 * (g + 1)], alone.x, atol=1e-5), f"group {g}"
        # the loss curves are per group means; the packed curve is the mean of the four
        assert len(alone.history[-1]["ce"]) == len(packed.history[-1]["ce"]) == 6
    images, ce, bn = final_images(packed, [teacher])
    assert images.shape == (40, 1, 8, 8) and ce.shape == (40,) and bn.shape == (40,)


def test_packed_groups_really_get_different_crops(teacher_model):
    """Guard against a packing that gives every group the same view: two groups with the same
    patches but different IPC indices (hence different random streams) must end differently."""
    cfg = cfg_for()
    p = patches(1).repeat(2, 1, 1, 1, 1)
    state = run(cfg, FrozenTeacher(teacher_model), [0, 1], p)
    assert not torch.allclose(state.x[:10], state.x[10:], atol=1e-2)


def test_packed_loss_curve_is_the_mean_of_the_separate_curves(teacher_model):
    cfg = cfg_for(k=0, alpha=1.0, stage_resolutions=None, iterations=5)
    teacher = FrozenTeacher(teacher_model)
    p = patches(2)
    packed = run(cfg, teacher, [0, 1], p)
    a, b = run(cfg, teacher, [0], p[:1]), run(cfg, teacher, [1], p[1:])
    for key in ("ce", "bn"):
        expected = [(u + v) / 2 for u, v in zip(a.history[0][key], b.history[0][key])]
        assert packed.history[0][key] == pytest.approx(expected, rel=1e-4)


def test_bf16_packed_and_separate_runs_reach_the_same_losses(teacher_model):
    cfg = cfg_for(precision="bf16")
    teacher = FrozenTeacher(teacher_model)
    p = patches(4)
    packed = run(cfg, teacher, [0, 1, 2, 3], p)
    _, ce_p, bn_p = final_images(packed, [teacher])
    alone = [run(cfg, teacher, [g], p[g:g + 1]) for g in range(4)]
    ce_a = torch.cat([final_images(s, [teacher])[1] for s in alone])
    assert torch.isfinite(packed.x).all() and packed.x.dtype == torch.float32
    assert ce_p.mean().item() == pytest.approx(ce_a.mean().item(), rel=0.05, abs=0.02)


# --------------------------------------------------------------------------- layout, precision, config
def test_channels_last_and_contiguous_runs_agree(teacher_model):
    teacher = FrozenTeacher(teacher_model)
    p = patches(2)
    a = run(cfg_for(channels_last=True, iterations=12), teacher, [0, 1], p)
    b = run(cfg_for(channels_last=False, iterations=12), teacher, [0, 1], p)
    assert torch.allclose(a.x, b.x, atol=1e-4)
    assert a.history[-1]["ce"] == pytest.approx(b.history[-1]["ce"], rel=1e-4)


def test_speed_fields_are_validated():
    assert DistillConfig().channels_last is True and DistillConfig().compile is False
    for field in ("channels_last", "compile"):
        with pytest.raises(ConfigError, match=field):
            DistillConfig(**{field: "yes"})
    assert DistillConfig.from_dict(DistillConfig(compile=True).to_dict()).compile is True


def test_converged_timing_still_stops_early_with_the_curve_buffer(teacher_model):
    cfg = cfg_for(iterations=40, arc_timing="converged", arc_ce_threshold=100.0, arc_bn_threshold=1e9)
    state = run(cfg, FrozenTeacher(teacher_model), [0], patches(1))
    assert [h["iterations"] for h in state.history] == [1, 1, 1, 37]
    assert [len(h["ce"]) for h in state.history] == [1, 1, 1, 37]


def test_zero_iteration_stage(teacher_model):
    cfg = DistillConfig(iterations=0, k=0, alpha=1.0, precision="fp32").resolve(8, 10, hflip=False, channels=1)
    state = run(cfg, FrozenTeacher(teacher_model), [0], patches(1))
    assert state.history[0]["ce"] == [] and state.history[0]["iterations"] == 0


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_loss_matches_eager(teacher_model):
    """Stages at 6 and 7 px make convnet-bn's ceil_mode pools overhang, where Inductor's own
    pooling backward is wrong (pytorch/pytorch#198119); recover routes around it."""
    teacher = FrozenTeacher(teacher_model)
    p = patches(2)
    eager = run(cfg_for(iterations=8), teacher, [0, 1], p)
    compiled = run(cfg_for(iterations=8, compile=True), teacher, [0, 1], p)
    assert torch.allclose(eager.x, compiled.x, atol=1e-4)
    for e, c in zip(eager.history, compiled.history):
        assert c["ce"] == pytest.approx(e["ce"], rel=1e-5) and c["bn"] == pytest.approx(e["bn"], rel=1e-5)


# --------------------------------------------------------------------------- the benchmark's reference
def test_bench_reference_loop_lowers_the_loss_like_the_engine(teacher_model):
    from bench.speed.reference_loop import image_losses, reference_recover

    cfg = cfg_for(iterations=40)
    p = patches(1)
    labels = torch.tensor(CLASSES)
    model = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=8, width=16)
    model.load_state_dict(teacher_model.state_dict())
    model.eval()
    x = reference_recover(model, p[0], labels, cfg, MEAN, STD, seed=0)
    assert not any(q.requires_grad for q in model.parameters())  # frozen, as the published loop freezes it
    assert x.shape == (10, 1, 8, 8) and torch.isfinite(x).all()
    lo, hi = (0 - MEAN[0]) / STD[0], (1 - MEAN[0]) / STD[0]
    assert x.min() >= lo - 1e-6 and x.max() <= hi + 1e-6
    to_u8 = lambda v: ((v * STD[0] + MEAN[0]).clamp(0, 1) * 255).round().to(torch.uint8)  # noqa: E731
    before = image_losses(model, p[0], labels, MEAN, STD, 10)
    after = image_losses(model, to_u8(x), labels, MEAN, STD, 10)
    assert after["bn_mean"] < before["bn_mean"]
    engine = run(cfg, FrozenTeacher(teacher_model), [0], p)
    images, ce, bn = final_images(engine, [FrozenTeacher(teacher_model)])
    mine = image_losses(model, images, labels, MEAN, STD, 10)
    assert mine["ce_mean"] == pytest.approx(ce.mean().item(), rel=1e-4)  # the same measure as final_images
    assert mine["bn_mean"] == pytest.approx(bn.mean().item(), rel=1e-4)
    assert math.isclose(after["bn_mean"], mine["bn_mean"], rel_tol=0.5)  # same method, different draws


def test_bench_imagenet_timing_runs_in_its_tiny_cpu_form():
    """What bench/gpu_check.sh runs on a GPU, CPU-sized: ResNet-18, MRO stages (the side-by-side's
    at 32 px), packing."""
    from bench.speed.contender import stage_sizes
    from bench.speed.imagenet import ImagenetTiming, imagenet_timing

    info = imagenet_timing(ImagenetTiming(device="cpu", packs=[1, 2], iterations=4, precisions=["fp32"], tiny=True),
                           log=lambda m: None)
    assert [r["pack"] for r in info["runs"]] == [1, 2]
    for r in info["runs"]:
        assert r["finite"] and r["resolutions"] == stage_sizes(32) == [29, 32, 29, 32] and r["images_per_step"] == 10 * r["pack"]
        assert r["seconds_per_image_at_T2000"] == pytest.approx(r["seconds"] / 4 * 2000 / r["images_per_step"])


def test_the_fp16_check_fails_without_the_gradient_scaler():
    """bench/gpu_check.sh's checks take the fp16 step as the run takes it, its GradScaler scaling
    the loss and unscaling the gradient. At the gradients' size of a 224-px batch (here a narrow
    convnet at 224 px, batch 16, through the CPU's fp16 autocast) the statistics term's gradient
    underflows in fp16 without the scaler: the same check then fails."""
    from bench.gpu_steps import compare, gradients, judge

    torch.manual_seed(0)
    teacher = FrozenTeacher(create_model("convnet-bn", 16, in_chans=3, image_size=224, width=4, depth=2))
    view, labels = torch.randn(16, 3, 224, 224), torch.arange(16)

    def cfg(precision):
        return DistillConfig(classes=list(range(16)), precision=precision).resolve(224, 16, True, channels=3)

    def fp16():
        return torch.autocast("cpu", dtype=torch.float16)

    ref = gradients(teacher, view, labels, cfg("fp32"))
    scaled = compare(gradients(teacher, view, labels, cfg("fp16"), (fp16, torch.amp.GradScaler("cpu"))), ref)
    unscaled = compare(gradients(teacher, view, labels, cfg("fp16"), (fp16, None)), ref)
    assert judge("fp16", "fp16", scaled) == []
    assert scaled["grad_stat_rel"] < 0.01
    failures = judge("fp16 without its scaler", "fp16", unscaled)
    assert any("grad_stat_rel" in f for f in failures), failures


STANDIN = Path(__file__).resolve().parent / "data" / "published-standin"


def _gpu_check(tmp_path, *args, kill=None, official=STANDIN):
    """bench/gpu_check.sh --dry-run with the published code present (the stand-in under
    tests/data: the branch a GPU run with .official takes)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHON": sys.executable, "FADRM_OFFICIAL": str(official)}
    env.pop("OUT", None)
    if kill:
        env["FADRM_GPU_CHECK_KILL"] = kill
    return subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), "--dry-run", *args, str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=900, env=env)


def _steps(folder) -> dict:
    import json

    return {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


PUBLISHED = {"official", "official-benchmark", "official-like"}
OURS = {"ours-eager-pack1", "ours-fast-pack1", "ours-fast-packed"}


def test_gpu_check_takes_the_published_branch_keeps_a_killed_steps_figures_and_stays_in_budget(tmp_path):
    """The GPU run's path, CPU-sized: side_by_side with the published loop (the stand-in) among
    its contenders, every figure kept as measured; the checks step killed after its first figure
    keeps it and the step after it still runs; the printed budgets fit a rerun in one lease."""
    import re

    proc = _gpu_check(tmp_path, "--only", "checks,side_by_side", kill="checks:1")
    assert proc.returncode != 0  # a step was killed: the run says so
    steps = _steps(tmp_path)
    assert set(steps) == {"checks", "side_by_side"}
    checks = steps["checks"]
    assert not checks["ok"] and "over its budget" in checks["error"] and "result" not in checks
    assert [m["kind"] for m in checks["measured"]] == ["precision_path"]  # what it had measured when killed
    sbs = steps["side_by_side"]
    assert sbs["ok"], sbs.get("error")
    result = sbs["result"]
    assert set(result["contenders"]) == PUBLISHED | OURS
    assert result["published_best"] in PUBLISHED and result["official_ms"] > 0
    assert set(result["ratios"]) == PUBLISHED and set(result["ratios"]["official"]) == OURS
    assert result["contenders"]["ours-fast-packed"]["pack"] == 2
    assert "fast_is_eager" in result  # the dry run compiles nothing and says so
    assert {n for n, c in result["contenders"].items() if "schedule" in c} == \
        {"official-like", "ours-eager-pack1", "ours-fast-pack1"}
    assert result["contenders"]["official-like"]["schedule"]["steps"] == 16
    # each figure recorded as it was measured: every contender's warm-up and round, schedules, profiles
    measured = sbs["measured"]
    assert {m["contender"] for m in measured if m["kind"] == "round"} == PUBLISHED | OURS
    assert {m["contender"] for m in measured if m["kind"] == "profile"} == {"official", "ours-eager-pack1",
                                                                          "ours-fast-pack1"}
    assert (tmp_path / "profiles" / "official" / "summary.json").is_file()  # in the folder that comes back
    assert not list(tmp_path.glob("*.jsonl"))  # folded into the JSON
    log = (tmp_path / "gpu_check.log").read_text()
    assert f"side_by_side: the published loop from {STANDIN}" in log and "FAILED: checks" in log
    whole, core = (int(v) for v in re.search(r"(\d+) s for the whole check \(at most 330\), (\d+) s with --core", log).groups())
    assert whole <= 330 and core <= 200


@pytest.mark.slow
def test_gpu_check_script_dry_run(tmp_path):
    proc = _gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = _steps(tmp_path)
    assert [p.name for p in sorted(tmp_path.glob("*.json"))] == [
        "0-env.json", "1-checks.json", "2-side_by_side.json", "3-end_to_end.json", "4-students.json", "5-share.json"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".json")) == ["gpu_check.log", "profiles"]
    result = {name: s["result"] for name, s in steps.items()}
    assert steps["env"]["result"]["versions"]["ray"] and not steps["env"]["result"]["missing"]
    e2e = result["end_to_end"]
    assert e2e["images"] == 20 and e2e["workers"] == 2 and e2e["student_seconds_per_epoch"] > 0
    assert [m["kind"] for m in steps["end_to_end"]["measured"]] == ["import_teacher", "distill"]
    assert {r["precision"] for r in result["checks"]["precision_paths"]} == {"bf16", "fp32"}
    compared = result["checks"]["fast_vs_eager"]
    assert compared["eager bf16"]["grad_stat_rel"] < 0.5 and compared["fast"].startswith("not compared")
    sbs = result["side_by_side"]
    assert set(sbs["contenders"]) == PUBLISHED | OURS and sbs["ours_pack1_ms"] > 0 and sbs["ours_fast_pack1_ms"] > 0
    assert set(sbs["profiles"]) == {"official", "ours-eager-pack1", "ours-fast-pack1"}
    assert sbs["profiles"]["ours-eager-pack1"]["op_calls_per_step"] > 0
    assert result["students"]["runs"][0]["seconds_per_epoch"] > 0 and result["share"]["processes"] == 2
    assert len(steps["share"]["measured"]) == 1 and len(steps["students"]["measured"]) == 1
