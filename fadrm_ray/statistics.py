"""Per-group feature statistics, the convolution-statistics loss of G-VBSM and EDC, and EDC's
class-wise BatchNorm targets.

`LayerStatistics` is the one place that measures the channel mean and variance of activations
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

from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn

from fadrm_ray.data.parallel import prefetch
from fadrm_ray.models import match_channels
from fadrm_ray.errors import InputError

# Real images per class the targets are measured on: enough for stable channel statistics of a
# small teacher, and a bounded cost on large datasets (the statistics are a mean over pixels).
CONV_STAT_IMAGES_PER_CLASS = 100
_BATCH = 256


def moments(v: torch.Tensor, read_half: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 mean (G, 1, C, 1) and biased variance (G, C) of a grouped activation (G, M, C, K)
    over dims 1 and 3.

    fp32: the two-pass formula (the mean, then the mean of the squared deviations). A half-
    precision activation (bf16 or fp16 under autocast) with `read_half` (on CUDA, whose
    reductions read half and accumulate in fp32 without a copy) is read twice as it is, for the
    mean and for the sum of squares, both accumulated in fp32; var = E[a^2] - mean^2. A square of
    a bf16 or fp16 value is exact in fp32, so this is as close as the two-pass formula on an fp32
    copy unless a channel's mean is many times its spread (not so for BatchNorm inputs). Without
    `read_half` (on a CPU, whose half reductions copy to fp32 anyway) it takes the two-pass
    formula on an fp32 copy that lives for the call only.
    """
    if v.dtype != torch.float32 and read_half:
        n = v.shape[1] * v.shape[3]
        mean = v.mean(dim=(1, 3), keepdim=True, dtype=torch.float32)
        norm = torch.linalg.vector_norm(v, dim=(1, 3), dtype=torch.float32)
        return mean, (norm * norm / n - (mean * mean).view(norm.shape)).clamp_min(0)
    v = v.float()
    mean = v.mean(dim=(1, 3), keepdim=True)
    d = v - mean
    return mean, (d * d).mean(dim=(1, 3))


_SCALES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _column_scales(sizes: tuple[int, ...], widths: tuple[int, ...], device: torch.device) -> tuple:
    """n of every column of a `LayerStatistics` output, and 2 / n as the per-layer formula rounds
    it (a Python float). Eager steps make them once per layer shape and device instead of copying
    them to the device every step; a compiled step traces them into its graph as constants."""
    key = (sizes, widths, device)
    scales = None if torch.compiler.is_compiling() else _SCALES.get(key)
    if scales is None:
        scales = (torch.tensor([float(k) for k, w in zip(sizes, widths) for _ in range(w)], device=device),
                  torch.tensor([2.0 / k for k, w in zip(sizes, widths) for _ in range(w)], device=device))
        if not torch.compiler.is_compiling():
            _SCALES[key] = scales
    return scales


class LayerStatistics(torch.autograd.Function):
    """Per-group channel mean and biased variance of every observed activation of one forward,
    in one autograd node: (G, sum of C) each, fp32, the layers side by side in their order.

    One node for all layers, not one per layer: a step pays one Python call forward and one
    backward. Nothing new is saved for the backward: the node keeps the activations themselves
    (the BatchNorm layers they feed keep them too) and each layer's (G, C) mean (`moments`). The
    gradient is affine in the activation for each (group, channel):
        dL/da = dL/dmean / n + 2 dL/dvar / n * (a - mean),
    one fused pass (addcmul) per layer: in fp32 as the two-pass formula's own; for a half-
    precision activation computed in fp32 from it and written in its dtype (one rounding, no
    fp32 copy of the activation).
    """

    @staticmethod
    def forward(ctx, groups: int, *activations: torch.Tensor):
        means, variances, sizes = [], [], []
        for a in activations:
            v, _ = _grouped(a, groups)
            mean, var = moments(v, read_half=v.is_cuda)
            means.append(mean.view(var.shape))
            variances.append(var)
            sizes.append(v.shape[1] * v.shape[3])
        means = torch.cat(means, dim=1)
        ctx.groups, ctx.sizes = groups, sizes
        ctx.save_for_backward(means, *activations)
        return means, torch.cat(variances, dim=1)

    @staticmethod
    def backward(ctx, grad_mean: torch.Tensor, grad_var: torch.Tensor):
        means, *activations = ctx.saved_tensors
        widths = [a.shape[1] for a in activations]
        n, two_over_n = _column_scales(tuple(ctx.sizes), tuple(widths), means.device)
        base, scale = grad_mean / n, grad_var * two_over_n
        low = [a.dtype != torch.float32 for a in activations]
        if any(low):
            shifted = base - scale * means  # the affine form's constant, for the half-precision layers
        grads = []
        for i, a in enumerate(activations):
            if not ctx.needs_input_grad[1 + i]:
                grads.append(None)
                continue
            v, channels_last = _grouped(a, ctx.groups)
            start = sum(widths[:i])
            cols = slice(start, start + widths[i])
            shape = (v.shape[0], 1, v.shape[2], 1)
            if low[i]:  # computed in fp32, written in the activation's dtype
                grad = torch.addcmul(shifted[:, cols].reshape(shape), v, scale[:, cols].reshape(shape),
                                     out=torch.empty_like(v))
            else:
                grad = torch.addcmul(base[:, cols].reshape(shape), v - means[:, cols].reshape(shape),
                                     scale[:, cols].reshape(shape))
            if channels_last:  # back from (G, B*H*W, C, 1) to an (N, C, H, W) channels-last tensor
                n_, c, h, w = a.shape
                grad = grad.view(n_, h, w, c).permute(0, 3, 1, 2)
            else:
                grad = grad.view(a.shape)
            grads.append(grad)
        return (None, *grads)


