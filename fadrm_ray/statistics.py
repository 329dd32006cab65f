"""Per-group feature statistics, the convolution-statistics loss of G-VBSM and EDC, and EDC's
class-wise BatchNorm targets.

`GroupStats` is the one place that measures the channel mean and variance of an activation
per group (the BatchNorm loss of recover.py and the convolution loss here both use it).

The convolution loss (docs/method.md section 7c) compares the channel statistics of each
convolution's *input* with the same statistics of the real training images, computed once per
teacher by `real_conv_targets`: ||mu - mu_real||_2 + ||var - var_real||_2 per layer, the first
convolution weighted `first_bn_weight`, as the BN loss weights its first layer. The input, not
the output, is matched because in a conv -> BN network a convolution's output is the next BN
layer's input, whose statistics the BN loss already matches; the input (after the previous
activation) is new information.

EDC's soft category-aware matching (`ClassStatistics`) measures, for every BN layer's input and
every class, the mean over that class's real images of each image's channel mean and of each
image's biased channel variance over its pixels (`real_class_bn_targets`). A batch's target is
the average over its labels; the BN loss of a layer becomes
(1 - w) * ||. - running||  +  w * ||. - class target||   (for the mean and the variance),
w = `bn_category`. EDC's released code weights the two halves equally (w = 0.5).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn

from fadrm_ray.data.parallel import prefetch
from fadrm_ray.models import match_channels
from fadrm_ray.errors import InputError

if TYPE_CHECKING:
    from fadrm_ray.recover import FrozenTeacher

# Real images per class the targets are measured on: enough for stable channel statistics of a
# small teacher, and a bounded cost on large datasets (the statistics are a mean over pixels).
CONV_STAT_IMAGES_PER_CLASS = 100
_BATCH = 256


class GroupStats(torch.autograd.Function):
    """Per-group channel mean and biased variance of an activation, in fp32: (G, C) each.

    The activation is the largest tensor of a step, and autograd's graph for `mean` and
    `((a - mean) ** 2).mean()` walks it five or six times in the backward. The gradient is
    affine in the centred activation d = a - mean for each (group, channel):
        dL/da = dL/dmean / n + 2 dL/dvar / n * d,
    so one fused pass (addcmul) computes it. This was the costliest part of a step on CPU.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, groups: int):
        v, channels_last = _grouped(a, groups)
        v = v.float()
        mean = v.mean(dim=(1, 3), keepdim=True)
        d = v - mean
        var = (d * d).mean(dim=(1, 3))
        ctx.save_for_backward(d)
        ctx.shape, ctx.channels_last, ctx.dtype = a.shape, channels_last, a.dtype
        return mean.view(var.shape), var

    @staticmethod
    def backward(ctx, grad_mean: torch.Tensor, grad_var: torch.Tensor):
        d, = ctx.saved_tensors
        n = d.shape[1] * d.shape[3]
        grad = torch.addcmul((grad_mean / n)[:, None, :, None], d, (grad_var * (2.0 / n))[:, None, :, None])
        if ctx.channels_last:  # back from (G, B*H*W, C, 1) to an (N, C, H, W) channels-last tensor
            n_, c, h, w = ctx.shape
            grad = grad.view(n_, h, w, c).permute(0, 3, 1, 2)
        else:
            grad = grad.view(ctx.shape)
        return grad.to(ctx.dtype), None


