"""How students and their teachers run on an accelerator, with no host work inside a step.

On a CPU everything here is the plain path the recorded results were trained on (fp32, NCHW,
the test split scored batch by batch as it decodes). On an accelerator (anything but a CPU):

- students and the teachers that label them compute under autocast (bf16 where the GPU has it,
  else fp16 with a gradient scaler), channels-last; cuDNN picks its convolution algorithms by
  timing them (`runtime.autotune_convolutions`), since a student's shapes stay fixed;
- AdamW runs fused (one kernel for the update of every parameter) on CUDA;
- images, index tensors and labels live on the device; whatever a step needs from the host (a
  view plan, stored logits) goes over in one non-blocking copy (`relabel.to_device`);
- the test images are decoded once per evaluation and kept on the device (`TestImages`, which a
  CPU student uses too: the same arithmetic as `models.evaluate_top1`, without decoding the split
  at every test or for every seed), and scoring counts the correct predictions there: one read of
  the count per test evaluation, none per batch.

Nothing in a step reads a value back (no `.item()`, `.cpu()`, truth value of a tensor, or host
index into a device tensor): tests/test_no_host_sync.py runs a recover stage and a student epoch
on the meta device, where any such read raises.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import torch
from torch import nn

from fadrm_ray.models import match_channels, model_in_chans

# Test images kept on the device up to this many bytes (uint8); a larger test split is streamed
# through pinned memory at every test evaluation instead.
TEST_IMAGES_ON_DEVICE_BYTES = 1 << 30
_TEST_BATCH = 512


def on_accelerator(device: torch.device | str) -> bool:
    return torch.device(device).type != "cpu"


@functools.lru_cache(maxsize=None)
def _low_precision(device_type: str) -> str | None:
    if device_type != "cuda":
        return None
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def student_precision(device: torch.device):
    """How students compute: on CUDA under autocast (bf16 where the GPU has it, else fp16 with a
    gradient scaler); elsewhere in fp32, as the recorded results were trained. Returns (autocast
    context factory, GradScaler or None)."""
    from fadrm_ray.recover import mixed_precision

    precision = _low_precision(torch.device(device).type)
    if precision is None:
        return contextlib.nullcontext, None
    return mixed_precision(precision, torch.device(device))


def student_autocast(device: torch.device):
    """The autocast block students and their teachers compute in on `device` (none on a CPU)."""
    precision = _low_precision(torch.device(device).type)
    if precision is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def layout(device: torch.device) -> torch.memory_format:
    """Channels-last on CUDA (its convolutions are fastest so), NCHW elsewhere."""
    return torch.channels_last if torch.device(device).type == "cuda" else torch.contiguous_format


def optimizer(groups: list[dict], lr: float, device: torch.device) -> torch.optim.AdamW:
    """The students' AdamW: fused on CUDA (one kernel per step for all parameters)."""
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, **({"fused": True} if fused else {}))


class TestImages:
    """The test images a student is scored on, on the device: decoded once, kept there (when they
    fit TEST_IMAGES_ON_DEVICE_BYTES), normalized there; `top1(model)` reads back one number."""

    def __init__(self, split, dataset, device: torch.device, classes: Sequence[int] | None = None):
        from fadrm_ray.data.parallel import prefetch

        self.split, self.dataset, self.device = split.of_classes(classes), dataset, torch.device(device)
        self.classes = None if classes is None else tuple(sorted(int(c) for c in classes))
        self.columns = None if classes is None else torch.as_tensor(list(classes), dtype=torch.long).to(self.device)
        self.mean = torch.tensor(dataset.mean, device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(dataset.std, device=self.device).view(1, -1, 1, 1)
        n = len(self.split)
        self.ranges = [(start, min(n, start + _TEST_BATCH)) for start in range(0, n, _TEST_BATCH)]
        bytes_ = n * dataset.channels * dataset.image_size ** 2
        self.images = None
        if n and bytes_ <= TEST_IMAGES_ON_DEVICE_BYTES:
            self.images = torch.cat([_to(images, self.device) for _, images in prefetch(self.split.load, self._indices())])
        self.labels = self.split.labels.to(self.device)

    def __len__(self) -> int:
        return len(self.split)

    def fits(self, dataset, device: torch.device | str, classes: Sequence[int] | None) -> bool:
        """Whether these are the test images of `dataset`'s `classes` (None: every class) on `device`."""
        wanted = None if classes is None else tuple(sorted(int(c) for c in classes))
        return dataset is self.dataset and torch.device(device) == self.device and wanted == self.classes

    def _indices(self) -> list[torch.Tensor]:
        return [torch.arange(start, stop) for start, stop in self.ranges]

    def _chunks(self):
        """(start, stop, uint8 images on the device) of each batch."""
        if self.images is not None:
            for start, stop in self.ranges:
                yield start, stop, self.images[start:stop]
            return
        from fadrm_ray.data.parallel import prefetch

        for idx, images in prefetch(self.split.load, self._indices()):
            yield int(idx[0]), int(idx[-1]) + 1, _to(images, self.device)

    @torch.no_grad()
    def top1(self, model: nn.Module) -> float:
        """Top-1 (percent) of `model` on these images, as `models.evaluate_top1` counts it; the
        model is put back in the mode it was in."""
        if len(self) == 0:
            return float("nan")
        in_chans = model_in_chans(model, self.dataset.channels)
        memory_format = layout(self.device)
        was_training = model.training
        model.eval()
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        try:
            for start, stop, images in self._chunks():
                x = match_channels((images.float() / 255.0 - self.mean) / self.std, in_chans)
                with student_autocast(self.device):
                    logits = model(x.contiguous(memory_format=memory_format))
                if self.columns is None:
                    pred = logits.argmax(dim=1)
                else:
                    pred = self.columns[logits.index_select(1, self.columns).argmax(dim=1)]
                correct += (pred == self.labels[start:stop]).sum()
        finally:
            model.train(was_training)
        return 100.0 * int(correct) / len(self)


def _to(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    from fadrm_ray.runtime import to_device

    return to_device(images, device)
