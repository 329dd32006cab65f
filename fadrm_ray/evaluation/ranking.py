"""DD-Ranking's scores of a distilled set: how much of its result is the images, not the labels.

A student trained on distilled images with a teacher's soft labels learns much of what it knows
from the teacher; the same soft labels on random real images already train a good student.
DD-Ranking (Li et al., 2025) separates the two with scores this module computes for every
evaluation with baselines (`baselines.evaluate_with_baselines`; docs/method.md section 6b):

- HLR, hard-label recovery: the top-1 of a student trained on the whole training split with hard
  labels, minus that of a student trained on the set with hard labels (the images' own classes,
  no teacher). Lower is better: the set recovers more of the full data.
- IOR, improvement over random: the set's top-1 minus that of random real images of the same
  size under the same recipe (soft labels, augmentation, schedule): the `random_real` baseline.
- LRS, label-robust score: alpha = w * IOR - (1 - w) * HLR with accuracies as fractions of 1,
  mapped to [0, 1] by (e^alpha - e^-1) / (e - e^-1); w = 0.5 as on DD-Ranking's leaderboard.
- ARS, augmentation-robust score: beta = g * IOR + (1 - g) * IOR', where IOR' is the IOR again
  with students that see the images as they are (no crop, flip or CutMix), mapped like LRS;
  g = 0.5. It needs two more evaluations (the set and the random images, unaugmented), so it is
  asked for (`ars=True`, `fadrm evaluate --ars`).

Every score is taken seed by seed (the students of one seed share their initial weights and
data order) and averaged over seeds, as DD-Ranking averages over its evaluation rounds. Hard-
label students train as DD-Ranking's do by default: cross-entropy, no augmentation, the same
optimizer and schedule as the soft-label students of the set.

The full-data student depends on the dataset, the classes, the student and the protocol, and on
nothing about a run or a teacher: it is trained once and kept beside the store's runs, in
`<store>/references/`, where every run of that data (and every store that shares the folder)
finds it. A teacher's folder would tie it to a teacher it does not depend on.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from fadrm_ray.data.base import ImageDataset
from fadrm_ray.evaluation.cache import EVALUATION_CACHE_VERSION, EvalKey, digest, keep
from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalParts, EvalSpec, OpenedRun
from fadrm_ray.evaluation.on_device import TestImages
from fadrm_ray.evaluation.training import epochs_for_steps, train_student
from fadrm_ray.evaluation.evaluate import evaluate_run, run_classes
from fadrm_ray.fileio import atomic_write_text, read_model
from fadrm_ray.evaluation.hard_labels import HardLabels, SplitCount, StreamedHardLabels
from fadrm_ray.evaluation.relabel import steps_per_epoch
from fadrm_ray.runtime import torch_threads
from fadrm_ray.evaluation.scores import Evaluation, Ranking, StudentScore
from fadrm_ray.config import EvalConfig

WEIGHT = 0.5  # w of LRS and gamma of ARS: DD-Ranking's default, both parts counted alike
# The full-data student: larger batches than a distilled set's students (a training split has
# thousands of images), for about FULL_DATA_STEPS steps under the short protocol and
# FULL_DATA_EPOCHS epochs under the published one.
FULL_DATA_BATCH = 128
FULL_DATA_STEPS = 500
FULL_DATA_EPOCHS = 30
REFERENCES = "references"  # the folder of full-data students, beside the store's runs


# --------------------------------------------------------------------------- the scores
def normalized(x: float) -> float:
    """(e^x - e^-1) / (e - e^-1): [-1, 1] onto [0, 1], as DD-Ranking maps its weighted sums."""
    return (math.exp(x) - math.exp(-1.0)) / (math.e - math.exp(-1.0))


def label_robust_score(hlr: float, ior: float, weight: float = WEIGHT) -> float:
    """LRS of one seed from its HLR and IOR in points."""
    return normalized(weight * ior / 100.0 - (1.0 - weight) * hlr / 100.0)


def augmentation_robust_score(ior: float, plain_ior: float, weight: float = WEIGHT) -> float:
    """ARS of one seed from its IOR with and without augmentation, in points."""
    return normalized(weight * ior / 100.0 + (1.0 - weight) * plain_ior / 100.0)


def _mean(values: Sequence[float], digits: int) -> float | None:
    return round(statistics.fmean(values), digits) if values else None


def _differences(a: Sequence[float] | None, b: Sequence[float] | None) -> list[float]:
    if not a or not b:
        return []
    if len(a) != len(b):
        raise ValueError(f"paired seeds must match: {len(a)} against {len(b)}")
    return [x - y for x, y in zip(a, b)]


def ranking_scores(top1: Sequence[float], random_top1: Sequence[float] | None = None,
                   full_hard_top1: float | None = None, hard_top1: Sequence[float] | None = None,
                   plain_top1: Sequence[float] | None = None, plain_random_top1: Sequence[float] | None = None,
                   weight: float = WEIGHT, missing: Sequence[str] = ()) -> Ranking:
    """The scores from per-seed top-1 values (points): the set's (`top1`) and the random real
    images' (`random_top1`) under the evaluation's recipe, the full-data hard-label student's,
    the set's hard-label students' (`hard_top1`), and the set's and random images' students
    without augmentation (`plain_*`). A score whose inputs are not given is None."""
    ior = _differences(top1, random_top1)
    hlr = [full_hard_top1 - h for h in hard_top1 or ()] if full_hard_top1 is not None else []
    plain = _differences(plain_top1, plain_random_top1)
    if hlr and ior and len(hlr) != len(ior):
        raise ValueError(f"paired seeds must match: {len(hlr)} against {len(ior)}")
    lrs = [label_robust_score(h, i, weight) for h, i in zip(hlr, ior)]
    ars = [augmentation_robust_score(i, p, weight) for i, p in zip(ior, plain)] if len(plain) == len(ior) else []
    return Ranking(full_hard_top1=full_hard_top1, hard_top1_per_seed=list(hard_top1 or ()), hlr=_mean(hlr, 3),
                   ior=_mean(ior, 3), lrs=_mean(lrs, 4), plain_ior=_mean(plain, 3), ars=_mean(ars, 4),
                   weight=weight, missing=list(missing))


def _cached_student(path: Path, train) -> StudentScore:
    """The student kept at `path`, or `train()`'s, kept there (an unreadable file is trained again)."""
    student = read_model(StudentScore, path)
    if student is None:
        student = train()
        keep(path, student)
    return student