class StatisticsLoss:
    """The statistics-matching loss of a set of layers, taken in one pass after the forward.

    Per group: sum over layers l of w_l * (||mean_l - target_mean_l||_2 + ||var_l - target_var_l||_2),
    w_0 = `first_weight`, every other w_l = 1 (docs/method.md section 3). The hooks only measure
    each layer's (G, C_l) statistics (`GroupStats`) and hand them to `add`; `loss` then scatters
    the differences of every layer into one zero-padded (G, layers, C_max) tensor and takes all
    the norms at once, instead of a dozen small ops per layer on every step. The zero padding
    adds nothing to a norm, and the norm's gradient at zero is zero, so a layer that matches its
    target exactly stays harmless. EDC's class-wise targets (`ClassStatistics`) blend in per layer.
    A layer seen twice in one forward counts twice, as each of its inputs does.
    """

    def __init__(self, targets: Sequence[tuple[torch.Tensor, torch.Tensor]], first_weight: float = 10.0):
        self.sizes = [int(m.numel()) for m, _ in targets]
        self.first_weight = float(first_weight)
        self.targets = [(m.detach().float().reshape(-1), v.detach().float().reshape(-1)) for m, v in targets]
        self.category: "ClassStatistics | None" = None
        self._seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._plans: dict[tuple, tuple] = {}

    def prepare(self, device: str | torch.device) -> None:
        """Build the gather plan of a forward that runs every layer once, in order, on `device`,
        outside any compiled region (a plan built while torch.compile traces would recompile)."""
        self._plan(tuple(range(len(self.sizes))), torch.device(device))

    def add(self, index: int, mean: torch.Tensor, var: torch.Tensor) -> None:
        """Layer `index`'s per-group statistics of this forward, (G, C) each."""
        self._seen.append((index, mean, var))

    def clear(self) -> None:
        self._seen = []

    def loss(self, labels: torch.Tensor | None = None) -> torch.Tensor | None:
        """The per-group loss (G,) of the statistics added since the last call (None if none);
        `labels` (G * B,) select the class-wise targets where they are attached."""
        seen, self._seen = self._seen, []
        if not seen:
            return None
        order = tuple(i for i, _, _ in seen)
        device = seen[0][1].device
        positions, t_mean, t_var, weights, width = self._plan(order, device)
        means = torch.cat([m for _, m, _ in seen], dim=1)
        variances = torch.cat([v for _, _, v in seen], dim=1)
        running = self._norms(means - t_mean, positions, len(order), width) + \
            self._norms(variances - t_var, positions, len(order), width)
        if self.category is not None and labels is not None:
            c_mean, c_var = self.category.targets_of(order, labels, means.shape[0], device)
            per_class = self._norms(means - c_mean, positions, len(order), width) + \
                self._norms(variances - c_var, positions, len(order), width)
            running = (1 - self.category.weight) * running + self.category.weight * per_class
        return (running * weights).sum(dim=1)

    @staticmethod
    def _norms(diff: torch.Tensor, positions: torch.Tensor, entries: int, width: int) -> torch.Tensor:
        padded = diff.new_zeros(diff.shape[0], entries * width).index_copy(1, positions, diff)
        return torch.linalg.vector_norm(padded.view(diff.shape[0], entries, width), dim=2)

    def _plan(self, order: tuple[int, ...], device: torch.device) -> tuple:
        key = (order, str(device))
        if key not in self._plans:
            width = max(self.sizes[i] for i in order)
            positions = torch.cat([torch.arange(self.sizes[i]) + e * width for e, i in enumerate(order)])
            t_mean = torch.cat([self.targets[i][0] for i in order])
            t_var = torch.cat([self.targets[i][1] for i in order])
            weights = torch.tensor([self.first_weight if i == 0 else 1.0 for i in order])
            self._plans[key] = (positions.to(device), t_mean.to(device), t_var.to(device), weights.to(device), width)
        return self._plans[key]


