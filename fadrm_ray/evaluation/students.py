"""Evaluate: train a student from scratch on distilled images, report top-1 on the real test set.

The protocol of docs/method.md section 6: the student sees only the distilled images, each step
under a random-resized crop, flip (where allowed) and CutMix, and learns the frozen teacher(s)'
distribution on that exact view (relabel.py) by KL divergence at temperature T [20]; AdamW
(lr 1e-3, wd 0.01, no decay on biases and norm parameters), batch 16, a cosine schedule stepped
once per epoch (torch's LambdaLR); top-1 on the real test images of the classes distilled (a
run of a class subset is tested on those classes' test images, the prediction being the best of
their outputs: `models.evaluate_top1`).

The cosine may be *stretched*: the published student trainer multiplies the learning rate by
0.5 * (1 + cos(pi * epoch / (epochs * eta))), with eta chosen per dataset, student and IPC in their
validate/train_fkd.py: eta = 2 for a ResNet-18 student at IPC 1 and 10 on CIFAR-100,
Tiny-ImageNet and ImageNet-1K, eta = 1 at IPC 50 (and at IPC 10 on ImageNette/ImageWoof). With
eta = 2 the rate only decays to half of its start, which their 300-1000 epochs and best-of-run
reporting tolerate. `EvalConfig.cosine_stretch` is that eta. The default here is 1 (a full cosine
to zero): with the few hundred steps that fit a CPU, eta = 2 left the *final* accuracy to chance (3 seeds
on mnist-sample IPC 10, RDED images, 600 steps: 77.9 +- 4.7 with eta 2 against 80.7 +- 0.4 with
eta 1; at 2100 steps 82.8 +- 1.0 against 86.9 +- 0.3). Set cosine_stretch=2 for the published
small-IPC setting.

Two protocols choose the epochs and the stretch when `EvalConfig` leaves them unset
(`resolve_protocol`): "short" (the default: about DEFAULT_STEPS optimizer steps, a full cosine),
for tests, quick looks and benchmarks that must fit a CPU; and "published": 300 epochs (1000 at
IPC 1) and eta = 2 up to IPC 10 (1 above), the schedule of the published ResNet-18 students.
Evaluations of a store run are cached inside the run (`evaluate_run`), keyed by everything that
decides the result: the resolved settings, the teachers, the test data and the run's images. Each
student is kept on its own as well, so more seeds later train only the new students.

Two details differ from that script and are stated here so numbers can be compared: the KD loss
is multiplied by T^2 (the usual Hinton scaling; the published script has that line commented
out; under AdamW a constant loss scale changes nothing but the epsilon's relative size), and
the reported number is the *final* top-1 (the published script keeps the best test accuracy
seen, which selects on the test set; it is reported too, as best_top1_*).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
import math
import statistics
import time
from pathlib import Path
from typing import Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fadrm_ray.data import get_dataset
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.config import DistillConfig
from fadrm_ray.evaluation.cache import EvalKey, keep
from fadrm_ray.fileio import read_model
from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalParts, EvalSpec, OpenedRun
from fadrm_ray.models import create_model
from fadrm_ray.evaluation.relabel import AugmentSpec, OnlineSoftLabels, SoftLabeler, steps_per_epoch
from fadrm_ray.evaluation.soft_labels import soft_label_source
from fadrm_ray.evaluation.on_device import TestImages, layout as device_layout, optimizer as student_optimizer, student_precision
from fadrm_ray.runtime import autotune_convolutions, torch_threads, tune_allocator
from fadrm_ray.evaluation.scores import Evaluation, StudentScore
from fadrm_ray.config import EvalConfig
from fadrm_ray.settings import EvaluationError
from fadrm_ray.store import open_run
from fadrm_ray.store.reader import RunReader
from fadrm_ray.run.reopen import load_run_teachers, run_dataset

# The published 300 epochs (1000 for IPC 1) are thousands of steps even on 100 images. The
# default is set by steps instead, so that 3 seeds take about a minute on mnist-sample with one
# CPU thread: about DEFAULT_STEPS optimizer steps, between MIN_EPOCHS and MAX_EPOCHS (the
# published IPC-1 count) epochs. Longer still helps: RDED images of mnist-sample IPC 10 give
# 80.7 % at 600 steps and 86.9 % at 2100; set `epochs` when the number matters more than time.
DEFAULT_STEPS = 600
MIN_EPOCHS, MAX_EPOCHS = 40, 1000
DEFAULT_BATCH_SIZE = EvalConfig().batch_size


def default_epochs(num_images: int, batch_size: int = DEFAULT_BATCH_SIZE) -> int:
    """Epochs giving about DEFAULT_STEPS steps, clipped to [MIN_EPOCHS, MAX_EPOCHS]."""
    per_epoch = steps_per_epoch(max(1, num_images), batch_size)
    return int(min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(DEFAULT_STEPS / per_epoch))))


# The published student schedule (docs/method.md section 6).
PUBLISHED_EPOCHS, PUBLISHED_EPOCHS_IPC1 = 300, 1000


def resolve_protocol(cfg: EvalConfig, num_images: int, ipc: int) -> EvalConfig:
    """`cfg` with the epochs and cosine stretch its protocol gives `num_images` images at `ipc`
    images per class, where `cfg` leaves them unset (module docstring)."""
    if cfg.protocol == "published":
        epochs = PUBLISHED_EPOCHS_IPC1 if ipc <= 1 else PUBLISHED_EPOCHS
        stretch = 2.0 if ipc <= 10 else 1.0
    else:
        epochs, stretch = default_epochs(num_images, cfg.batch_size), 1.0
    return cfg.model_copy(update={"epochs": cfg.epochs or epochs, "cosine_stretch": cfg.cosine_stretch or stretch})


def images_per_class(labels: torch.Tensor | None, num_images: int, num_classes: int) -> int:
    """The IPC of a set of images: its largest class, or an even share when labels are unknown."""
    if labels is not None and torch.as_tensor(labels).numel():
        return int(torch.bincount(torch.as_tensor(labels).long()).max())
    return max(1, math.ceil(num_images / max(1, num_classes)))


def epochs_for_steps(num_images: int, steps: int, batch_size: int = DEFAULT_BATCH_SIZE) -> int:
    """Whole epochs that fit in about `steps` optimizer steps (at least one)."""
    return max(1, steps // steps_per_epoch(max(1, num_images), batch_size))


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the temperature-softened distributions, averaged over the batch,
    times T^2 so the gradient scale does not shrink with T (docs/method.md section 6)."""
    t = float(temperature)
    log_p_student = F.log_softmax(student_logits.float() / t, dim=1)
    log_p_teacher = F.log_softmax(teacher_logits.float() / t, dim=1)
    kl = F.kl_div(log_p_student, log_p_teacher, reduction="batchmean", log_target=True)
    return kl * t * t


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on conv/linear weights only, none on biases and norm
    parameters (docs/method.md section 6). One-dimensional tensors are exactly those."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def cosine_factor(epoch: int, epochs: int, stretch: float = 1.0) -> float:
    """Learning-rate multiplier of epoch `epoch` (0-based): the stretched cosine of the module doc."""
    return 0.5 * (1.0 + math.cos(math.pi * epoch / (max(1, epochs) * stretch)))