class StatisticsLoss:
    """The statistics-matching loss of a set of layers, taken in one pass after the forward.

    Per group: sum over layers l of w_l * (||mean_l - target_mean_l||_2 + ||var_l - target_var_l||_2),
    w_0 = `first_weight`, every other w_l = 1 (docs/method.md section 3). The hooks hand each
    layer's input to `observe`; `loss` measures every layer's (G, C_l) statistics in one node
    (`LayerStatistics`), then scatters
    the differences of every layer into one zero-padded (G, layers, C_max) tensor and takes all
    the norms at once, instead of a dozen small ops per layer on every step. The zero padding
    adds nothing to a norm, and the norm's gradient at zero is zero, so a layer that matches its
    target exactly stays harmless. EDC's class-wise targets (`ClassStatistics`) blend in per layer.
    A layer seen twice in one forward counts twice, as each of its inputs does.
    """

    def __init__(self, targets: Sequence[tuple[torch.Tensor, torch.Tensor]], first_weight: float = 10.0,
                 category: "ClassStatistics | None" = None):
        self.sizes = [int(m.numel()) for m, _ in targets]
        self.first_weight = float(first_weight)
        self.targets = [(m.detach().float().reshape(-1), v.detach().float().reshape(-1)) for m, v in targets]
        self.category = category  # EDC's class-wise targets, blended in per layer where given
        # (layer, its activation or its measured (mean, var)) of the forward under way
        self._seen: list[tuple[int, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]] = []
        self._groups = 1
        self._plans: dict[tuple, tuple] = {}

    def prepare(self, device: str | torch.device) -> None:
        """Build the gather plan of a forward that runs every layer once, in order, on `device`,
        outside any compiled region (a plan built while torch.compile traces would recompile)."""
        self._plan(tuple(range(len(self.sizes))), torch.device(device))

    def observe(self, index: int, activation: torch.Tensor, groups: int) -> None:
        """Layer `index`'s input of this forward, of `groups` groups. Its statistics are measured
        with every other layer's in one node when the loss is taken; an activation that needs no
        gradient (a forward under no_grad) is measured now, so that it can be freed."""
        self._groups = groups
        if activation.requires_grad:
            self._seen.append((index, activation))
        else:
            self._seen.append((index, LayerStatistics.apply(groups, activation)))

    def clear(self) -> None:
        self._seen = []

    def loss(self, labels: torch.Tensor | None = None) -> torch.Tensor | None:
        """The per-group loss (G,) of the statistics seen since the last call (None if none);
        `labels` (G * B,) select the class-wise targets where it has them."""
        seen, self._seen = self._seen, []
        if not seen:
            return None
        order = tuple(i for i, _ in seen)
        pending = [entry for _, entry in seen if isinstance(entry, torch.Tensor)]
        if len(pending) == len(seen):  # a step: every layer in one node
            means, variances = LayerStatistics.apply(self._groups, *pending)
        else:
            pairs = [LayerStatistics.apply(self._groups, e) if isinstance(e, torch.Tensor) else e for _, e in seen]
            means, variances = torch.cat([m for m, _ in pairs], dim=1), torch.cat([v for _, v in pairs], dim=1)
        device = means.device
        positions, t_mean, t_var, weights, width = self._plan(order, device)
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
                self.matching.observe(index, inputs[0], self.groups)
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
    return _measure([(model, in_chans)], [_conv_sums], _batches(images), device)[0][0]


def _conv_sums(model: nn.Module):
    """The convolutions of `model`, a visit that sums each one's input, and the targets from the sums."""
    layers = conv_layers(model)
    sums: list[list] = [[None, None, 0] for _ in layers]

    def visit(i, a, start):
        s = sums[i]
        part, part_sq = a.sum(dim=(0, 2, 3)), (a * a).sum(dim=(0, 2, 3))
        s[0] = part if s[0] is None else s[0] + part
        s[1] = part_sq if s[1] is None else s[1] + part_sq
        s[2] += a.shape[0] * a.shape[2] * a.shape[3]

    def targets():
        out = []
        for total, total_sq, n in sums:
            mean = total / n
            out.append((mean.float().cpu(), (total_sq / n - mean * mean).clamp_min(0).float().cpu()))
        return out

    return layers, visit, targets


