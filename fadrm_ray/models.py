"""Teacher/student model factory, teacher checkpoints, and the top-1 score of a model on a split.

Names: our own (``convnet-bn``, ``resnet18-cifar``), ``timm:NAME``, ``torchvision:NAME``, or a bare
name looked up in that order. Models are built untrained (pretrained=False always): a teacher's
weights come from squeeze or from weights imported into a checkpoint (teacher_import.py).

A teacher checkpoint holds plain types plus the state dict, so it loads with
``torch.load(weights_only=True)``; it records the class order, normalization and dataset
fingerprint the teacher was trained with (docs/method.md section 1).
"""
from __future__ import annotations

import hashlib
import io
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from fadrm_ray.data.base import ImageDataset, Split
from fadrm_ray.data.parallel import prefetch
from fadrm_ray.errors import InputError
from fadrm_ray.fileio import OutputError, atomic_create_bytes, atomic_write_bytes, sha256_file
from fadrm_ray.teacher_record import TeacherRecord

OWN_MODELS = ["convnet-bn", "resnet18-cifar"]
MODEL_NAMES = OWN_MODELS + ["timm:NAME", "torchvision:NAME"]
CHECKPOINT_FORMAT = "fadrm-teacher"
CHECKPOINT_VERSION = 1


class ModelError(InputError):
    """A model name, checkpoint or teacher/dataset pairing is not usable."""


class ConvNetBN(nn.Module):
    """``depth`` blocks of conv3x3 -> BatchNorm -> ReLU -> AvgPool(2), then global pooling + Linear.

    A block pools only while the spatial size (as planned for ``image_size``) is still >= 2, so
    8-px inputs do not collapse to nothing. Global average pooling lets the same weights run at
    the lower resolutions multi-resolution optimization uses.
    """

    def __init__(self, num_classes: int, in_chans: int = 3, image_size: int = 32, depth: int = 3,
                 width: int = 64):
        super().__init__()
        if depth < 1 or width < 1:
            raise ModelError(f"convnet-bn needs depth >= 1 and width >= 1, got depth={depth} width={width}")
        layers: list[nn.Module] = []
        size = image_size
        chans = in_chans
        for _ in range(depth):
            layers += [nn.Conv2d(chans, width, kernel_size=3, padding=1, bias=False),
                       nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
            if size >= 2:
                # ceil_mode: an odd or smaller-than-planned input still keeps at least one pixel.
                layers.append(nn.AvgPool2d(2, ceil_mode=True))
                size = (size + 1) // 2
            chans = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def _resnet18_cifar(num_classes: int, in_chans: int, image_size: int, **kwargs) -> nn.Module:
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes, **kwargs)
    # CIFAR stem: 3x3 stride-1 conv and no max-pool keep 32-px feature maps large enough.
    model.conv1 = nn.Conv2d(in_chans, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _convnet_bn(num_classes: int, in_chans: int, image_size: int, **kwargs) -> nn.Module:
    return ConvNetBN(num_classes, in_chans=in_chans, image_size=image_size, **kwargs)


_REGISTRY = {"convnet-bn": _convnet_bn, "resnet18-cifar": _resnet18_cifar}


def _unknown(name: str) -> ModelError:
    return ModelError(f"unknown model '{name}'; choose one of: {', '.join(OWN_MODELS)}, or any timm or "
                      f"torchvision model name (timm:NAME, torchvision:NAME)")


def _replace_first_conv(model: nn.Module, in_chans: int) -> None:
    """Give a torchvision model a first conv with ``in_chans`` inputs (they are built for RGB)."""
    for qualname, module in model.named_modules():
        if not isinstance(module, nn.Conv2d):
            continue
        if module.in_channels == in_chans:
            return
        new = nn.Conv2d(in_chans, module.out_channels, module.kernel_size, module.stride, module.padding,
                        module.dilation, groups=1, bias=module.bias is not None, padding_mode=module.padding_mode)
        parent_name, _, attr = qualname.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        return
    raise ModelError(f"cannot adapt {type(model).__name__} to {in_chans} input channels: no Conv2d found")


def _timm_model(name: str, num_classes: int, in_chans: int, **kwargs) -> nn.Module:
    import timm

    if not timm.is_model(name):
        raise _unknown(f"timm:{name}")
    kwargs.pop("pretrained", None)
    try:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans, **kwargs)
    except TypeError as exc:
        raise ModelError(f"timm model '{name}' rejected its arguments: {exc}") from None


