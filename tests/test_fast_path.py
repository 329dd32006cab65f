"""The engine's fast path (`packing.fast_path`: the teacher's loss compiled, as CUDA graphs on a
GPU) and the eager step's held low-precision weights change speed, not what a run computes.

- weights held in the autocast dtype for a stage give bit-identical logits, losses and input
  gradients, and are handed back as they were;
- the statistics-matching loss taken in one pass equals the per-layer formula, with its gradient;
- on the fast path: a run equals the eager run within float tolerance; a group's images do not
  depend on the groups it is packed with; a stage resumed in another process continues exactly.

The tests that compile (torch.compile on the CPU, minutes each) are marked `compile`: a lane of
their own in .ci/run.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torchvision

from fadrm_ray.config import DistillConfig
from fadrm_ray.packing import fast_path
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.layout import RunLayout
from fadrm_ray.runs.stages import checkpoint_of, states_of
from fadrm_ray.store.checkpoints import load_checkpoint, save_checkpoint
from fadrm_ray.recover import init_state, low_precision_dtype, recover, run_stage

pytestmark = pytest.mark.usefixtures("one_thread")

MEAN, STD = [0.3], [0.37]
CLASSES = list(range(10))


def cfg_for(**kw) -> DistillConfig:
    base = dict(iterations=8, ipc=3, precision="fp32", k=1, alpha=0.5, stage_resolutions=[8, 8], lr=0.25,
                crop_scale_min=0.08)
    return DistillConfig(**{**base, **kw}).resolve(8, 10, hflip=True, channels=1)


def patches(groups: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (groups, 10, 1, 8, 8), dtype=torch.uint8, generator=gen)


def recovered(cfg, teacher, ipc_indices, all_patches):
    state = init_state(cfg, CLASSES, ipc_indices, all_patches[ipc_indices], 8, 1, MEAN, STD)
    return recover(state, [teacher], cfg)


def test_low_precision_weights_held_for_a_stage_are_bit_identical_to_autocast():
    torch.manual_seed(1)
    model = torchvision.models.resnet18(num_classes=10).eval()
    teacher = FrozenTeacher(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x0 = torch.randn(6, 3, 32, 32)
    results = []
    for hold in (False, True):
        x = x0.clone().requires_grad_(True)
        with teacher.weights_in(low_precision_dtype("bf16") if hold else None):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, bn = teacher(x, groups=2)
            (logits.float().sum() + bn.sum()).backward()
        results.append((logits, bn, x.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    held = []
    for _ in range(2):  # each stage holds the same cast copies (a captured CUDA graph's weights stay put)
        with teacher.weights_in(torch.bfloat16):
            held.append(model.conv1.weight.data_ptr())
            assert model.conv1.weight.dtype == torch.bfloat16 and model.bn1.weight.dtype == torch.float32
    assert held[0] == held[1] != model.conv1.weight.data_ptr()
    assert low_precision_dtype("fp32") is None and low_precision_dtype("fp16") == torch.float16


def test_the_statistics_loss_in_one_pass_equals_the_per_layer_formula():
    torch.manual_seed(2)
    model = torchvision.models.resnet18(num_classes=10).eval()
    for bn in model.modules():
        if isinstance(bn, torch.nn.BatchNorm2d):  # running statistics far from an untrained net's
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    teacher = FrozenTeacher(model, first_bn_weight=10.0)
    x = torch.randn(6, 3, 32, 32, requires_grad=True)
    _, fused = teacher(x, groups=3)
    fused.sum().backward()
    teacher.remove_hooks()
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((m, i[0]))) for m in teacher.bn_layers]
    y = x.detach().clone().requires_grad_(True)
    model(y)
    for h in hooks:
        h.remove()
    plain = 0
    for i, (m, a) in enumerate(seen):
        a = a.reshape(3, 2, *a.shape[1:])
        mean, var = a.mean(dim=(1, 3, 4)), a.var(dim=(1, 3, 4), unbiased=False)
        plain = plain + (10.0 if i == 0 else 1.0) * (torch.linalg.vector_norm(mean - m.running_mean, dim=1)
                                                     + torch.linalg.vector_norm(var - m.running_var, dim=1))
    plain.sum().backward()
    assert torch.allclose(fused, plain, rtol=1e-5)
    assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-6 * y.grad.abs().max())


def test_the_fast_path_compiles_and_on_cuda_replays_graphs():
    assert fast_path("cpu") == {"compile": True, "cuda_graphs": False}
    assert fast_path("cuda") == {"compile": True, "cuda_graphs": True}
    cfg = DistillConfig(**fast_path("cuda"))
    assert cfg.identity() == DistillConfig().identity()  # speed settings: the same run


@pytest.fixture(scope="module")
def fast_packed(teacher_model):
    """Three groups recovered together on the fast path (compiled once for the two tests below)."""
    from fadrm_ray.runtime import torch_threads

    with torch_threads(1):
        return recovered(cfg_for(**fast_path("cpu")), FrozenTeacher(teacher_model), [0, 1, 2], patches(3))


@pytest.mark.compile
def test_a_run_on_the_fast_path_equals_the_eager_run(teacher_model, fast_packed):
    teacher = FrozenTeacher(teacher_model)
    p = patches(3)
    eager = recovered(cfg_for(), teacher, [0, 1, 2], p)
    fast = fast_packed
    # Compiled kernels fuse and reorder float sums: equal to rounding, not bit for bit.
    assert torch.allclose(eager.x, fast.x, atol=1e-4)
    for e, f in zip(eager.history, fast.history):
        assert f["ce"] == pytest.approx(e["ce"], rel=1e-4) and f["bn"] == pytest.approx(e["bn"], rel=1e-4)


@pytest.mark.compile
def test_a_groups_images_do_not_depend_on_its_packing_on_the_fast_path(teacher_model, fast_packed):
    teacher = FrozenTeacher(teacher_model)
    packed = fast_packed
    alone = recovered(cfg_for(**fast_path("cpu")), teacher, [1], patches(3))
    assert torch.allclose(packed.x[10:20], alone.x, atol=1e-4)
    assert not torch.allclose(packed.x[0:10], alone.x, atol=1e-2)  # the groups are different images


@pytest.mark.compile
def test_a_stage_resumed_in_another_process_on_the_fast_path_continues_exactly(teacher_model, tmp_path):
    model = teacher_model
    torch.save(model.state_dict(), tmp_path / "teacher.pt")
    cfg = cfg_for(**fast_path("cpu"))
    teacher = FrozenTeacher(model)
    p = patches(2)
    state = init_state(cfg, CLASSES, [0, 1], p[[0, 1]], 8, 1, MEAN, STD)
    run_stage(state, [teacher], cfg)
    layout = RunLayout(tmp_path / "run")
    save_checkpoint(layout, *checkpoint_of("u0", [state]))
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    here = run_stage(state, [teacher], cfg)
    code = textwrap.dedent(f"""
        import torch
        from fadrm_ray.config import DistillConfig
        from fadrm_ray.models import create_model
        from fadrm_ray.frozen_teacher import FrozenTeacher
        from fadrm_ray.recover import run_stage
        torch.set_num_threads(1)
        model = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=8, width=16)
        model.load_state_dict(torch.load({str(tmp_path / "teacher.pt")!r}))
        cfg = DistillConfig.model_validate_json(open({str(tmp_path / "cfg.json")!r}).read())
        from fadrm_ray.layout import RunLayout
        from fadrm_ray.runs.stages import checkpoint_of, states_of
        from fadrm_ray.store.checkpoints import load_checkpoint, save_checkpoint
        layout = RunLayout({str(tmp_path / "run")!r})
        (state,) = states_of(*load_checkpoint(layout, "u0", 1))
        run_stage(state, [FrozenTeacher(model.eval())], cfg)
        save_checkpoint(layout, *checkpoint_of("u0", [state]))
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    (there,) = states_of(*load_checkpoint(layout, "u0", 2))
    assert torch.equal(there.x, here.x)
    assert there.iteration == here.iteration and there.stage == here.stage
    assert all(torch.equal(a, b) for a, b in zip(there.rng_states, here.rng_states))
    assert there.history[-1]["ce"] == here.history[-1]["ce"]


