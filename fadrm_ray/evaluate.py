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
import hashlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fadrm_ray.data import get_dataset
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.eval_job import EvalJob, EvalParts
from fadrm_ray.models import create_model, evaluate_top1
from fadrm_ray.recover import mixed_precision
from fadrm_ray.relabel import AugmentSpec, OnlineSoftLabels, SoftLabeler, steps_per_epoch
from fadrm_ray.soft_label_store import soft_label_source
from fadrm_ray.runtime import torch_threads, tune_allocator
from fadrm_ray.scores import Evaluation, StudentScore
from fadrm_ray.settings import EvalConfig, EvaluationError
from fadrm_ray.fileio import atomic_write_text
from fadrm_ray.store import open_run

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


# Part of every evaluation's cache key: raise it when a change of student training changes results.
EVALUATION_CACHE_VERSION = 1
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
    student.PackedSoftLabels); `teacher_ids` names the teachers behind them, if any."""

    teacher_ids: list[str]

    def source(self, images_uint8: torch.Tensor, batch_size: int, seed: int): ...  # .epoch(e) -> steps

    def loss(self, logits: torch.Tensor, step) -> torch.Tensor: ...


def train_student(images_uint8: torch.Tensor, seed: int, job: EvalJob, parts: EvalParts, *,
                  return_model: bool = False) -> StudentScore | tuple[StudentScore, nn.Module]:
    """Train one student (one seed) on `images_uint8` under `job.config`, with soft labels from
    `parts.labeler` on the loaded `parts.dataset`.

    Labels of the images are not used: the targets are the teachers' logits. `job.config.seeds`
    is not read here (`seed` is the one to train). The student is tested on the test images of
    `parts.classes` (None: every class). Returns its StudentScore (and the model, `return_model`).
    `parts.on_eval(seed, epoch, epochs, top1)` is called at every test evaluation (a sweep reports
    it as the student's intermediate result). `job.augment=False` shows the images as they are
    (no crop, flip or CutMix). `parts.targets` replaces the soft labels and their views by its own
    batches and loss (`parts.labeler` is then not read). Stored soft labels go to
    `parts.soft_label_dir`.
    """
    cfg, labeler, augment = job.config, parts.labeler, job.augment
    dataset = parts.dataset if parts.dataset is not None else _as_dataset(job.dataset)
    targets, on_eval, classes = parts.targets, parts.on_eval, parts.classes
    progress = job.progress
    if images_uint8.shape[0] == 0:
        raise EvaluationError("no images to train a student on")
    if cfg.epochs is None or cfg.cosine_stretch is None:
        n = images_uint8.shape[0]
        cfg = resolve_protocol(cfg, n, images_per_class(None, n, dataset.num_classes))
    epochs = cfg.epochs
    device_t = torch.device(job.on_device())
    autocast, scaler = student_precision(device_t)
    layout = torch.channels_last if device_t.type == "cuda" else torch.contiguous_format
    if targets is None:
        # A whole-image crop (scale 1) and no flip or CutMix leave the images as they are.
        spec = AugmentSpec(out_size=dataset.image_size, crop_scale=tuple(cfg.crop_scale) if augment else (1.0, 1.0),
                           hflip=dataset.hflip and augment, cutmix_prob=cfg.cutmix_prob if augment else 0.0)
        labeler = labeler.with_batch_statistics(cfg.teacher_bn == "batch")
        online = OnlineSoftLabels(images_uint8, labeler, spec, cfg.batch_size, seed)
        source = soft_label_source(cfg.soft_labels, online, epochs, parts.soft_label_dir, cfg.label_storage())

        def loss_of(logits, step):
            return kd_loss(logits, step.logits.to(device_t), cfg.temperature)
    else:
        source, loss_of = targets.source(images_uint8, cfg.batch_size, seed), targets.loss
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the student's initial weights depend on the seed only
        model = create_model(cfg.student, dataset.num_classes, in_chans=dataset.channels,
                             image_size=dataset.image_size, **cfg.student_kwargs).to(device_t, memory_format=layout)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    # Stepped once per epoch: the rate of epoch e is cfg.lr * cosine_factor(e, ...).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: cosine_factor(epoch, epochs, cfg.cosine_stretch))
    mean = torch.tensor(dataset.mean, device=device_t).view(1, -1, 1, 1)
    std = torch.tensor(dataset.std, device=device_t).view(1, -1, 1, 1)
    evaluate_at = _eval_epochs(epochs, cfg.eval_every)

    from tqdm.auto import tqdm

    curve: list[tuple[int, float]] = []
    steps = 0
    started = time.perf_counter()
    bar = tqdm(range(epochs), desc=parts.progress_label or f"student {cfg.student} seed {seed}", unit="epoch",
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
            top1 = evaluate_top1(model, dataset.test, dataset, classes=classes)
            curve.append((epoch + 1, round(top1, 4)))
            bar.set_postfix(top1=f"{top1:.1f}")
            if on_eval is not None:
                on_eval(seed, epoch + 1, epochs, top1)
    bar.close()
    score = StudentScore(seed=seed, final_top1=curve[-1][1], best_top1=max(v for _, v in curve), curve=curve,
                         epochs=epochs, steps=steps, seconds=time.perf_counter() - started)
    return (score, model) if return_model else score


def student_precision(device: torch.device):
    """How students compute: on CUDA under autocast (bf16 where the GPU has it, else fp16 with a
    gradient scaler); on a CPU in fp32, as the recorded results were trained. Returns (autocast
    context factory, GradScaler or None)."""
    if device.type != "cuda":
        return contextlib.nullcontext, None
    return mixed_precision("bf16" if torch.cuda.is_bf16_supported() else "fp16", device)


def _as_dataset(dataset: ImageDataset | str) -> ImageDataset:
    return get_dataset(dataset) if isinstance(dataset, str) else dataset


def _as_labeler(teachers, dataset: ImageDataset, device: str) -> SoftLabeler:
    if isinstance(teachers, SoftLabeler):
        return teachers
    if isinstance(teachers, (str, Path)):
        teachers = [teachers]
    teachers = list(teachers or [])
    if not teachers:
        raise EvaluationError("at least one teacher is needed for soft labels")
    return SoftLabeler.from_paths(teachers, dataset, device=device)


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0  # sample std (n - 1) over seeds


def run_classes(config: dict, num_classes: int) -> list[int] | None:
    """The classes a run was distilled for, as its saved config names them; None when it is every
    class of the dataset (then nothing is restricted)."""
    classes = config.get("classes")
    if classes is None or sorted(classes) == list(range(num_classes)):
        return None
    return sorted(int(c) for c in classes)


def evaluate_images(images_uint8: torch.Tensor, labels: torch.Tensor | None, job: EvalJob,
                    parts: EvalParts | None = None) -> Evaluation:
    """Train a student per seed of `job.config` on uint8 (N, C, H, W) images; report top-1 on the
    real test images of `parts.classes` (None: the whole test split; `models.evaluate_top1`).

    The data is `parts.dataset`, else `job.dataset` (a spec). The teachers are `parts.labeler`,
    else the checkpoints `job.teachers`. `labels` are only counted (images per class); the
    targets come from the teachers. The result carries `config`: the recipe with the epochs it
    ran made explicit. `parts.on_eval` is passed to every student (`train_student`).
    `parts.known` maps seeds to students already trained on these images with these settings:
    they are not trained again. `parts.on_seed` sees each new student as soon as it is trained
    (`evaluate_run` keeps it, so an interrupted evaluation resumes). `job.augment=False`:
    students that see the images as they are (`train_student`). `parts.targets` replaces the
    teachers' soft labels (there may then be no teachers).
    """
    parts = parts or EvalParts()
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
    targets, classes, augment = parts.targets, parts.classes, job.augment
    teachers = parts.labeler if parts.labeler is not None else job.teachers
    started = time.perf_counter()
    known = {s: r for s, r in (parts.known or {}).items() if s in cfg.seed_list}
    per_seed = dict(known)
    with torch_threads(job.threads):
        labeler = _as_labeler(teachers, dataset, job.on_device()) if targets is None or teachers else None
        student_job, student_parts = job.with_config(cfg), replace(parts, dataset=dataset, labeler=labeler)
        for s in cfg.seed_list:
            if s not in per_seed:
                per_seed[s] = train_student(images_uint8, s, student_job, student_parts)
                if parts.on_seed is not None:
                    parts.on_seed(per_seed[s])
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
        classes=None if classes is None else sorted(int(c) for c in classes),
        test_size=len(dataset.test.of_classes(classes)),
        teachers=list(labeler.ids) if labeler is not None else list(targets.teacher_ids), config=cfg, augment=augment)


def run_teacher_paths(provenance: dict) -> list[dict]:
    """The teachers a run was distilled with, as recorded in its provenance: [{path, sha256}]."""
    return [t for t in provenance.get("teachers", []) if isinstance(t, dict) and t.get("path")]


# What a message about the run's data or teachers suggests: the argument of the library
# functions, and the option of `fadrm evaluate` and `fadrm verify` (--repair) that sets it. The
# run's own teachers where they are now are `teacher_copies` (EvalJob, repair_run), checked by
# sha256 against the run's; `EvalJob.teachers` would replace them unchecked.
GIVE_DATASET = "dataset=... (--dataset SPEC)"
GIVE_TEACHERS = "teacher_copies=[...] (--teacher PATH)"


def _check_teacher_file(entry: dict) -> str:
    from fadrm_ray.fileio import sha256_file

    path = Path(entry["path"])
    if not path.is_file():
        where = "" if path.is_absolute() else " (a path relative to the directory the run was distilled in)"
        raise EvaluationError(f"teacher {path} recorded in the run does not exist here{where}; say where the "
                              f"same file is now: {GIVE_TEACHERS}")
    want = entry.get("sha256")
    if want and sha256_file(path) != want:
        raise EvaluationError(f"teacher {path} has changed since the run was distilled (sha256 differs from the "
                              f"recorded {want[:12]}...); give a copy of the teacher it was distilled with: "
                              f"{GIVE_TEACHERS}")
    return str(path)


def run_dataset(reader, dataset: ImageDataset | str | None = None) -> ImageDataset:
    """The data the run was distilled from, checked by fingerprint (a different test split would
    make any number about the run meaningless): `dataset` (a spec or a loaded dataset: where the
    run's data is now), else the dataset the run records, reopened by its spec. Runs distilled
    before the spec was recorded name a folder or Parquet dataset only by its folder's name,
    which reopens only from the directory they were distilled in."""
    recorded = reader.provenance.get("dataset") or {}
    want = recorded.get("fingerprint")
    if dataset is None:
        spec = recorded.get("spec") or recorded.get("name")
        if not spec:
            raise EvaluationError(f"{reader.run_dir}: the run records no dataset; name it: {GIVE_DATASET}")
        try:
            dataset = get_dataset(spec)
        except ValueError as exc:
            older = "" if recorded.get("spec") else " (the run records its name only)"
            raise EvaluationError(f"{reader.run_dir}: dataset {spec!r} of the run cannot be reopened here{older}: "
                                  f"{exc}; say where its data is now: {GIVE_DATASET}") from None
    else:
        dataset = _as_dataset(dataset)
    if want and dataset.fingerprint() != want:
        raise EvaluationError(f"dataset {dataset.name} (fingerprint {dataset.fingerprint()}) is not the data the run "
                              f"was distilled from ({recorded.get('name')}, fingerprint {want}); give the run's own "
                              f"data: {GIVE_DATASET}")
    return dataset


def run_teachers(reader, copies: Sequence[str | Path] | None = None) -> list[str]:
    """The teacher checkpoints the run was distilled with, in its order, each checked against the
    sha256 the run records: found among `copies` (the same files where they are now, matched by
    sha256: `--teacher PATH`), else at the path the run records. A copy that is none of the
    run's teachers is refused; with nothing recorded to check them against, `copies` are
    returned as they are."""
    from fadrm_ray.fileio import sha256_file

    entries = run_teacher_paths(reader.provenance)
    if not entries and copies:
        return [str(path) for path in copies]
    if not entries:
        raise EvaluationError(f"{reader.run_dir}: the run records no teacher; name its teachers: {GIVE_TEACHERS}")
    found: dict[str, str] = {}
    recorded = [e.get("sha256") for e in entries]
    for path in copies or ():
        if not Path(path).is_file():
            raise EvaluationError(f"teacher {path} does not exist")
        digest = sha256_file(path)
        if digest not in recorded:
            known = ", ".join(f"{d[:12]}..." for d in recorded if d)
            raise EvaluationError(f"teacher {path} is not one the run was distilled with (its sha256 {digest[:12]}... "
                                  f"is none of the run's: {known})")
        found.setdefault(digest, str(path))
    return [found[e["sha256"]] if e.get("sha256") in found else _check_teacher_file(e) for e in entries]


def _digest(key_source: dict) -> str:
    return hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()[:32]


def _keep_students(result: Evaluation, seed_files: dict[int, Path]) -> None:
    """Write each student of a cached evaluation to its own file, where it is not there yet."""
    for student in result.students:
        path = seed_files.get(student.seed)
        if path is not None and not path.is_file():
            atomic_write_text(path, student.model_dump_json())


def _read(model, path: Path):
    """`model` read from the JSON file `path`, or None when it is missing or not one (train again)."""
    try:
        return model.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None


def evaluate_run(run_dir: str | Path, job: EvalJob, parts: EvalParts | None = None) -> Evaluation:
    """Evaluate a store run: students trained on the run's images only, under `job.config`, top-1
    on the real test images of the run's classes (all of them for a run of every class).

    `job.ipc` reads the run at that IPC (IPC indices 0..ipc-1 of every class: what a distillation
    at that IPC asked for); None takes every image the run holds.

    Teachers default to the run's own (`run_teachers`: at the paths the run records, or among
    `job.teacher_copies` where they moved; their sha256 is checked); `job.teachers` (or a loaded
    `parts.labeler`) replaces them. The dataset, `parts.dataset` or `job.dataset` or by default
    the one the run records, is checked by fingerprint (`run_dataset`: a different test split
    would make the number meaningless). Stored soft labels go to the run's soft-label folder.
    The result is cached in the run (module docstring); `job.cache=False` neither reads nor
    writes it. The images are checked against the run's manifests as they are read, before any
    cached result is looked up; a run that is not finished is evaluated only with
    `job.incomplete`. `parts.on_eval(seed, epoch, epochs, top1)` sees every test evaluation of
    the students trained (none when the result comes from the cache). `job.augment=False`:
    students that see the images as they are (`train_student`).
    """
    parts = parts or EvalParts()
    device, cache, augment, ipc = job.on_device(), job.cache, job.augment, job.ipc
    reader = open_run(run_dir, incomplete=job.incomplete, ipc=ipc)
    dataset = run_dataset(reader, parts.dataset if parts.dataset is not None else job.dataset)
    teachers = parts.labeler
    if teachers is None:
        teachers = run_teachers(reader, job.teacher_copies) if job.teachers is None else job.teachers
    images, labels, _ = reader.read()
    if labels.numel() == 0:
        raise EvaluationError(f"{reader.run_dir}: the run has no images yet")
    cfg = resolve_protocol(job.config, images.shape[0], images_per_class(labels, images.shape[0], dataset.num_classes))
    labeler = _as_labeler(teachers, dataset, device)
    classes = run_classes(reader.config, dataset.num_classes)
    # Everything that decides the result names its cached copy: a later identical call (a
    # baseline shared by several runs, a benchmark rerun) reads it instead of training again.
    key_source = {"config": cfg.key_values(), "teachers": list(labeler.ids), "data": dataset.fingerprint(),
                  "images": reader.content_hash(), "device": torch.device(device).type,
                  "version": EVALUATION_CACHE_VERSION}
    if classes is not None:  # tested on the subset's test images (runs of every class keep their key)
        key_source["test_classes"] = classes
    if not augment:  # likewise: augmented evaluations keep the key they had
        key_source["augment"] = False
    cached = reader.layout.evaluation(_digest(key_source))
    # Each student is kept on its own too, keyed by the same things but its seed instead of the
    # seed list: asking for more seeds later, or again after an interruption, trains only the new ones.
    per_seed_source = {**key_source, "config": {k: v for k, v in key_source["config"].items() if k != "seeds"}}
    seed_files = {s: reader.layout.evaluation(_digest({**per_seed_source, "seed": s})) for s in cfg.seed_list}
    result = _read(Evaluation, cached) if cache and cached.is_file() else None  # unreadable: evaluate again
    if result is not None:
        # An evaluation cached before students were kept apart gives them up now (where it can).
        with contextlib.suppress(OSError):
            _keep_students(result, seed_files)
        return result.model_copy(update={"cached": True})
    known = {}
    for seed, path in (seed_files.items() if cache else ()):
        student = _read(StudentScore, path)  # None: not trained yet, or unreadable: train it
        if student is not None and student.seed == seed:
            known[seed] = student

    def keep(student: StudentScore) -> None:
        if cache:
            atomic_write_text(seed_files[student.seed], student.model_dump_json())

    result = evaluate_images(images, labels, job.with_config(cfg),
                             replace(parts, dataset=dataset, labeler=labeler, soft_label_dir=reader.layout.soft_labels,
                                     classes=classes, known=known, on_seed=keep))
    result = result.model_copy(update=dict(
        run_id=reader.run_id, run_dir=str(reader.run_dir), preset=reader.config.get("preset"),
        ipc=ipc if ipc is not None else reader.config.get("ipc"), content_hash=reader.content_hash(),
        complete=reader.complete))
    if cache:
        atomic_write_text(cached, result.model_dump_json(exclude={"cached"}))
    return result