def _eval_epochs(epochs: int, eval_every: int | None) -> set[int]:
    """0-based epochs after which the test split is evaluated: the last one, and every
    `eval_every` (default: about 6 points in all) counted back from it."""
    every = eval_every or max(1, math.ceil(epochs / 6))
    return set(range(epochs - 1, -1, -every))


class Targets(Protocol):
    """What a student learns instead of soft labels from teachers at hand (ranking.HardLabels,
    from_files.PackedSoftLabels); `teacher_ids` names the teachers behind them, if any."""

    teacher_ids: list[str]

    def source(self, images_uint8: torch.Tensor, batch_size: int, seed: int): ...  # .epoch(e) -> steps

    def loss(self, logits: torch.Tensor, step) -> torch.Tensor: ...


def train_student(images_uint8: torch.Tensor, seed: int, job: EvalJob, spec: EvalSpec | None, parts: EvalParts,
                  hooks: EvalHooks | None = None, *,
                  return_model: bool = False) -> StudentScore | tuple[StudentScore, nn.Module]:
    """Train one student (one seed) on `images_uint8` under `job.config`, with soft labels from
    `parts.labeler` on the loaded `parts.dataset`, on `spec.device` (None: `EvalSpec()`).

    Labels of the images are not used: the targets are the teachers' logits. `job.config.seeds`
    is not read here (`seed` is the one to train). The student is tested on the test images of
    `job.classes` (None: every class). Returns its StudentScore (and the model, `return_model`).
    `hooks.on_eval(seed, epoch, epochs, top1)` is called at every test evaluation (a sweep reports
    it as the student's intermediate result). `job.augment=False` shows the images as they are
    (no crop, flip or CutMix). `parts.targets` replaces the soft labels and their views by its own
    batches and loss (`parts.labeler` is then not read). Stored soft labels go to
    `parts.soft_label_dir`.
    """
    spec, hooks = spec or EvalSpec(), hooks or EvalHooks()
    cfg, labeler, augment = job.config, parts.labeler, job.augment
    dataset = parts.dataset if parts.dataset is not None else _as_dataset(job.dataset)
    targets, on_eval, classes = parts.targets, hooks.on_eval, job.classes
    progress = spec.progress
    if images_uint8.shape[0] == 0:
        raise EvaluationError("no images to train a student on")
    if cfg.epochs is None or cfg.cosine_stretch is None:
        n = images_uint8.shape[0]
        cfg = resolve_protocol(cfg, n, images_per_class(None, n, dataset.num_classes))
    epochs = cfg.epochs
    device_t = torch.device(spec.on_device())
    autotune_convolutions(device_t)
    autocast, scaler = student_precision(device_t)
    layout = device_layout(device_t)
    if targets is None:
        # A whole-image crop (scale 1) and no flip or CutMix leave the images as they are.
        views = AugmentSpec(out_size=dataset.image_size, crop_scale=tuple(cfg.crop_scale) if augment else (1.0, 1.0),
                            hflip=dataset.hflip and augment, cutmix_prob=cfg.cutmix_prob if augment else 0.0)
        labeler = labeler.with_batch_statistics(cfg.teacher_bn == "batch")
        online = OnlineSoftLabels(images_uint8, labeler, views, cfg.batch_size, seed)
        source = soft_label_source(cfg.soft_labels, online, epochs, parts.soft_label_dir, cfg.label_storage())

        def loss_of(logits, step):
            return kd_loss(logits, step.logits.to(device_t), cfg.temperature)
    else:
        source, loss_of = targets.source(images_uint8, cfg.batch_size, seed, device=device_t), targets.loss
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the student's initial weights depend on the seed only
        model = create_model(cfg.student, dataset.num_classes, in_chans=dataset.channels,
                             image_size=dataset.image_size, **cfg.student_kwargs).to(device_t, memory_format=layout)
    optimizer = student_optimizer(param_groups(model, cfg.weight_decay), cfg.lr, device_t)
    # Stepped once per epoch: the rate of epoch e is cfg.lr * cosine_factor(e, ...).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: cosine_factor(epoch, epochs, cfg.cosine_stretch))
    mean = torch.tensor(dataset.mean, device=device_t).view(1, -1, 1, 1)
    std = torch.tensor(dataset.std, device=device_t).view(1, -1, 1, 1)
    evaluate_at = _eval_epochs(epochs, cfg.eval_every)
    # The test images are decoded once per student, not at every test, and kept where the student is.
    test_images = TestImages(dataset.test, dataset, device_t, classes)

    from tqdm.auto import tqdm

    curve: list[tuple[int, float]] = []
    steps = 0
    started = time.perf_counter()
    label = f"student {cfg.student} seed {seed}"
    bar = tqdm(range(epochs), desc=f"{hooks.progress_label}: {label}" if hooks.progress_label else label, unit="epoch",
               disable=not progress, leave=False)
    for epoch in bar:
        model.train()
        for step in source.epoch(epoch):
            x = ((step.view01.to(device_t) - mean) / std).contiguous(memory_format=layout)
            with autocast():
                logits = model(x)
            loss = loss_of(logits.float(), step)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            steps += 1
        scheduler.step()
        if epoch in evaluate_at:
            top1 = test_images.top1(model)
            curve.append((epoch + 1, round(top1, 4)))
            bar.set_postfix(top1=f"{top1:.1f}")
            if on_eval is not None:
                on_eval(seed, epoch + 1, epochs, top1)
    bar.close()
    score = StudentScore(seed=seed, final_top1=curve[-1][1], best_top1=max(v for _, v in curve), curve=curve,
                         epochs=epochs, steps=steps, seconds=time.perf_counter() - started)
    return (score, model) if return_model else score