def full_data_config(cfg: EvalConfig, num_images: int) -> EvalConfig:
    """The full-data student's settings: the evaluation's student and optimizer, its own batch
    and schedule (module constants), one seed."""
    epochs = FULL_DATA_EPOCHS if cfg.protocol == "published" else \
        epochs_for_steps(num_images, FULL_DATA_STEPS, FULL_DATA_BATCH)
    return cfg.model_copy(update={"epochs": epochs, "batch_size": FULL_DATA_BATCH, "cosine_stretch": 1.0,
                                  "seeds": [0]})


# Where the full-data figure comes from when the reference student was over its step budget.
TEACHERS_RECORD = ("the teacher's recorded test top-1 (trained on the whole split; the reference student was over "
                   "the step budget)")


class FullReference(NamedTuple):
    top1: float
    source: str  # what the figure is: a full-data student (kept where), or the teachers' record


class FullDataPlan(NamedTuple):
    """The full-data student of an evaluation, before it trains: its settings, the file that keeps
    it, its steps, the images it reads, and whether it is there already or over the step budget
    (then a teacher's record stands in and it never trains)."""

    config: EvalConfig
    path: Path
    steps: int
    images: int
    kept: bool
    over_budget: bool


def full_data_plan(dataset: ImageDataset, cfg: EvalConfig, references: str | Path,
                   classes: Sequence[int] | None = None, device: str = "cpu") -> FullDataPlan:
    """Where the full-data student of `dataset` (its `classes`) is kept, and what training it costs."""
    split = dataset.train.of_classes(classes)
    full = full_data_config(cfg, len(split))
    key = {"kind": "full-data hard labels", "data": dataset.fingerprint(), "student": full.student,
           "student_kwargs": full.student_kwargs, "protocol": full.protocol, "epochs": full.epochs,
           "batch_size": full.batch_size, "lr": full.lr, "weight_decay": full.weight_decay,
           "classes": None if classes is None else sorted(int(c) for c in classes),
           "device": torch.device(device).type, "version": EVALUATION_CACHE_VERSION}
    path = Path(references) / f"full-hard-{digest(key)}.json"
    steps = full.epochs * steps_per_epoch(len(split), full.batch_size)
    return FullDataPlan(full, path, steps, len(split), read_model(StudentScore, path) is not None,
                        steps > cfg.reference_steps)