def _torchvision_model(name: str, num_classes: int, in_chans: int, **kwargs) -> nn.Module:
    from torchvision import models as tvm

    if name not in tvm.list_models():
        raise _unknown(f"torchvision:{name}")
    kwargs.pop("weights", None)
    kwargs.pop("pretrained", None)
    try:
        model = tvm.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"torchvision model '{name}' rejected its arguments: {exc}") from None
    if in_chans != 3:
        _replace_first_conv(model, in_chans)
    return model


def create_model(name: str, num_classes: int, in_chans: int = 3, image_size: int = 32, **kwargs) -> nn.Module:
    """Build an untrained model. Extra keyword arguments go to the builder (e.g. depth, width)."""
    if not isinstance(name, str) or not name.strip():
        raise _unknown(str(name))
    if num_classes < 1:
        raise ModelError(f"num_classes must be >= 1, got {num_classes}")
    name = name.strip()
    prefix, sep, rest = name.partition(":")
    if sep:
        if prefix == "timm":
            return _timm_model(rest, num_classes, in_chans, **kwargs)
        if prefix == "torchvision":
            return _torchvision_model(rest, num_classes, in_chans, **kwargs)
        raise _unknown(name)
    if name in _REGISTRY:
        try:
            return _REGISTRY[name](num_classes, in_chans, image_size, **kwargs)
        except TypeError as exc:
            raise ModelError(f"model '{name}' rejected its arguments: {exc}") from None
    import timm

    if timm.is_model(name):
        return _timm_model(name, num_classes, in_chans, **kwargs)
    from torchvision import models as tvm

    if name in tvm.list_models():
        return _torchvision_model(name, num_classes, in_chans, **kwargs)
    raise _unknown(name)


def match_channels(x: torch.Tensor, in_chans: int) -> torch.Tensor:
    """Feed 1-channel images to a 3-channel model by repetition; anything else must already match."""
    c = x.shape[1]
    if c == in_chans:
        return x
    if c == 1 and in_chans == 3:
        return x.expand(-1, 3, -1, -1)
    raise ModelError(f"model expects {in_chans} input channels, images have {c}")