def _as_dataset(dataset: ImageDataset | str) -> ImageDataset:
    return get_dataset(dataset) if isinstance(dataset, str) else dataset


def _load_labeler(teacher_paths: Sequence[str | Path] | None, dataset: ImageDataset, device: str) -> SoftLabeler:
    """The teachers at `teacher_paths`, loaded to label students on `dataset` (checked to fit it)."""
    if not teacher_paths:
        raise EvaluationError("at least one teacher is needed for soft labels")
    return SoftLabeler.from_paths(list(teacher_paths), dataset, device=device)


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0  # sample std (n - 1) over seeds


def run_classes(config: DistillConfig | None, num_classes: int) -> list[int] | None:
    """The classes a run was distilled for, as its saved config names them; None when it is every
    class of the dataset (then nothing is restricted)."""
    classes = config.classes if config is not None else None
    if classes is None or sorted(classes) == list(range(num_classes)):
        return None
    return sorted(int(c) for c in classes)


def evaluate_images(images_uint8: torch.Tensor, labels: torch.Tensor | None, job: EvalJob,
                    spec: EvalSpec | None = None, parts: EvalParts | None = None, hooks: EvalHooks | None = None, *,
                    known: Mapping[int, StudentScore] | None = None) -> Evaluation:
    """Train a student per seed of `job.config` on uint8 (N, C, H, W) images; report top-1 on the
    real test images of `job.classes` (None: the whole test split; `models.evaluate_top1`).

    The data is `parts.dataset`, else `job.dataset` (a spec). The teachers are `parts.labeler`,
    else the checkpoints `job.teacher_paths`. The students run as `spec` says (None:
    `EvalSpec()`). `labels` are only counted (images per class); the targets come from the
    teachers. The result carries `config`: the recipe with the epochs it ran made explicit.
    `hooks.on_eval` is passed to every student (`train_student`). `known` maps seeds to
    students already trained on these images with these settings: they are not trained again.
    `hooks.on_seed` sees each new student as soon as it is trained (`evaluate_run` keeps it, so
    an interrupted evaluation resumes). `job.augment=False`: students that see the images as they
    are (`train_student`). `parts.targets` replaces the teachers' soft labels (there may then be
    no teachers).
    """
    spec, parts, hooks = spec or EvalSpec(), parts or EvalParts(), hooks or EvalHooks()
    tune_allocator()
    given = parts.dataset if parts.dataset is not None else job.dataset
    if given is None:
        raise EvaluationError("no dataset to test the students on: give a loaded one or a spec")
    dataset = _as_dataset(given)
    if images_uint8.dim() != 4 or tuple(images_uint8.shape[1:]) != (dataset.channels, dataset.image_size, dataset.image_size):
        raise EvaluationError(f"images must be (N, {dataset.channels}, {dataset.image_size}, {dataset.image_size}) for "
                              f"{dataset.name}, got {tuple(images_uint8.shape)}")
    # Record the epochs and stretch that ran, so the saved config repeats this evaluation.
    n = images_uint8.shape[0]
    cfg = resolve_protocol(job.config, n, images_per_class(labels, n, dataset.num_classes))
    targets, classes, augment = parts.targets, job.classes, job.augment
    started = time.perf_counter()
    known = {s: r for s, r in (known or {}).items() if s in cfg.seed_list}
    per_seed = dict(known)
    with torch_threads(spec.threads):
        labeler = parts.labeler
        if labeler is None and (targets is None or job.teacher_paths):
            labeler = _load_labeler(job.teacher_paths, dataset, spec.on_device())
        student_job, student_parts = job.with_config(cfg), replace(parts, dataset=dataset, labeler=labeler)
        for s in cfg.seed_list:
            if s not in per_seed:
                per_seed[s] = train_student(images_uint8, s, student_job, spec, student_parts, hooks)
                if hooks.on_seed is not None:
                    hooks.on_seed(per_seed[s])
    per_seed = [per_seed[s] for s in cfg.seed_list]
    per_class = None
    if labels is not None:
        per_class = torch.bincount(torch.as_tensor(labels).long(), minlength=dataset.num_classes).tolist()
    finals, bests = [r.final_top1 for r in per_seed], [r.best_top1 for r in per_seed]
    return Evaluation(
        top1_mean=round(statistics.fmean(finals), 3), top1_std=round(_spread(finals), 3), top1_per_seed=finals,
        best_top1_mean=round(statistics.fmean(bests), 3), best_top1_std=round(_spread(bests), 3),
        best_top1_per_seed=bests, curves=[r.curve for r in per_seed],
        student=cfg.student, student_kwargs=dict(cfg.student_kwargs), epochs=cfg.epochs,
        steps_per_seed=per_seed[0].steps, seeds=cfg.seed_list, seeds_reused=sorted(known),
        seconds=round(time.perf_counter() - started + sum(r.seconds for r in known.values()), 2),
        images=int(images_uint8.shape[0]), images_per_class=per_class, dataset=dataset.name,
        classes=None if classes is None else list(classes),
        test_size=len(dataset.test.of_classes(classes)),
        teachers=list(labeler.ids) if labeler is not None else list(targets.teacher_ids), config=cfg, augment=augment)