def full_data_student(dataset: ImageDataset, cfg: EvalConfig, references: str | Path, *,
                      classes: Sequence[int] | None = None, device: str = "cpu", progress: bool = False,
                      teacher_top1: Sequence[float] = (), on_note=None) -> FullReference:
    """A student trained on the whole training split (of `classes`) with hard labels, tested like
    the set's; kept in `references` by dataset, classes, student and protocol (module docstring).

    One that is not kept yet costs `full_data_config`'s epochs over the split, said beforehand
    through `on_note`; where that is more than `cfg.reference_steps` steps, the best of
    `teacher_top1` (the teachers' recorded test top-1, a model trained on the same data) stands in
    for it, and where no teacher recorded one, ValueError names the budget. The split is read
    batch by batch, never whole."""
    split = dataset.train.of_classes(classes)
    full, path, steps, _, _, over_budget = full_data_plan(dataset, cfg, references, classes, device)
    what = f"a {full.student} trained with hard labels on the {len(split):,} training images"
    kept = read_model(StudentScore, path)
    if kept is not None:
        return FullReference(kept.final_top1, f"{what} (kept in {path.parent})")
    note = on_note or (lambda line: None)
    if over_budget:
        over = (f"DD-Ranking's full-data reference would train {what} for {full.epochs} epochs ({steps:,} steps), "
                f"over the budget of {cfg.reference_steps:,} steps (--set reference_steps=N raises it)")
        usable = [t for t in teacher_top1 if t == t]
        if not usable:
            raise ValueError(f"{over}, and no teacher records a test top-1 to stand in for it")
        note(f"{over}: the teacher's recorded test top-1 ({max(usable):.2f}%) stands in for it")
        return FullReference(max(usable), TEACHERS_RECORD)
    note(f"DD-Ranking's full-data reference: {what} for {full.epochs} epochs ({steps:,} steps of "
         f"{full.batch_size}), once for this data, kept in {path.parent}; --no-ranking skips it")
    job, spec = EvalJob(config=full, classes=classes), EvalSpec(device=device, progress=progress)
    parts = EvalParts(dataset=dataset, targets=StreamedHardLabels(split))
    hooks = EvalHooks(progress_label=f"DD-Ranking full-data reference ({len(split):,} images)")
    student = train_student(SplitCount(len(split)), 0, job, spec, parts, hooks)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, student.model_dump_json())
    return FullReference(student.final_top1, f"{what} (kept in {path.parent})")


def hard_label_students(run: OpenedRun, evaluation: Evaluation, job: EvalJob,
                        spec: EvalSpec | None = None) -> list[StudentScore]:
    """One hard-label student per seed of `evaluation` on the opened run's images (read at
    `job.ipc`, as `evaluate_run` reads them), with its settings (epochs included), each kept in
    the run's evaluation folder; they train on `spec.device` (with a progress bar where
    `spec.progress`; None: `EvalSpec()`)."""
    spec = spec or EvalSpec()
    device, dataset = spec.on_device(), run.dataset
    classes = run_classes(run.reader.config, dataset.num_classes)
    cfg = evaluation.config
    files = hard_label_files(run, cfg, device, evaluation.seeds)
    job, spec = EvalJob(config=cfg, classes=classes), EvalSpec(device=device, progress=spec.progress)
    hooks = EvalHooks(progress_label="the run, hard labels")
    shared: list[EvalParts] = []  # the test split decoded once, for the first student not kept

    def train(seed: int) -> StudentScore:
        if not shared:
            shared.append(EvalParts(dataset=dataset, targets=HardLabels(run.labels),
                                    test_images=TestImages(dataset.test, dataset, torch.device(device), classes)))
        return train_student(run.images, seed, job, spec, shared[0], hooks)

    return [_cached_student(files[seed], lambda seed=seed: train(seed)) for seed in evaluation.seeds]


def hard_label_files(run: OpenedRun, cfg: EvalConfig, device: str,
                     seeds: Sequence[int] | None = None) -> dict[int, Path]:
    """Where each seed's hard-label student on the opened run's images, under the resolved
    recipe `cfg`, is kept (in the run's evaluation folder); `seeds`: the recipe's by default."""
    key = EvalKey(kind="hard labels", config=cfg.key_values(), data=run.dataset.fingerprint(),
                  images=run.content_hash, test_classes=run_classes(run.reader.config, run.dataset.num_classes),
                  device=torch.device(device).type)
    return {seed: run.reader.layout.evaluation(key.student(seed).digest()) for seed in (cfg.seed_list if seeds is None else seeds)}