def model_in_chans(model: nn.Module, fallback: int) -> int:
    """The input channels of the model's first convolution (`fallback` for a model without one)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            return m.in_channels
    return fallback


@torch.no_grad()
def evaluate_top1(model: nn.Module, split: Split, dataset: ImageDataset, batch_size: int = 512,
                  classes: Sequence[int] | None = None) -> float:
    """Top-1 accuracy (percent) of ``model`` on ``split``, normalized with the dataset's mean/std.

    With ``classes``, only the images of those classes count and the prediction is the best of
    those classes' outputs: a set distilled for a class subset is judged on the task it was made
    for, not on classes it never saw (chance is then 1 / len(classes)).
    The model runs in eval mode on the device of its parameters and is put back in the mode it
    was in, so a training loop can score its model between epochs.
    """
    split = split.of_classes(classes)
    n = len(split)
    if n == 0:
        return float("nan")
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    in_chans = model_in_chans(model, dataset.channels)
    columns = None if classes is None else torch.as_tensor(list(classes), dtype=torch.long)
    was_training = model.training
    model.eval()
    correct = 0
    try:
        # The next batch decodes while the model runs on this one.
        for idx, images in prefetch(split.load, torch.arange(n).split(batch_size)):
            x = match_channels(dataset.normalize(images), in_chans).to(device)
            logits = model(x).cpu()
            pred = logits.argmax(dim=1) if columns is None else columns[logits[:, columns].argmax(dim=1)]
            correct += int((pred == split.labels[idx]).sum())
    finally:
        model.train(was_training)
    return 100.0 * correct / n


def save_teacher(path: str | os.PathLike, model: nn.Module, info: TeacherRecord, *,
                 replace: bool = True) -> TeacherRecord:
    """Write the checkpoint atomically (temp file + os.replace); returns `info` of the written
    file (its path and sha256). With ``replace=False`` an existing file is never replaced
    (OutputError)."""
    path = Path(path)
    missing = info.missing()
    if missing:
        raise ModelError(f"teacher info lacks {', '.join(missing)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "info": info.metadata(),
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    if replace:
        atomic_write_bytes(path, buf.getvalue())
    else:
        try:
            atomic_create_bytes(path, buf.getvalue())
        except FileExistsError:
            raise OutputError(f"teacher checkpoint {path} already exists; choose another folder or remove it") from None
    return info.at(path, sha256_file(path))


def load_teacher(path: str | os.PathLike, device: str | torch.device = "cpu",
                 blob: bytes | None = None) -> tuple[nn.Module, TeacherRecord]:
    """Rebuild a frozen teacher (eval mode, no gradients) from a checkpoint written by save_teacher:
    the file at `path`, or its bytes `blob` (sent by another process; `path` then only names it)."""
    path = Path(path)
    if blob is None:
        if path.is_dir():
            raise ModelError(f"teacher checkpoint {path} is a directory, not a checkpoint file")
        if not path.is_file():
            raise ModelError(f"teacher checkpoint not found: {path}")
        blob = path.read_bytes()
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on files it then refuses
            warnings.simplefilter("ignore")
            payload = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)
    except Exception as exc:
        # torch's own text suggests loading again with weights_only=False, which runs whatever
        # code the file holds: never pass that on.
        if "weights only" in str(exc).lower() or "weights_only" in str(exc):
            raise ModelError(f"cannot read teacher checkpoint {path}: a safe load refused it (only tensors and "
                             f"plain values are loaded, and nothing in the file is run); it is not a fadrm "
                             f"teacher checkpoint") from None
        raise ModelError(f"cannot read teacher checkpoint {path}: not a PyTorch checkpoint file") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ModelError(f"{path} is not a fadrm teacher checkpoint")
    if payload.get("version") != CHECKPOINT_VERSION:
        raise ModelError(f"{path}: checkpoint version {payload.get('version')} is not supported "
                         f"(expected {CHECKPOINT_VERSION})")
    info = TeacherRecord.model_validate(dict(payload.get("info") or {})).at(path, hashlib.sha256(blob).hexdigest())
    missing = info.missing()
    if missing:
        raise ModelError(f"{path}: teacher info lacks {', '.join(missing)}")
    model = create_model(info.model_name, info.num_classes, in_chans=info.in_chans, image_size=info.image_size,
                         **info.model_kwargs)
    try:
        model.load_state_dict(payload["state_dict"], strict=True)
    except (RuntimeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(f"{path}: weights do not fit {info.model_name}: {first}") from None
    model.to(device).eval().requires_grad_(False)
    return model, info


def _short(values: list[str], limit: int = 12) -> str:
    shown = ", ".join(repr(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def teacher_view(dataset: ImageDataset, infos: Sequence[TeacherRecord]) -> ImageDataset:
    """`dataset` normalized as its teachers expect. A squeezed teacher was trained with the
    dataset's own mean/std; an imported one records its weights' (or the flags'), and every phase
    that feeds it images (patch scoring, recover, BN statistics) must use those. Teachers that
    normalize differently cannot share one image: ModelError."""
    wanted = {(tuple(i.mean), tuple(i.std)) for i in infos if i.imported is not None}
    if not wanted:
        return dataset
    if len(wanted) > 1 or any(i.imported is None and (tuple(i.mean), tuple(i.std)) not in wanted for i in infos):
        raise ModelError("the teachers normalize images differently (mean/std); teachers that share the images "
                         "must share one normalization")
    mean, std = wanted.pop()
    if len(mean) != dataset.channels:
        raise ModelError(f"the teachers' mean/std have {len(mean)} channels, dataset {dataset.name} has "
                         f"{dataset.channels}")
    if (mean, std) == (tuple(dataset.mean), tuple(dataset.std)):
        return dataset
    return replace(dataset, mean=mean, std=std)


def check_teacher_fits(info: TeacherRecord, dataset: ImageDataset) -> None:
    """Raise ModelError unless the teacher was built for this dataset's classes, channels and size."""
    if info.num_classes != dataset.num_classes:
        raise ModelError(f"num_classes: teacher has {info.num_classes}, dataset {dataset.name} has "
                         f"{dataset.num_classes}")
    teacher_names = [str(v) for v in info.class_names]
    data_names = [str(v) for v in dataset.class_names]
    if teacher_names != data_names:
        i = next(i for i, (a, b) in enumerate(zip(teacher_names, data_names)) if a != b)
        raise ModelError(f"class_names: teacher and dataset class orders differ at index {i} "
                         f"(teacher {teacher_names[i]!r}, dataset {data_names[i]!r}); teacher "
                         f"{_short(teacher_names)}, dataset {_short(data_names)}")
    if not (info.in_chans == dataset.channels or (info.in_chans == 3 and dataset.channels == 1)):
        raise ModelError(f"in_chans: teacher takes {info.in_chans} channels, dataset {dataset.name} has "
                         f"{dataset.channels}")
    if info.image_size != dataset.image_size:
        raise ModelError(f"image_size: teacher was trained at {info.image_size} px, dataset {dataset.name} is "
                         f"{dataset.image_size} px")