def _measure(models: Sequence[tuple[nn.Module, int | None]], kinds: Sequence[Callable],
             batches: Iterable[torch.Tensor], device: str | torch.device) -> list[list]:
    """One pass of the batches through each (model, in_chans), each model's inputs measured by
    every kind (`kind(model)` -> its layers, their visit, its result): per model, each kind's
    result."""
    runs, measured = [], []
    for model, in_chans in models:
        parts = [kind(model) for kind in kinds]
        route = [(visit, j) for layers, visit, _ in parts for j in range(len(layers))]

        def visit(i, a, start, route=route):
            part, j = route[i]
            part(j, a, start)

        runs.append((model, [layer for layers, _, _ in parts for layer in layers], in_chans, visit))
        measured.append(parts)
    _visit_inputs(runs, batches, device)
    return [[result() for _, _, result in parts] for parts in measured]


def _statistics_indices(dataset, per_class: int) -> list[int]:
    labels = dataset.train.labels
    return sorted(int(i) for c in range(dataset.num_classes)
                  for i in torch.nonzero(labels == c, as_tuple=False).flatten()[:per_class])


def _real_batches(dataset, keep: list[int]) -> Iterator[torch.Tensor]:
    """The normalized images `keep` of the training split in batches of `_BATCH`; the next batch
    decodes while the teachers see this one."""
    for _, images in prefetch(dataset.train.load, torch.as_tensor(keep, dtype=torch.long).split(_BATCH)):
        yield dataset.normalize(images)


def dataset_conv_targets(models: Sequence[tuple[nn.Module, int | None]], dataset,
                         device: str | torch.device = "cpu") -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The convolution targets of each (model, in_chans) on the dataset's real images (`dataset_targets`)."""
    return dataset_targets(models, dataset, conv=True, bn_category=0.0, device=device)[0]


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
    kind = _class_bn_sums(labels, _class_counts(labels, num_classes))
    return _measure([(model, in_chans)], [kind], _batches(images), device)[0][0]


def _class_counts(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    counts = torch.bincount(labels.long(), minlength=num_classes).double()
    if counts.numel() != num_classes or (counts == 0).any():
        raise InputError("class-wise BN targets need real images of every class")
    return counts


def _class_bn_sums(labels: torch.Tensor, counts: torch.Tensor) -> Callable:
    """A measuring kind (`_measure`): each BN layer's per-class sums of the per-image channel
    mean and biased variance of its input, and the class targets from them."""
    num_classes = counts.numel()

    def kind(model: nn.Module):
        layers = bn_layers(model)
        sums: list[list] = [[None, None] for _ in layers]

        def visit(i, a, start):
            flat = a.reshape(a.shape[0], a.shape[1], -1)
            lab = labels[start:start + a.shape[0]].long().to(a.device)
            s = sums[i]
            if s[0] is None:
                s[0] = torch.zeros(num_classes, a.shape[1], dtype=torch.float64, device=a.device)
                s[1] = torch.zeros_like(s[0])
            s[0].index_add_(0, lab, flat.mean(dim=2))
            s[1].index_add_(0, lab, flat.var(dim=2, unbiased=False))

        def targets():
            return [((m.cpu() / counts[:, None]).float(), (v.cpu() / counts[:, None]).float()) for m, v in sums]

        return layers, visit, targets

    return kind


@torch.no_grad()
def dataset_targets(models: Sequence[tuple[nn.Module, int | None]], dataset, *, conv: bool, bn_category: float,
                    device: str | torch.device = "cpu") -> tuple[list, list]:
    """What each (model, in_chans), eval mode, matches on the dataset's real training images
    (`CONV_STAT_IMAGES_PER_CLASS` per class), the images read once for all models and both kinds:
    with `conv` its convolution targets (`real_conv_targets`: a teacher's `r_conv` term), with
    `bn_category > 0` its class-wise BN targets (`real_class_bn_targets`) blended at that weight
    (EDC's `bn_category` term). Returns (convolution targets, ClassStatistics), None per model
    for a kind not asked for (frozen_teacher.equip_teachers)."""
    none = [None] * len(models)
    if not conv and bn_category <= 0:
        return none, list(none)
    keep = _statistics_indices(dataset, CONV_STAT_IMAGES_PER_CLASS)
    kinds = [_conv_sums] if conv else []
    if bn_category > 0:
        labels = dataset.train.labels[keep].long()
        kinds.append(_class_bn_sums(labels, _class_counts(labels, dataset.num_classes)))
    measured = _measure(models, kinds, _real_batches(dataset, keep), device)
    conv_targets = [results[0] for results in measured] if conv else none
    category = [ClassStatistics(results[-1], bn_category) for results in measured] if bn_category > 0 else list(none)
    return conv_targets, category
