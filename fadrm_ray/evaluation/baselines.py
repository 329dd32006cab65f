"""The two baselines every distilled set is judged against (docs/method.md section 7).

A distillation is worth its compute only if its images train a better student than

- **random real images** at the same IPC, classes and seed (preset `random-real`): the floor
  every method must beat, and
- **its own starting patches** (its config at zero recover iterations, preset `patches` with the
  run's patch settings, stored as `patches-<hash>`): what the recover loop added, or took away.

Where the run's patches are random whole images (the `gentle` recipe), its starting patches are
random real images, byte for byte: they are reported once, as the same set (`same_as`), and
their students are trained once. Where the configs tell so (`same_images`), the starting patches
are not distilled at all; otherwise the images, once distilled, decide.

Both are ordinary store runs, distilled beside the run they judge (content-addressed, so every
run of the same classes, IPC, seed and teachers shares them) and evaluated with the very same
settings and soft labels. `evaluate_run` caches each evaluation inside its run, so a baseline is
trained once however many runs ask for it. A baseline already distilled is found read-only
(`find_baseline`: its run opened and read, no lock taken, nothing written); only one that is not
there yet, or not finished, goes through the distill door, which holds its run's writer lock.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from fadrm_ray.config import DistillConfig, make_config
from fadrm_ray.recipes import recipe_to_try
import torch

from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalParts, EvalSpec, OpenedRun
from fadrm_ray.evaluation.evaluate import evaluate_run, read_for_evaluation
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import DistillJob, ExecutionSpec, JobParts, build_job
from fadrm_ray.runs.units import request_images
from fadrm_ray.evaluation.ranking import TEACHERS_RECORD, rank_evaluation
from fadrm_ray.runtime import torch_threads
from fadrm_ray.evaluation.scores import BaselineScore, Evaluation
from fadrm_ray.store.digest import content_digest
from fadrm_ray.teacher_record import TeacherRecord
from fadrm_ray.paired import PairedGain, gain_text, paired_gain
from fadrm_ray.settings import EvaluationError
from fadrm_ray.store import StoreError, open_run
from fadrm_ray.store.reader import RunReader

BASELINES = {"random_real": "random real images", "starting_patches": "its starting patches"}
_PATCH_KEYS = ("patch_selection", "patch_crops", "patch_crop_scale", "patch_candidates", "patch_group", "mosaic")


def baseline_configs(run_config: DistillConfig, ipc: int | None = None) -> dict[str, DistillConfig]:
    """The distill configs of the baselines of a run read at `ipc` (default: the largest IPC the
    run was asked for), from the run's saved config. A run that starts from noise has no
    starting patches to compare with."""
    cfg = run_config
    common = {"ipc": ipc or cfg.ipc, "classes": cfg.classes, "seed": cfg.seed}
    out = {"random_real": make_config("random-real", overrides=common)}
    if cfg.init == "real":
        patch = {k: getattr(cfg, k) for k in _PATCH_KEYS}
        out["starting_patches"] = make_config("patches", overrides={**common, **patch})
    return out


def baseline_job(run: OpenedRun, bcfg: DistillConfig, loaded_teachers: list[tuple],
                 spec: EvalSpec | None = None) -> tuple[DistillJob, JobParts]:
    """The distill job of the baseline `bcfg` of the opened run, in the same store, with the run's
    own teachers (`loaded_teachers`: (model, TeacherRecord) pairs, as `load_run_teachers` gives
    them), whose scores pick the patches, for `spec`'s device (None: `EvalSpec()`); and its parts.
    Building it writes nothing."""
    device = (spec or EvalSpec()).on_device()
    parts = JobParts.of(run.dataset, loaded_teachers, device)
    distill_job = build_job(bcfg, run.dataset, run.dataset.name, parts.infos, run.reader.run_dir.parent,
                            torch.device(device).type)
    return distill_job, parts


def find_baseline(distill_job: DistillJob) -> tuple[RunReader, tuple] | None:
    """The baseline run of `distill_job` where it is already distilled, finished, with every image
    of the request: its reader (at the job's IPC) and its images as `reader.read()` gave them,
    checked against the manifests. None where it is not (then the distill door makes it). Reads
    only: no lock, no file written."""
    try:
        reader = open_run(Path(distill_job.store) / distill_job.run_id, ipc=distill_job.config.ipc)
        read = reader.read()
    except StoreError:  # not there, not finished, or damaged: the door makes or repairs it
        return None
    if read[1].numel() != request_images(distill_job.config, distill_job.num_classes):
        return None
    return reader, read


def distill_baseline(run: OpenedRun, bcfg: DistillConfig, loaded_teachers: list[tuple], job: EvalJob,
                     spec: EvalSpec | None = None):
    """The baseline `bcfg` of the opened run, distilled (or found) beside it in the same store
    (`baseline_job`), on `spec`'s device and threads (None: `EvalSpec()`); returns the
    DistillResult. The distill door holds the baseline run's writer lock."""
    return _distill(*baseline_job(run, bcfg, loaded_teachers, spec), spec or EvalSpec())


def _distill(distill_job: DistillJob, parts: JobParts, spec: EvalSpec):
    with torch_threads(spec.threads):
        return execute.run(distill_job, ExecutionSpec(local=True, device=spec.on_device(), progress=False), parts)


def open_baseline(run: OpenedRun, bcfg: DistillConfig, job: EvalJob, spec: EvalSpec | None = None, *,
                  built: tuple[DistillJob, JobParts] | None = None) -> OpenedRun:
    """The baseline `bcfg` of the opened run, opened for `job` with the run's data and soft
    labels: found read-only where it is distilled already (`find_baseline`), else distilled first
    (`distill_baseline`, under its run's writer lock). `built`: its `baseline_job`, where the
    caller built it already."""
    spec = spec or EvalSpec()
    distill_job, parts = built or baseline_job(run, bcfg, list(run.own_teachers), spec)
    found = find_baseline(distill_job)
    if found is None:
        made = _distill(distill_job, parts, spec)
        reader = open_run(made.run_dir, ipc=made.ipc)
        found = reader, reader.read()
    reader, read = found
    return read_for_evaluation(reader, baseline_eval_job(job, reader), spec,
                               EvalParts(dataset=run.dataset, labeler=run.labeler), read=read)


def baseline_eval_job(job: EvalJob, reader: RunReader) -> EvalJob:
    """`job` as it reads the baseline run `reader`: at the IPC it was opened at, finished."""
    return job.model_copy(update={"ipc": reader.ipc, "incomplete": False})


# What random whole images (patch_selection "whole") do not read: how a crop would be drawn
# (patches.class_patch_images takes the image as it is).
_WHOLE_IGNORES = ("patch_crops", "patch_crop_scale", "patch_group")


def same_images(a: DistillConfig, b: DistillConfig) -> bool:
    """Whether two resolved baseline configs give the very same images, decided from the configs
    alone (nothing distilled): both random whole images, and equal in everything else that a
    set read as it starts depends on (the preset only names them). False where the configs
    cannot tell; the images themselves then decide (`_pixels`)."""
    if a.patch_selection != "whole" or b.patch_selection != "whole":
        return False
    skip = {"preset", *_WHOLE_IGNORES}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)


