"""The accelerator path never waits on the device inside a step, shown on a CPU.

A recover stage and a student epoch run on the `meta` device, where tensors have shapes and no
values: reading a value back (`.item()`, a tensor's truth value, `.tolist()`, `.cpu()`,
`.numpy()`) raises. A dispatch mode adds what meta lets through but a GPU would pay for with a
host sync: a host tensor (not a 0-d scalar) mixed into an operation on device tensors (indexing a
device tensor with a host index copies the index synchronously), and a blocking host-to-device
copy once the steps have started (`non_blocking=False` synchronizes with the device's queue).

Each run is then expected to reach its first read of a value exactly where one is allowed: a
stage reads its loss curves once it has run all its steps; a student reads its test top-1 after
the epoch. Everything before that, every step, ran without one.
"""
from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fadrm_ray.config import DistillConfig, EvalConfig
from fadrm_ray.data.base import ImageDataset, Split
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.hard_labels import HardLabels
from fadrm_ray.evaluation.relabel import AugmentSpec, SoftLabeler, ViewPlan, apply_plan, cut_views, draw_plan
from fadrm_ray.evaluation.training import train_student
from fadrm_ray.models import create_model
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.recover import init_state, run_stage

aten = torch.ops.aten
META = torch.device("meta")


class HostSync(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Raises where an operation would make the host wait for a device (module docstring);
    `started` (set once the first step is done) forbids blocking copies to the device."""

    def __init__(self):
        super().__init__()
        self.started = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if func is aten._to_copy.default and kwargs.get("device") == META and host:
            if self.started and not kwargs.get("non_blocking", False):
                raise HostSync(f"a blocking copy to the device inside the steps ({tuple(host[0].shape)})")
        elif func is aten.copy_.default and args[0].device == META and host:
            if self.started and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                raise HostSync("a blocking copy to the device inside the steps")
        elif host and any(t.device == META for t in tensors):
            raise HostSync(f"{func} mixes a host tensor of shape {tuple(host[0].shape)} into a device operation")
        return func(*args, **kwargs)


class OnMeta(EvalSpec):
    """Students on the meta device (the product refuses any device but cpu and cuda)."""

    def on_device(self) -> str:
        return "meta"


@pytest.fixture
def guard():
    mode = NoHostSync()
    steps = []

    def on_step(optimizer, args, kwargs):
        steps.append(1)
        mode.started = True

    handle = register_optimizer_step_post_hook(on_step)
    try:
        with mode:
            yield mode, steps
    finally:
        handle.remove()


def test_the_guard_catches_what_a_gpu_would_wait_for():
    x = torch.zeros(4, 3, device=META)
    with NoHostSync() as mode:
        mode.started = True
        with pytest.raises(HostSync, match="mixes a host tensor"):
            x[torch.tensor([1, 0])]
        with pytest.raises(HostSync, match="blocking copy"):
            torch.tensor([1, 2]).to(META)
        torch.tensor([1, 2]).to(META, non_blocking=True)  # queued behind the device's work: allowed
        x[torch.tensor([1, 0]).to(META, non_blocking=True)]
        with pytest.raises(RuntimeError):
            x.sum().item()
        with pytest.raises(Exception):
            x.tolist()


def _dataset(n=24, size=12, classes=4) -> ImageDataset:
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)
    test = torch.randint(0, 256, (8, 3, size, size), dtype=torch.uint8, generator=gen)
    return ImageDataset(name="random", class_names=[str(c) for c in range(classes)], image_size=size, channels=3,
                        mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), train=Split.in_memory(images, torch.arange(n) % classes),
                        test=Split.in_memory(test, torch.arange(8) % classes), hflip=True)


def test_a_recover_stage_reads_nothing_back_until_its_steps_are_done(guard):
    mode, _ = guard
    torch.manual_seed(0)
    teacher = FrozenTeacher(create_model("convnet-bn", num_classes=4, in_chans=3, image_size=12, width=8).to(META))
    cfg = DistillConfig(iterations=6, ipc=2, k=1, precision="fp32", stage_resolutions=[12, 12], lr=0.1,
                        crop_scale_min=0.5).resolve(12, 4, hflip=True, channels=3)
    patches = torch.randint(0, 256, (2, 4, 3, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    state = init_state(cfg, [0, 1, 2, 3], [0, 1], patches, 12, 3, [0.5] * 3, [0.25] * 3)
    budget, done = state.budgets[0], []

    def on_step(n):
        done.append(n)
        mode.started = True

    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
        run_stage(state, [teacher], cfg, META, on_step=on_step)
    assert len(done) == budget > 1  # every step ran; the first read is the stage's loss curves


@pytest.mark.parametrize("labels", ["soft", "hard"])
def test_a_student_epoch_reads_nothing_back_until_its_test(guard, labels):
    _, steps = guard
    dataset = _dataset()
    torch.manual_seed(0)
    teacher = create_model("convnet-bn", num_classes=4, in_chans=3, image_size=12, width=8)
    labeler = SoftLabeler([teacher], [dataset.mean], [dataset.std], [3], ids=["t"], device=META)
    images, image_labels = dataset.train.load(torch.arange(24)), dataset.train.labels
    parts = EvalParts(dataset=dataset, labeler=labeler,
                      targets=HardLabels(image_labels) if labels == "hard" else None)
    job = EvalJob(config=EvalConfig(student="convnet-bn", student_kwargs={"width": 8}, epochs=1, seeds=[0],
                                    batch_size=8))
    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
        train_student(images, 0, job, OnMeta(progress=False), parts)
    assert len(steps) == 3  # the epoch's 3 steps ran; the first read is the test top-1 after it


def test_the_batched_views_are_the_per_image_views():
    gen = torch.Generator().manual_seed(3)
    images01 = torch.rand(6, 3, 20, 20, generator=gen)
    for out_size, spec in ((20, AugmentSpec(out_size=20, hflip=True)), (16, AugmentSpec(out_size=16, hflip=True,
                                                                                        crop_scale=(0.05, 0.3)))):
        for _ in range(10):
            plan = draw_plan(torch.randperm(6, generator=gen), 20, 20, spec, gen)
            assert torch.allclose(cut_views(images01, plan, out_size), apply_plan(images01, plan, out_size), atol=2e-6)
    # a crop of the whole image, unflipped and unmixed, is the image itself
    whole = ViewPlan(indices=torch.arange(6), boxes=torch.tensor([[0, 0, 20, 20]] * 6), flips=torch.zeros(6, dtype=torch.bool),
                     partner=torch.arange(6), mix_box=(0, 0, 0, 0), lam=1.0)
    assert torch.allclose(cut_views(images01, whole, 20), images01, atol=1e-6)