def _grouped(a: torch.Tensor, groups: int) -> tuple[torch.Tensor, bool]:
    """A (G, M, C, K) view of an activation whose statistics reduce over dims 1 and 3, without a
    copy for both contiguous and channels-last activations; and whether it was channels-last."""
    if a.dim() == 4 and not a.is_contiguous() and a.is_contiguous(memory_format=torch.channels_last):
        n, c, h, w = a.shape
        return a.permute(0, 2, 3, 1).reshape(groups, n // groups * h * w, c, 1), True
    return a.reshape(groups, a.shape[0] // groups, a.shape[1], -1), False


def conv_layers(model: nn.Module) -> list[nn.Conv2d]:
    return [m for m in model.modules() if isinstance(m, nn.Conv2d)]


def bn_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _batches(images) -> Iterable[torch.Tensor]:
    """Batches of `images`: a tensor (N, C, H, W) is cut into batches of `_BATCH`; anything else
    is taken as an iterable of such batches already."""
    return images.split(_BATCH) if isinstance(images, torch.Tensor) else images


def _visit_inputs(runs: Sequence[tuple[nn.Module, Sequence[nn.Module], int | None, Callable]],
                  batches: Iterable[torch.Tensor], device: str | torch.device) -> None:
    """Run every batch through each model of `runs` (model, layers, in_chans, visit), one batch
    at a time; `visit(i, a, start)` sees the fp64 input `a` of `layers[i]` for the batch that
    begins at image `start`."""
    start = 0

    def make(visit, i):
        def hook(module, inputs, output):
            visit(i, inputs[0].detach().double(), start)
        return hook

    hooks = [layer.register_forward_hook(make(visit, i))
             for _, layers, _, visit in runs for i, layer in enumerate(layers)]
    try:
        for batch in batches:
            x = batch.to(device)
            for model, _, in_chans, _ in runs:
                model(match_channels(x, in_chans) if in_chans is not None else x)
            start += x.shape[0]
    finally:
        for h in hooks:
            h.remove()


class ConvStatistics:
    """Hooks on a teacher's convolutions that measure the per-group convolution-statistics loss
    against fixed targets (one (mean, var) pair per convolution, from `real_conv_targets`)."""

    def __init__(self, model: nn.Module, targets: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 first_weight: float = 10.0):
        self.layers = conv_layers(model)
        if len(targets) != len(self.layers):
            raise ValueError(f"{len(targets)} convolution targets for {len(self.layers)} convolutions")
        self.targets = [(m.float(), v.float()) for m, v in targets]
        self.first_weight = first_weight
        self.groups = 0              # > 0 only while the owning teacher measures a view
        self.matching = StatisticsLoss(self.targets, first_weight)
        self._hooks = [layer.register_forward_hook(self._make_hook(i)) for i, layer in enumerate(self.layers)]

    def _make_hook(self, index: int):
        def hook(module, inputs, output):
            if self.groups:
                self.matching.add(index, *GroupStats.apply(inputs[0], self.groups))
        return hook

    def finish(self) -> torch.Tensor | None:
        """The per-group loss of the view measured since the last call (None if none was)."""
        return self.matching.loss()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


@torch.no_grad()
def real_conv_targets(model: nn.Module, images, in_chans: int | None = None,
                      device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Channel mean and biased variance of every convolution's input over all pixels of the
    normalized real `images` (N, C, H, W), or of an iterable of batches of them, in fp64 sums so
    the result does not depend on the batching. The model must be in eval mode (BN uses its
    running statistics)."""
    return _conv_targets([(model, in_chans)], _batches(images), device)[0]


def _conv_targets(models: Sequence[tuple[nn.Module, int | None]], batches: Iterable[torch.Tensor],
                  device: str | torch.device) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`real_conv_targets` of several models over one pass of the batches."""
    runs, all_sums = [], []
    for model, in_chans in models:
        layers = conv_layers(model)
        sums: list[list] = [[None, None, 0] for _ in layers]

        def visit(i, a, start, sums=sums):
            s = sums[i]
            part, part_sq = a.sum(dim=(0, 2, 3)), (a * a).sum(dim=(0, 2, 3))
            s[0] = part if s[0] is None else s[0] + part
            s[1] = part_sq if s[1] is None else s[1] + part_sq
            s[2] += a.shape[0] * a.shape[2] * a.shape[3]

        runs.append((model, layers, in_chans, visit))
        all_sums.append(sums)
    _visit_inputs(runs, batches, device)
    out = []
    for sums in all_sums:
        targets = []
        for total, total_sq, n in sums:
            mean = total / n
            targets.append((mean.float().cpu(), (total_sq / n - mean * mean).clamp_min(0).float().cpu()))
        out.append(targets)
    return out


def _statistics_indices(dataset, per_class: int) -> list[int]:
    labels = dataset.train.labels
    return sorted(int(i) for c in range(dataset.num_classes)
                  for i in torch.nonzero(labels == c, as_tuple=False).flatten()[:per_class])


def _real_batches(dataset, keep: list[int]) -> Iterator[torch.Tensor]:
    """The normalized images `keep` of the training split in batches of `_BATCH`; the next batch
    decodes while the teachers see this one."""
    for _, images in prefetch(dataset.train.load, torch.as_tensor(keep, dtype=torch.long).split(_BATCH)):
        yield dataset.normalize(images)


def _pending(teachers: Sequence["FrozenTeacher"], attribute: str) -> list["FrozenTeacher"]:
    """The teachers (each once) whose `attribute` is not measured yet."""
    out: list = []
    for teacher in teachers:
        if getattr(teacher, attribute) is None and not any(t is teacher for t in out):
            out.append(teacher)
    return out


def attach_conv_targets(teachers: Sequence["FrozenTeacher"], dataset, device: str | torch.device = "cpu") -> None:
    """Measure each teacher's convolution targets on the dataset's real images, once, and hook
    the loss onto it (recover's `r_conv` term). The images are read once for all teachers."""
    todo = _pending(teachers, "conv")
    if not todo:
        return
    keep = _statistics_indices(dataset, CONV_STAT_IMAGES_PER_CLASS)
    measured = _conv_targets([(t.model, t.in_chans) for t in todo], _real_batches(dataset, keep), device)
    for teacher, targets in zip(todo, measured):
        teacher.conv = ConvStatistics(teacher.model, targets, teacher.first_bn_weight)


class ClassStatistics:
    """Class-wise BN targets of one teacher (one (mean, var) pair of (K, C) tensors per BN layer)
    and the blend of the BN loss with them; the teacher's BN hooks call `blend`."""

    def __init__(self, targets: Sequence[tuple[torch.Tensor, torch.Tensor]], weight: float):
        if not 0 < weight <= 1:
            raise InputError(f"the class-wise share of the BN loss must be in (0, 1], got {weight}")
        self.targets = [(m.float(), v.float()) for m, v in targets]
        self.weight = float(weight)
        self._joined: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def targets_of(self, order: Sequence[int], labels: torch.Tensor, groups: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The average class target of each group's labels for the layers `order`, concatenated
        as `StatisticsLoss` concatenates the statistics: (G, sum of C) each; `labels` (G * B,).
        The loss blends (1 - w) * the running-statistics loss + w * the loss against these."""
        key = (tuple(order), str(device))
        if key not in self._joined:  # once: the targets then live where the activations do
            self._joined[key] = (torch.cat([self.targets[i][0] for i in order], dim=1).to(device),
                                 torch.cat([self.targets[i][1] for i in order], dim=1).to(device))
        c_mean, c_var = self._joined[key]
        picks = labels.view(groups, -1).to(device)
        return c_mean[picks].mean(dim=1), c_var[picks].mean(dim=1)


@torch.no_grad()
def real_class_bn_targets(model: nn.Module, images, labels: torch.Tensor, num_classes: int,
                          in_chans: int | None = None,
                          device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per BN layer of `model` (eval mode), per class: the mean over the class's `images` (a
    tensor, or an iterable of batches in the order of `labels`) of each image's channel mean and
    biased channel variance of the layer's input, (K, C) each, summed in fp64 so the result does
    not depend on the batching. Every class needs at least one image."""
    return _class_bn_targets([(model, in_chans)], _batches(images), labels, num_classes, device)[0]


def _class_bn_targets(models: Sequence[tuple[nn.Module, int | None]], batches: Iterable[torch.Tensor],
                      labels: torch.Tensor, num_classes: int,
                      device: str | torch.device) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`real_class_bn_targets` of several models over one pass of the batches."""
    counts = torch.bincount(labels.long(), minlength=num_classes).double()
    if counts.numel() != num_classes or (counts == 0).any():
        raise InputError("class-wise BN targets need real images of every class")
    runs, all_sums = [], []
    for model, in_chans in models:
        layers = bn_layers(model)
        sums: list[list] = [[None, None] for _ in layers]

        def visit(i, a, start, sums=sums):
            flat = a.reshape(a.shape[0], a.shape[1], -1)
            lab = labels[start:start + a.shape[0]].long().to(a.device)
            s = sums[i]
            if s[0] is None:
                s[0] = torch.zeros(num_classes, a.shape[1], dtype=torch.float64, device=a.device)
                s[1] = torch.zeros_like(s[0])
            s[0].index_add_(0, lab, flat.mean(dim=2))
            s[1].index_add_(0, lab, flat.var(dim=2, unbiased=False))

        runs.append((model, layers, in_chans, visit))
        all_sums.append(sums)
    _visit_inputs(runs, batches, device)
    return [[((m.cpu() / counts[:, None]).float(), (v.cpu() / counts[:, None]).float()) for m, v in sums]
            for sums in all_sums]


def attach_class_targets(teachers: Sequence["FrozenTeacher"], dataset, weight: float,
                         device: str | torch.device = "cpu") -> None:
    """Measure each teacher's class-wise BN targets on the dataset's real images, once (recover's
    `bn_category` term, EDC). The images are read once for all teachers."""
    todo = _pending(teachers, "category")
    if not todo:
        return
    keep = _statistics_indices(dataset, CONV_STAT_IMAGES_PER_CLASS)
    labels = dataset.train.labels[keep].long()
    measured = _class_bn_targets([(t.model, t.in_chans) for t in todo], _real_batches(dataset, keep), labels,
                                 dataset.num_classes, device)
    for teacher, targets in zip(todo, measured):
        teacher.category = ClassStatistics(targets, weight)
