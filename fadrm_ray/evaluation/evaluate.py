"""Evaluate distilled images: a student per seed (training.py), their top-1 summed up, cached in a run.

`evaluate_images` trains the students of one set of images; `open_for_evaluation` /
`read_for_evaluation` open a store run once for an evaluation (its images read and checked, its
data and teachers loaded); `evaluate_run` evaluates the opened run. Evaluations of a store run are cached inside the run (`evaluate_run`), keyed by everything that
decides the result: the resolved settings, the teachers, the test data and the run's images. Each
student is kept on its own as well, so more seeds later train only the new students.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
import statistics
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from fadrm_ray.data.base import ImageDataset
from fadrm_ray.config import DistillConfig
from fadrm_ray.evaluation.cache import EvalKey, keep
from fadrm_ray.fileio import read_model
from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalParts, EvalSpec, OpenedRun
from fadrm_ray.evaluation.on_device import TestImages
from fadrm_ray.evaluation.relabel import SoftLabeler
from fadrm_ray.runtime import torch_threads, tune_allocator
from fadrm_ray.evaluation.scores import Evaluation, StudentScore
from fadrm_ray.evaluation.training import as_dataset, images_per_class, resolve_protocol, train_student
from fadrm_ray.config import EvalConfig
from fadrm_ray.settings import EvaluationError
from fadrm_ray.store import open_run
from fadrm_ray.store.reader import RunReader
from fadrm_ray.runs.reopen import load_run_teachers, run_dataset


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
    no teachers). The test split is decoded once for all the students (`parts.test_images`, else
    here).
    """
    spec, parts, hooks = spec or EvalSpec(), parts or EvalParts(), hooks or EvalHooks()
    tune_allocator()
    given = parts.dataset if parts.dataset is not None else job.dataset
    if given is None:
        raise EvaluationError("no dataset to test the students on: give a loaded one or a spec")
    dataset = as_dataset(given)
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
        todo = [s for s in cfg.seed_list if s not in per_seed]
        test_images = parts.test_images
        if todo and test_images is None:  # decoded once for every student of this evaluation
            test_images = TestImages(dataset.test, dataset, torch.device(spec.on_device()), classes)
        student_job = job.with_config(cfg)
        student_parts = replace(parts, dataset=dataset, labeler=labeler, test_images=test_images)
        for s in todo:
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


def kept_files(run: OpenedRun, job: EvalJob, spec: EvalSpec | None = None) -> tuple[EvalConfig, EvalKey, Path,
                                                                                   dict[int, Path]]:
    """Where an evaluation of the opened run under `job` is kept: its recipe resolved for the
    run's images, its key, the file of the whole evaluation and the file of each seed's student.
    Everything that decides the result names its cached copy: a later identical call (a baseline
    shared by several runs, a benchmark rerun) reads it instead of training again. Each student
    is kept on its own too: asking for more seeds later, or again after an interruption, trains
    only the new ones."""
    images, labels = run.images, run.labels
    cfg = resolve_protocol(job.config, images.shape[0], images_per_class(labels, images.shape[0],
                                                                         run.dataset.num_classes))
    key = evaluation_key(run, job, spec, cfg)
    layout = run.reader.layout
    return cfg, key, layout.evaluation(key.digest()), {s: layout.evaluation(key.student(s).digest())
                                                       for s in cfg.seed_list}


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
    cfg, key, cached, seed_files = kept_files(run, job, spec)
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
