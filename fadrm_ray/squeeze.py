"""Squeeze: train the teacher on the real training split (docs/method.md section 1).

Adam + cosine schedule over all steps, label smoothing, random crop (padding = size // 8),
horizontal flip when the dataset allows it, CutMix. All randomness comes from one seeded
generator, so a run on CPU is repeatable.

`ensure_teacher` is squeeze with a cache: it reuses the teacher saved in a folder when that
teacher is what `squeeze` would train there, and trains one otherwise.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .augment import cutmix_box
from .data.base import ImageDataset
from .data.parallel import prefetch
from .fileio import OutputError, check_output_dir
from .models import (ModelError, create_model, evaluate_top1, load_teacher, match_channels,
                     model_in_chans, save_teacher)
from .runtime import resolve_device, torch_threads, tune_allocator
from .teacher_record import TeacherRecord
from .config import SqueezeConfig
from .settings import ConfigError
from .errors import InputError


@dataclass
class SqueezeResult:
    path: Path
    info: TeacherRecord
    test_accuracy: float  # percent
    train_seconds: float
    epochs: int
    config: SqueezeConfig


def random_crop_flip(x: torch.Tensor, pad: int, hflip: bool, gen: torch.Generator) -> torch.Tensor:
    """Per-sample random crop after zero padding, and per-sample horizontal flip; x is float (B,C,H,W)."""
    b, c, h, w = x.shape
    if pad > 0:
        xp = F.pad(x, (pad, pad, pad, pad))
        oy = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
        ox = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
        rows = (oy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
        cols = (ox[:, None] + torch.arange(w)[None, :])[:, None, None, :]
        x = xp[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    if hflip:
        flip = torch.rand(b, generator=gen) < 0.5
        if bool(flip.any()):
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    return x


def cutmix(x: torch.Tensor, y: torch.Tensor, gen: torch.Generator):
    """Paste a box from a shuffled batch; returns (x, y, y_other, lam) with lam = kept area fraction."""
    b, _, h, w = x.shape
    # The draws and their order are the teacher's random stream: a saved teacher depends on them.
    lam = float(torch.rand(1, generator=gen))  # Beta(1, 1) is uniform
    perm = torch.randperm(b, generator=gen)
    cy = int(torch.randint(0, h, (1,), generator=gen))
    cx = int(torch.randint(0, w, (1,), generator=gen))
    (y0, y1, x0, x1), lam = cutmix_box(h, w, lam, cy, cx)
    x = x.clone()
    x[:, :, y0:y1, x0:x1] = x[perm, :, y0:y1, x0:x1]
    return x, y, y[perm], lam


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "data"


def default_out_dir(dataset: ImageDataset, model_name: str) -> Path:
    return Path("teachers") / f"{_safe(dataset.name)}-{_safe(model_name)}"


TEACHER_FILE = "teacher.pt"


def teacher_path(out_dir: str | os.PathLike) -> Path:
    """Where `squeeze(..., out_dir=out_dir)` writes its checkpoint."""
    return Path(out_dir) / TEACHER_FILE


def check_out_dir(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """OutputError unless `out_dir` can take a new teacher: a writable folder (or one that can be
    created) without a checkpoint in it, unless `overwrite`. Checked before training, not after."""
    check_output_dir(out_dir, "teacher folder")
    if not overwrite and os.path.lexists(teacher_path(out_dir)):
        raise OutputError(f"{teacher_path(out_dir)} already exists; choose another --out or remove it")
    return teacher_path(out_dir)


def squeeze(dataset: ImageDataset, cfg: SqueezeConfig, *, out_dir: str | os.PathLike | None = None,
            num_threads: int | None = None, progress: bool = True,
            device: str | torch.device | None = None, overwrite: bool = False) -> SqueezeResult:
    """Train a teacher on ``dataset.train``, measure top-1 on ``dataset.test``, save ``out_dir/teacher.pt``.

    ``out_dir`` defaults to ``teachers/<dataset>-<model>``; ``device`` defaults to CUDA when present.
    The checkpoint records ``cfg`` (``TeacherRecord.squeeze_config``). An existing checkpoint is
    replaced only with ``overwrite``; the folder is checked before training starts.
    """
    check_out_dir(out_dir if out_dir is not None else default_out_dir(dataset, cfg.model), overwrite)
    tune_allocator()
    n = len(dataset.train)
    if n == 0:
        raise InputError(f"dataset {dataset.name} has an empty training split")
    model_kwargs = dict(cfg.model_kwargs)
    device = torch.device(resolve_device(device))
    out = Path(out_dir) if out_dir is not None else default_out_dir(dataset, cfg.model)

    with torch_threads(num_threads):
        torch.manual_seed(cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed)
        # model_kwargs may ask for in_chans=3 on grey data (e.g. to match an RGB architecture);
        # it is recorded as TeacherRecord.in_chans, not as a builder keyword.
        in_chans = int(model_kwargs.pop("in_chans", dataset.channels))
        model = create_model(cfg.model, dataset.num_classes, in_chans=in_chans, image_size=dataset.image_size,
                             **model_kwargs).to(device)
        in_chans = model_in_chans(model, in_chans)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        # Drop a trailing batch of one: BatchNorm cannot take training statistics from a single image.
        steps_per_epoch = n // cfg.batch_size + (1 if n % cfg.batch_size > 1 else 0)
        total_steps = max(1, cfg.epochs * steps_per_epoch)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
        mean = torch.tensor(dataset.mean).view(1, -1, 1, 1)
        std = torch.tensor(dataset.std).view(1, -1, 1, 1)
        pad = dataset.image_size // 8

        from tqdm.auto import tqdm

        bar = tqdm(range(cfg.epochs), desc=f"squeeze {cfg.model} on {dataset.name}", unit="epoch",
                   disable=not progress, leave=True)
        started = time.perf_counter()
        model.train()
        for _epoch in bar:
            order = torch.randperm(n, generator=gen)
            loss_sum, correct, seen = 0.0, 0, 0
            batches = [order[s * cfg.batch_size:(s + 1) * cfg.batch_size] for s in range(steps_per_epoch)]
            for idx, images in prefetch(dataset.train.load, batches):  # the next batch decodes during this step
                y = dataset.train.labels[idx]
                x = images.float().div_(255.0)
                x = random_crop_flip(x, pad, dataset.hflip, gen)
                x = match_channels((x - mean) / std, in_chans)
                mix = cfg.cutmix_prob > 0 and float(torch.rand(1, generator=gen)) < cfg.cutmix_prob
                if mix:
                    x, y_a, y_b, lam = cutmix(x, y, gen)
                x, y = x.to(device), y.to(device)
                logits = model(x)
                if mix:
                    y_b = y_b.to(device)
                    loss = lam * F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing) + \
                        (1.0 - lam) * F.cross_entropy(logits, y_b, label_smoothing=cfg.label_smoothing)
                else:
                    loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                loss_sum += float(loss.detach()) * y.numel()
                correct += int((logits.argmax(1) == y).sum())
                seen += y.numel()
            bar.set_postfix(loss=f"{loss_sum / max(1, seen):.3f}", train_acc=f"{100.0 * correct / max(1, seen):.1f}")
        bar.close()
        train_seconds = time.perf_counter() - started

        test_accuracy = evaluate_top1(model, dataset.test, dataset)

    model.eval()
    info = TeacherRecord(model_name=cfg.model, model_kwargs=model_kwargs, num_classes=dataset.num_classes,
                         in_chans=in_chans, image_size=dataset.image_size, mean=tuple(dataset.mean),
                         std=tuple(dataset.std), class_names=list(dataset.class_names), dataset=dataset.name,
                         dataset_fingerprint=dataset.fingerprint(), test_accuracy=round(float(test_accuracy), 4),
                         squeeze_config=cfg.model_dump(mode="json"))
    path = teacher_path(out)
    info = save_teacher(path, model, info, replace=overwrite)
    return SqueezeResult(path=path, info=info, test_accuracy=float(test_accuracy), train_seconds=train_seconds,
                         epochs=cfg.epochs, config=cfg)


# --------------------------------------------------------------------------- a cached teacher
class EnsuredTeacher(NamedTuple):
    path: Path          # out_dir/teacher.pt
    info: TeacherRecord   # as saved: test accuracy, dataset fingerprint, squeeze config
    reused: bool        # False when this call trained it


def teacher_matches(info: TeacherRecord, dataset: ImageDataset, cfg: SqueezeConfig) -> bool:
    """Whether a saved teacher is the one `squeeze(dataset, cfg)` trains: the same data (by
    fingerprint), model name and model keywords, and the same SqueezeConfig where the checkpoint
    records one (a teacher saved before it was recorded is judged on the rest)."""
    kwargs = dict(cfg.model_kwargs)
    in_chans = kwargs.pop("in_chans", None)  # squeeze records it as TeacherRecord.in_chans, not as a keyword
    if (not dataset.matches(info.dataset_fingerprint) or info.model_name != cfg.model
            or info.model_kwargs != kwargs or (in_chans is not None and info.in_chans != in_chans)):
        return False
    if info.squeeze_config is None:
        return True
    try:
        return SqueezeConfig.model_validate(info.squeeze_config) == cfg
    except ConfigError:  # recorded by a version with other settings: not comparable, so not the same
        return False


def ensure_teacher(dataset: ImageDataset, cfg: SqueezeConfig, out_dir: str | os.PathLike, *,
                   num_threads: int | None = None, progress: bool = True,
                   device: str | torch.device | None = None) -> EnsuredTeacher:
    """The teacher of `squeeze(dataset, cfg, out_dir=out_dir)`: the one saved in `out_dir` when it
    matches (`teacher_matches`), else a new one trained there (over an unreadable or other one)."""
    path = teacher_path(out_dir)
    if path.is_file():
        try:
            _, info = load_teacher(path)
        except ModelError:
            info = None
        if info is not None and teacher_matches(info, dataset, cfg):
            return EnsuredTeacher(path, info, True)
    # This folder is the cache of this very teacher: one that is unreadable or of other settings is replaced.
    result = squeeze(dataset, cfg, out_dir=out_dir, num_threads=num_threads, progress=progress, device=device,
                     overwrite=True)
    return EnsuredTeacher(Path(result.path), result.info, False)