def _pixels(run: OpenedRun) -> str:
    """The content digest of an opened run's images and labels (`store.digest`: not of its files,
    which record the config that made them)."""
    return content_digest(run.images, run.labels, run.ipc_index)


def below_random(paired: PairedGain | None, recipe: str, image_size: int, channels: int) -> str | None:
    """One line when a set is clearly below random real images of its size (`paired`: its
    paired gain over them, below zero by more than two standard errors), naming what to try
    (`recipes.recipe_to_try` for its `recipe` on such images); None otherwise or with one seed."""
    if paired is None or not paired.clearly_below:
        return None
    return (f"this set is clearly below random real images of the same size ({gain_text(paired)}); "
            f"{recipe_to_try(recipe, image_size, channels)}")


def evaluate_with_baselines(run: OpenedRun, job: EvalJob, spec: EvalSpec | None = None,
                            hooks: EvalHooks | None = None, *, ranking: bool = True, ars: bool = False) -> Evaluation:
    """`evaluate_run` of the opened run under `job`, plus `baselines` (each baseline's top-1 under the
    same settings and soft labels), `gains` (the run's top-1 minus each baseline's, in points)
    and `paired_gains` (the same gains seed by seed, with their standard error: `paired_gain`).

    The baselines are distilled with the run's own teachers (patch scores depend on them: where
    the run records them, or among `job.teacher_copies` where they moved, checked by sha256); the
    students of all three learn from `job.teacher_paths` (default: the run's own), all of them
    distilled and trained as `spec` says (None: `EvalSpec()`), with the run's data. The run must be
    opened with its own teachers (`open_for_evaluation(..., own_teachers=True)`). A baseline
    already distilled is found read-only (`open_baseline`). A baseline that cannot be built (a
    teacher file gone) is reported with its error instead of a number. `job.ipc` reads the run,
    and builds the baselines, at that IPC (as `evaluate_run` does).

    `ranking` adds DD-Ranking's scores (`ranking.rank_evaluation`: HLR, IOR and LRS; ARS too with
    `ars`), which train hard-label students on the run and, once per dataset, on its full
    training split.
    """
    spec, hooks = spec or EvalSpec(), hooks or EvalHooks()
    if not (run.own_teachers or run.own_missing):
        raise ValueError(f"{run.run_dir} was opened without its own teachers, which distill its baselines "
                         f"(open_for_evaluation(..., own_teachers=True))")
    reader, dataset = run.reader, run.dataset
    result = evaluate_run(run, job, spec, replace(hooks, progress_label="the run"))
    baselines, gains, paired, evaluations, opened, seen = {}, {}, {}, {}, {}, {}
    if hooks.on_note is not None and hooks.on_plan is None and reader.config is not None:  # else the plan said it
        sets = list(baseline_configs(reader.config, job.ipc))
        took = "" if result.cached else f", about {result.seconds:.0f} s each as the run's own took"
        hooks.on_note(f"baselines: {len(sets)} more sets ({', '.join(BASELINES[n] for n in sets)}), each distilled "
                      f"once and its {len(result.seeds)} students trained unless kept{took}; --no-baselines skips them")
    if reader.config is None:  # a bare copy of the part files: nothing to derive the baselines from
        baselines["random_real"] = BaselineScore(error=f"{reader.run_dir} has no {reader.layout.config.name}")
    for name, bcfg in (baseline_configs(reader.config, job.ipc) if reader.config is not None else {}).items():
        if run.own_missing is not None:
            baselines[name] = BaselineScore(error=run.own_missing)
            continue
        try:
            built = baseline_job(run, bcfg, list(run.own_teachers), spec)
            twin = next((other for other, (_, config) in opened.items() if same_images(config, built[0].config)),
                        None)
            if twin is not None:  # the same images as a baseline before it, known before any is distilled
                made = opened[twin][0]
                baselines[name] = BaselineScore(run_id=made.reader.run_id, run_dir=str(made.run_dir),
                                                preset=bcfg.preset, same_as=twin)
                continue
            made = open_baseline(run, bcfg, job, spec, built=built)
            images = _pixels(made)
            if images in seen:  # the same images as a baseline before it (whole random images both)
                baselines[name] = BaselineScore(run_id=made.reader.run_id, run_dir=str(made.run_dir),
                                                preset=bcfg.preset, same_as=seen[images])
                continue
            seen[images], opened[name] = name, (made, built[0].config)
            ev = result if made.reader.run_id == reader.run_id else evaluate_run(
                made, baseline_eval_job(job, made.reader), spec, replace(hooks, progress_label=BASELINES[name]))
        except (EvaluationError, OSError, ValueError) as exc:
            baselines[name] = BaselineScore(error=str(exc))
            continue
        baselines[name], evaluations[name] = ev.brief(), ev
        gains[name] = round(result.top1_mean - ev.top1_mean, 3)
        paired[name] = paired_gain(result.top1_per_seed, ev.top1_per_seed)
    scores = None
    if ranking:
        scores = rank_evaluation(run, result, evaluations.get("random_real"), job, spec, hooks, ars=ars,
                                 random_run=opened["random_real"][0] if "random_real" in opened else None)
    recipe = reader.config.recipe if reader.config is not None else ""
    teachers = [info for _, info in run.own_teachers] or list(reader.provenance.teachers)
    warnings = [below_random(paired.get("random_real"), recipe, dataset.image_size, dataset.channels),
                weak_teacher(scores, teachers)]
    return result.model_copy(update={"baselines": baselines, "gains": gains, "paired_gains": paired,
                                     "ranking": scores, "warnings": [w for w in warnings if w]})