def _activations(model, x, layers):
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(i[0])) for m in layers]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("read_half", [False, True])
def test_half_precision_statistics_are_as_close_to_exact_as_an_fp32_copy_and_save_no_copy(read_half):
    """`statistics.moments` of bf16 activations (both ways: the CPU's over a transient fp32 copy, the
    GPU's reading half with fp32 accumulation) against the exact statistics of the same values;
    the gradient, written in bf16, the fp32 formula's rounded once; and a bf16 step saves no fp32
    copy of any activation. The random teacher's last layers have channels whose mean is over 100
    times their spread: the hardest case for E[a^2] - mean^2."""
    from fadrm_ray.statistics import LayerStatistics, _grouped, moments

    torch.manual_seed(3)
    model = torchvision.models.resnet18(num_classes=10).eval()
    teacher = FrozenTeacher(model)
    x = torch.randn(8, 3, 32, 32) * 2 + 0.5
    acts = [a.detach().to(memory_format=torch.channels_last) for a in _activations(model, x, teacher.bn_layers)]
    for a in acts:
        v, _ = _grouped(a.bfloat16(), 2)
        exact_mean, exact_var = moments(v.double().float())  # the statistics of the bf16 values themselves
        mean, var = moments(v, read_half=read_half)
        assert mean.dtype == var.dtype == torch.float32
        assert torch.allclose(mean, exact_mean, rtol=1e-5, atol=1e-5 * float(exact_var.sqrt().mean()))
        # E[a^2] - mean^2 loses what fp32 loses of E[a^2]: a channel whose mean is many times its
        # spread keeps its variance to within 1e-5 of E[a^2], not of itself
        second = exact_var + exact_mean.view(exact_var.shape) ** 2
        assert ((var - exact_var).abs() <= 1e-4 * exact_var + 1e-5 * second).all()
    # the gradient, written in bf16, is the fp32 formula's rounded once
    low = [a.bfloat16().requires_grad_(True) for a in acts]
    m, v = LayerStatistics.apply(2, *low)
    (m.square().sum() + v.sum()).backward()
    ref = [a.detach().float().requires_grad_(True) for a in low]
    m32, v32 = LayerStatistics.apply(2, *ref)
    (m32.square().sum() + v32.sum()).backward()
    for a, r in zip(low, ref):
        assert a.grad.dtype == torch.bfloat16
        assert torch.allclose(a.grad.float(), r.grad.bfloat16().float(), rtol=2e-2, atol=1e-3 * float(r.grad.abs().max()))
    # saved for the backward of a bf16 step: nothing in fp32 the size of an activation
    saved = []
    sizes = {a.numel() for a in acts}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        view = x.clone().requires_grad_(True)
        with teacher.weights_in(torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16):
            _, bn = teacher(view, groups=2)
    assert saved and not [s for s in saved if s[0] == torch.float32 and s[1] in sizes]