def open_for_evaluation(run_dir: str | Path, job: EvalJob, spec: EvalSpec | None = None,
                        parts: EvalParts | None = None, hooks: EvalHooks | None = None, *,
                        own_teachers: bool = False) -> OpenedRun:
    """The run in `run_dir` opened once for `job` (`OpenedRun`): read at `job.ipc` (a run that is
    not finished only with `job.incomplete`), `hooks.on_open` shown the reader before anything is
    read, then `read_for_evaluation`."""
    reader = open_run(run_dir, incomplete=job.incomplete, ipc=job.ipc)
    if hooks is not None and hooks.on_open is not None:
        hooks.on_open(reader)
    return read_for_evaluation(reader, job, spec, parts, own_teachers=own_teachers)


def read_for_evaluation(reader: RunReader, job: EvalJob, spec: EvalSpec | None = None,
                        parts: EvalParts | None = None, *, own_teachers: bool = False,
                        read: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> OpenedRun:
    """The opened run `reader` made an `OpenedRun`: every image read once and checked against its
    manifest (`read`: what `reader.read()` already gave); the data `parts.dataset` or `job.dataset`
    or the run's own (`run_dataset`: checked by fingerprint, a different test split would make the
    number meaningless); the teachers `parts.labeler`, else the checkpoints `job.teacher_paths`,
    else the run's own (`load_run_teachers`: at the paths the run records, or among
    `job.teacher_copies` where they moved; each loaded and checked once), on `spec.device` (None:
    `EvalSpec()`).
    `own_teachers`: load the run's own teachers even where others label (a baseline's patches are
    picked by them); where they cannot be, `own_missing` says why."""
    spec, parts = spec or EvalSpec(), parts or EvalParts()
    # Read (and checked against the manifests) first: a damaged part fails before any data or teacher loads.
    images, labels, ipc_index = read if read is not None else reader.read()
    if labels.numel() == 0:
        raise EvaluationError(f"{reader.run_dir}: the run has no images yet")
    dataset = run_dataset(reader.run_dir, reader.provenance, parts.dataset if parts.dataset is not None else job.dataset)
    labeler, own, missing = parts.labeler, (), None
    if labeler is None and job.teacher_paths is not None:
        labeler = _load_labeler(job.teacher_paths, dataset, spec.on_device())
    if labeler is None or own_teachers:
        try:
            own = tuple(load_run_teachers(reader.run_dir, reader.provenance, job.teacher_copies, spec.on_device()))
        except EvaluationError as exc:
            if labeler is None:  # nothing else to label the students
                raise
            missing = str(exc)
    if labeler is None:
        labeler = SoftLabeler.from_loaded([m for m, _ in own], [i for _, i in own], spec.on_device())
    return OpenedRun(reader, images, labels, ipc_index, reader.content_hash(), dataset, labeler, own, missing)


def _keep_students(result: Evaluation, seed_files: dict[int, Path]) -> None:
    """Each student of a cached evaluation in its own file, where it is not there yet (an
    evaluation cached before students were kept apart gives them up when it is read)."""
    for student in result.students:
        path = seed_files.get(student.seed)
        if path is not None and not path.is_file():
            with contextlib.suppress(OSError):
                keep(path, student)


def evaluation_key(run: OpenedRun, job: EvalJob, spec: EvalSpec | None, cfg: EvalConfig) -> EvalKey:
    """What decides an evaluation of `run` under `job` with the resolved recipe `cfg`, its students
    on `spec`'s device type (None: `EvalSpec()`) (cache.py)."""
    device = (spec or EvalSpec()).on_device()
    recorded = run.reader.provenance.dataset if run.reader.provenance is not None else None
    # The fingerprint the run records (checked against the data when it was opened): a run recorded
    # under an older rule keeps the cache keys it has.
    data = recorded.fingerprint if recorded is not None and recorded.fingerprint else run.dataset.fingerprint()
    return EvalKey(config=cfg.key_values(), teachers=list(run.labeler.ids), data=data,
                   images=run.content_hash, device=torch.device(device).type,
                   test_classes=run_classes(run.reader.config, run.dataset.num_classes), augment=job.augment)


def evaluate_run(run: OpenedRun, job: EvalJob, spec: EvalSpec | None = None,
                 hooks: EvalHooks | None = None) -> Evaluation:
    """Evaluate the opened store run `run` (`open_for_evaluation`, read at `job.ipc`): students
    trained on its images only, under `job.config`, with its data and teachers, top-1 on the real
    test images of the run's classes (all of them for a run of every class), the students running
    as `spec` says (None: `EvalSpec()`).

    Stored soft labels go to the run's soft-label folder. The result is cached in the run (module
    docstring); `job.cache=False` neither reads nor writes it. The images were checked against the
    run's manifests as they were read, before any cached result is looked up. `hooks.on_eval(seed,
    epoch, epochs, top1)` sees every test evaluation of the students trained (none when the
    result comes from the cache). `job.augment=False`: students that see the images as they are
    (`train_student`).
    """
    spec, hooks = spec or EvalSpec(), hooks or EvalHooks()
    run.check(job)
    reader, images, labels = run.reader, run.images, run.labels
    cfg = resolve_protocol(job.config, images.shape[0], images_per_class(labels, images.shape[0],
                                                                         run.dataset.num_classes))
    # Everything that decides the result names its cached copy: a later identical call (a
    # baseline shared by several runs, a benchmark rerun) reads it instead of training again.
    # Each student is kept on its own too: asking for more seeds later, or again after an
    # interruption, trains only the new ones.
    key = evaluation_key(run, job, spec, cfg)
    cached = reader.layout.evaluation(key.digest())
    seed_files = {s: reader.layout.evaluation(key.student(s).digest()) for s in cfg.seed_list}
    result = read_model(Evaluation, cached) if job.cache else None  # unreadable: evaluate again
    if result is not None:
        _keep_students(result, seed_files)
        return result.model_copy(update={"cached": True})
    known = {}
    for seed, path in (seed_files.items() if job.cache else ()):
        student = read_model(StudentScore, path)  # None: not trained yet, or unreadable: train it
        if student is not None and student.seed == seed:
            known[seed] = student

    def on_seed(student: StudentScore) -> None:
        if job.cache:
            keep(seed_files[student.seed], student)
        if hooks.on_seed is not None:
            hooks.on_seed(student)

    result = evaluate_images(images, labels, job.model_copy(update={"config": cfg, "classes": key.test_classes}), spec,
                             EvalParts(dataset=run.dataset, labeler=run.labeler,
                                       soft_label_dir=reader.layout.soft_labels),
                             replace(hooks, on_seed=on_seed), known=known)
    result = result.model_copy(update=dict(
        run_id=reader.run_id, run_dir=str(reader.run_dir), preset=reader.config.preset if reader.config else None,
        ipc=job.ipc if job.ipc is not None else (reader.config.ipc if reader.config else None),
        content_hash=run.content_hash, complete=reader.complete))
    if job.cache:
        keep(cached, result, exclude={"cached"})
    return result