# A teacher this many points below a full-data hard-label student is the weak part of a set.
WEAK_TEACHER_POINTS = 5.0


def weak_teacher(scores, teachers: Sequence[TeacherRecord]) -> str | None:
    """One line where DD-Ranking's full-data reference student (hard labels, the whole training
    split) beats the best teacher's recorded test top-1 by more than WEAK_TEACHER_POINTS: the
    soft labels teach less than the data itself, whatever the images; the remedy named is the one
    that fits where that teacher came from (`stronger_teacher`). None otherwise."""
    known = [t for t in teachers if t.test_accuracy is not None and t.test_accuracy == t.test_accuracy]
    if scores is None or scores.full_hard_top1 is None or not known or scores.full_source == TEACHERS_RECORD:
        return None
    best = max(known, key=lambda t: t.test_accuracy)
    gap = scores.full_hard_top1 - best.test_accuracy
    if gap <= WEAK_TEACHER_POINTS:
        return None
    return (f"the teacher is the weak part: its test top-1 ({best.test_accuracy:.2f}%) is {gap:.1f} points below a "
            f"student trained on the full data with hard labels ({scores.full_hard_top1:.2f}%), and students of its "
            f"soft labels learn what it knows; {stronger_teacher(best)}")


def stronger_teacher(teacher: TeacherRecord) -> str:
    """How to get a stronger teacher than `teacher`, by where it came from: one trained here
    (`fadrm squeeze`) is trained longer or larger; one imported from weights trained elsewhere
    (timm, torchvision, a file) is fine-tuned further where it was trained, or replaced by
    stronger weights, which `fadrm import-teacher` takes as it took these."""
    if teacher.imported is None:
        epochs = (teacher.squeeze_config or {}).get("epochs")
        longer = max(60, 4 * epochs) if isinstance(epochs, int) else 60
        return (f"train a longer one (`fadrm squeeze --epochs {longer}`) or a larger one "
                f"(`fadrm squeeze --model resnet18-cifar`)")
    model = teacher.model_name or "the model"
    return (f"its weights were trained elsewhere ({teacher.imported.source}): fine-tune them further on this "
            f"dataset where they were trained, or import stronger ones (`fadrm import-teacher --model {model} "
            f"--weights FILE`, or a larger timm or torchvision model)")