@pytest.mark.compile
@pytest.mark.parametrize("model_name", ["convnet-bn", "resnet18"])
def test_the_fast_path_really_compiles_without_a_graph_break(model_name):
    """No silent fallback to eager: the teacher's loss compiles to one graph, in fp32 and bf16, and
    its losses and input gradient equal the eager step's (fp32 to rounding; bf16 as close to the
    fp32 step as the eager bf16 step is)."""
    import warnings

    from torch._dynamo.utils import counters

    from fadrm_ray.models import create_model
    from fadrm_ray.recover import held_dtype, mixed_precision, step_loss, teacher_loss

    torch.manual_seed(0)
    model = create_model(model_name, num_classes=10, in_chans=3, image_size=16).eval()
    teacher = FrozenTeacher(model)
    view = torch.randn(10, 3, 16, 16)
    labels = torch.arange(10)

    def one_step(precision, fast):
        cfg = DistillConfig(precision=precision, **(fast_path("cpu") if fast else {})).resolve(16, 10, True, "cpu",
                                                                                              channels=3)
        autocast, _ = mixed_precision(cfg.precision, torch.device("cpu"))
        fn = teacher_loss(teacher, cfg)
        x = view.clone().requires_grad_(True)
        with teacher.weights_in(held_dtype(cfg)):  # held for the backward too, as a stage of recover holds them
            with autocast():
                ce, bn, stat = step_loss(fn, x, labels, 2, cfg)
            (ce + stat).sum().backward()
        return ce.detach().float(), bn.detach().float(), x.grad

    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback warns: make it fail here
        results = {(p, f): one_step(p, f) for p in ("fp32", "bf16") for f in (False, True)}
    assert counters["stats"]["unique_graphs"] >= 2  # one per precision (and memory format)
    assert not counters["graph_break"], dict(counters["graph_break"])
    ref = results[("fp32", False)]
    for a, b in zip(results[("fp32", True)], ref):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    eager, fast = results[("bf16", False)], results[("bf16", True)]
    for e, f, r in zip(eager, fast, ref):
        assert rel(f, r) <= 1.5 * rel(e, r) + 0.02
