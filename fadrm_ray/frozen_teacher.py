"""The teachers as recover sees them: `FrozenTeacher`, a model in eval mode with the hooks that
measure its statistics losses, and `equip_teachers`, the one place a run's teachers are built
with what its objective needs of them (docs/method.md sections 3 and 7c).

What a teacher brings beyond its weights is handed to it whole when it is built: its prior (the
test accuracy its checkpoint records, for a committee's vote), its convolution targets (G-VBSM
and EDC) and its class-wise BN targets (EDC), both measured on real images by statistics.py.
Nothing is attached to a teacher afterwards.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch
import torch.nn as nn

from fadrm_ray.config import DistillConfig
from fadrm_ray.errors import InputError
from fadrm_ray.models import match_channels
from fadrm_ray.statistics import ClassStatistics, ConvStatistics, StatisticsLoss, bn_layers, dataset_targets
from fadrm_ray.teacher_record import TeacherRecord

# Layers autocast runs in its low precision, casting their weights (FrozenTeacher.weights_in).
AUTOCAST_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


class FrozenTeacher:
    """A teacher in eval mode with hooks that measure the BatchNorm-statistics loss.

    The BN loss (docs/method.md section 3) compares the batch statistics of each BN layer's input
    with the layer's running statistics: ||mu - running_mean||_2 + ||var - running_var||_2,
    biased variance over (N, H, W), plain (not squared) L2 norms, the first BN layer weighted
    `first_bn_weight`. Here the statistics are taken per group, so a packed batch of G groups
    yields G separate losses. With class-wise targets (`category`: EDC, statistics.ClassStatistics)
    each layer's loss is blended with the loss against the statistics of the batch's classes; with
    convolution targets (`conv_targets`: one (mean, var) pair per convolution, G-VBSM and EDC) the
    teacher also measures the convolution-statistics loss (`measure`).
    """

    def __init__(self, model: nn.Module, in_chans: int | None = None, first_bn_weight: float = 10.0,
                 prior: float | None = None, *,
                 conv_targets: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 category: ClassStatistics | None = None):
        self.model = model.eval().requires_grad_(False)  # only input gradients are needed
        self.in_chans = in_chans
        self.first_bn_weight = first_bn_weight
        self.prior = prior           # test accuracy in percent: a committee's vote (committee.py)
        self.bn_layers = bn_layers(model)
        if not self.bn_layers:
            raise InputError("the teacher has no BatchNorm layer; FADRM's statistics matching needs one")
        if category is not None and [m.shape[-1] for m, _ in category.targets] != \
                [bn.running_mean.numel() for bn in self.bn_layers]:
            raise ValueError(f"class-wise targets of {len(category.targets)} layers do not fit the teacher's "
                             f"{len(self.bn_layers)} BatchNorm layers")
        # The BN loss, taken in one pass over the statistics the hooks measure.
        self.matching = StatisticsLoss([(bn.running_mean, bn.running_var) for bn in self.bn_layers], first_bn_weight,
                                       category=category)
        # The convolution-statistics loss, where its targets were given.
        self._conv = None if conv_targets is None else ConvStatistics(model, conv_targets, first_bn_weight)
        self._groups = 0             # > 0 only inside __call__: other callers of the model pay nothing
        self._memory_format = torch.contiguous_format
        self._compiled: dict = {}    # compiled loss functions (recover's `compile`), by memory format
        self._hooks = [bn.register_forward_hook(self._make_hook(i)) for i, bn in enumerate(self.bn_layers)]
        # The layers whose weights autocast casts on every call, and their cast copies (weights_in).
        self._cast_layers = [m for m in model.modules() if type(m) in AUTOCAST_LAYERS]
        self._casts: dict[torch.dtype, dict[int, torch.Tensor]] = {}

    def _make_hook(self, index: int):
        def hook(module, inputs, output):
            if self._groups:  # else a forward of the same model from elsewhere (another FrozenTeacher)
                self.matching.observe(index, inputs[0], self._groups)
        return hook

    @property
    def category(self) -> ClassStatistics | None:
        """EDC's class-wise BN targets, where the teacher was built with them."""
        return self.matching.category

    @property
    def conv(self) -> ConvStatistics | None:
        """The convolution-statistics loss, where the teacher was built with its targets."""
        return self._conv

    def __call__(self, x: torch.Tensor, groups: int = 1,
                 labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the per-group BN loss, shape (groups,); `labels` (the images' classes)
        select the class-wise targets where they are attached."""
        if self.in_chans is not None:
            x = match_channels(x, self.in_chans)  # grey images into a 3-channel teacher
        self._groups = groups
        self.matching.clear()
        try:
            logits = self.model(x)
        finally:
            self._groups = 0
        return logits, self.matching.loss(labels)

    def measure(self, x: torch.Tensor, groups: int = 1,
                labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Logits, the per-group BN loss and, when attached, the per-group convolution loss
        (None without its targets). Only recover's steps pay for the convolution hooks."""
        if self.conv is None:
            return (*self(x, groups, labels), None)
        self.conv.groups = groups
        self.conv.matching.clear()
        try:
            logits, bn_loss = self(x, groups, labels)
        finally:
            self.conv.groups = 0
        return logits, bn_loss, self.conv.finish()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Plain logits, with the BN-statistics hooks idle (patch scoring needs no BN loss)."""
        if self.in_chans is not None:
            x = match_channels(x, self.in_chans)
        return self.model(x)

    def set_memory_format(self, memory_format: torch.memory_format) -> None:
        """Lay the weights out in `memory_format`. Channels-last convolutions need channels-last
        weights as well as inputs: a 1-channel input cannot carry the layout."""
        if memory_format != self._memory_format:
            self.model.to(memory_format=memory_format)
            self._memory_format = memory_format
            self._casts.clear()  # made in the other layout

    @contextmanager
    def weights_in(self, dtype: torch.dtype | None):
        """Inside the block, the weights and biases of the convolutions and linear layers are
        held in `dtype` (None or fp32: nothing changes).

        Under autocast these layers run in the low precision, and autocast casts their fp32
        weights on every call: frozen weights need no gradient, so its cast cache does not keep
        them, and on a CPU the casts of a ResNet-18 cost a tenth of a step. Holding the cast
        weights for a stage gives the same values (autocast's cast is the same rounding), so the
        step's results are bit-identical. Only exactly these layer types are cast: a subclass
        (timm's weight-standardized convolutions) may compute on its weight before the call.
        """
        if dtype is None or dtype == torch.float32:
            yield
            return
        # The cast copies are made once and kept (the weights are frozen), so every stage holds
        # the same storage: a captured CUDA graph finds its weights where it left them.
        casts = self._casts.setdefault(dtype, {})
        saved = []
        for layer in self._cast_layers:
            for param in (layer.weight, layer.bias):
                if param is not None and param.dtype == torch.float32:
                    cast = casts.get(id(param))
                    if cast is None or cast.device != param.device:  # a model moved since is cast again
                        casts[id(param)] = param.data.to(dtype)
                    saved.append((param, param.data))
                    param.data = casts[id(param)]
        try:
            yield
        finally:
            for param, data in saved:
                param.data = data

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.conv is not None:
            self.conv.remove_hooks()


def equip_teachers(models: Sequence[nn.Module], infos: Sequence[TeacherRecord], dataset, cfg: DistillConfig,
                   device: str | torch.device = "cpu") -> list[FrozenTeacher]:
    """A run's teachers for recover: each model frozen with its prior (the test accuracy its
    checkpoint records, for `committee: prior`), with `r_conv > 0` its convolution targets and
    with `bn_category > 0` its class-wise BN targets, both measured on the dataset's real images
    (read once for all teachers and both kinds: `statistics.dataset_targets`). `infos` give each
    model's prior and input channels."""
    if len(models) != len(infos):
        raise ValueError(f"{len(models)} teacher models against {len(infos)} teacher records")
    # Measured as the teachers run in recover: BatchNorm on its running statistics.
    pairs = [(model.eval(), info.in_chans) for model, info in zip(models, infos)]
    conv, category = dataset_targets(pairs, dataset, conv=cfg.r_conv > 0, bn_category=cfg.bn_category, device=device)
    return [FrozenTeacher(model, in_chans=in_chans, first_bn_weight=cfg.first_bn_weight,
                          prior=None if info.test_accuracy is None else float(info.test_accuracy),
                          conv_targets=targets, category=classes)
            for (model, in_chans), info, targets, classes in zip(pairs, infos, conv, category)]