# --------------------------------------------------------------------------- one evaluation's ranking
def rank_evaluation(run: OpenedRun, result: Evaluation, random_real: Evaluation | None, job: EvalJob,
                    spec: EvalSpec | None, hooks: EvalHooks | None = None, *, ars: bool = False,
                    random_run: OpenedRun | None = None) -> Ranking:
    """The scores of the opened run's evaluation `result` (the run read at `job.ipc`) beside its
    `random_real` baseline's (None when that baseline could not be built; `random_run`: that
    baseline's run, opened, which ARS evaluates again): HLR, IOR and LRS, and ARS with `ars`
    (students of the run's labeler, without augmentation), the students running as `spec` says
    (None: `EvalSpec()`); `hooks.on_note` hears of a cost before it is paid. What cannot be
    measured is named in `missing`, with why, instead of failing the evaluation."""
    spec, hooks = spec or EvalSpec(), hooks or EvalHooks()
    dataset, device, progress = run.dataset, spec.on_device(), spec.progress
    missing, full_top1, hard, plain, plain_random = [], None, None, None, None
    random_top1 = None if random_real is None else random_real.top1_per_seed
    if random_real is None:
        missing.append("IOR, LRS and ARS: no random real images to compare with")
    store = run.reader.run_dir.parent
    recorded = [t.test_accuracy for t in run.reader.provenance.teachers if t.test_accuracy is not None]
    full_source = None
    with torch_threads(spec.threads):
        try:
            full_top1, full_source = full_data_student(dataset, result.config, store / REFERENCES,
                                                       classes=result.classes, device=device, progress=progress,
                                                       teacher_top1=recorded,
                                                       on_note=hooks.on_note if hooks.on_plan is None else None)
            if hooks.on_note is not None and hooks.on_plan is None and not result.cached:  # else the plan said it
                hooks.on_note(f"DD-Ranking: {len(result.seeds)} hard-label students on the run's images, about "
                              f"{result.seconds:.0f} s (as its soft-label students) unless kept; --no-ranking skips them")
            hard = [s.final_top1 for s in hard_label_students(run, result, job, spec)]
        except (OSError, ValueError) as exc:
            missing.append(f"HLR and LRS: {exc}")
        if ars and random_real is not None and random_run is None:
            missing.append("ARS: the random real images' run was not handed over to evaluate again")
        elif ars and random_real is not None:
            plain_job = job.model_copy(update={"config": result.config, "augment": False})
            try:
                plain = evaluate_run(run, plain_job, spec, hooks).top1_per_seed
                plain_random = evaluate_run(random_run, plain_job.model_copy(
                    update={"ipc": random_run.reader.ipc, "incomplete": False}), spec, hooks).top1_per_seed
            except (OSError, ValueError) as exc:
                missing.append(f"ARS: {exc}")
        elif not ars:
            missing.append("ARS: not asked for (two more evaluations without augmentation; --ars)")
    ranking = ranking_scores(result.top1_per_seed, random_top1, full_top1, hard, plain, plain_random, missing=missing)
    return ranking.model_copy(update={"full_source": full_source})


def hard_label_ranking(run: OpenedRun, result: Evaluation, job: EvalJob, spec: EvalSpec | None = None) -> Ranking:
    """What the images of the opened run's evaluation `result` reach with their hard labels alone
    (one student per seed, `hard_label_students`, on `spec`'s device and threads, without a
    progress bar; None: `EvalSpec()`), beside nothing else: the part of `rank_evaluation` whose
    cost is the evaluation's own (no full-data student, no random real images)."""
    spec = spec or EvalSpec()
    with torch_threads(spec.threads):
        quiet = spec.model_copy(update={"progress": False})
        hard = [s.final_top1 for s in hard_label_students(run, result, job, quiet)]
    return ranking_scores(result.top1_per_seed, hard_top1=hard,
                          missing=["HLR, IOR, LRS and ARS: not measured here (fadrm evaluate measures them)"])


def hard_label_line(ranking: Ranking, soft_top1: float) -> str | None:
    """What the images reach with their hard labels alone, beside `soft_top1` (the soft-label
    top-1 of the same students' seeds), in words that follow the sign of the difference; None
    where it was not measured."""
    hard = ranking.hard_label_text()
    if hard is None:
        return None
    gap = statistics.fmean(ranking.hard_top1_per_seed) - soft_top1
    if gap < 0:
        return (f"the images with their hard labels only: {hard}, {-gap:.2f} points below the soft-label top-1 "
                f"above: the images need the teacher's soft labels (`fadrm export --with-teacher` or "
                f"`--soft-labels` ships them)")
    return (f"the images with their hard labels only: {hard}, {gap:.2f} points at or above the soft-label top-1 "
            f"above: these images teach at least as well without the teacher")


def ranking_text(ranking: Ranking) -> str:
    """'HLR 3.10 (full data, hard labels: 99.72%), IOR +0.54, LRS 0.4900' (and ARS), for the
    scores that were measured."""
    parts = []
    if ranking.hlr is not None:
        against = "the teacher's recorded top-1" if ranking.full_source == TEACHERS_RECORD else "full data, hard labels"
        parts.append(f"HLR {ranking.hlr:.2f} ({against}: {ranking.full_hard_top1:.2f}%)")
    if ranking.ior is not None:
        parts.append(f"IOR {ranking.ior:+.2f}")
    for name in ("lrs", "ars"):
        value = getattr(ranking, name)
        if value is not None:
            parts.append(f"{name.upper()} {value:.4f}")
    return ", ".join(parts) or "not measured"
