"""The pilot: on colour data no one measured, `auto` takes the recipe that measured best here.

The recipes `auto` knows rest on evidence from other data (recipes.RECIPES); on unseen data the
released crops can train students well below random real images of the same size. So before a
run whose recipe is left to `auto` on such data (`pilot_record.pilot_reason`), `ensure_pilot`
measures, at a small and bounded size:

1. a sample of the classes (`PilotConfig.classes`, drawn by the data's content hash), a few
   images per class (`ipc`, the run's where smaller);
2. random real images, the size family's released recipe and the candidates of the run's IPC
   (`recipes.pilot_candidates`: at IPC 1 the gentle recovery from random whole images and the
   mosaics of random whole images; above it random crops, whole teacher-picked images with a
   smaller step and the gentle recovery), each distilled with its recover budget cut to
   `recover_share` of its recipe's;
3. students of the first `student_steps` steps of the published schedule (`student_schedule`)
   with paired seeds on each set, under the teachers' soft labels, tested on the sampled classes.

It keeps the candidate with the best mean top-1 where it is clearly above the IPC's safe one
(the mosaics at IPC 1, the gentle recovery above it), else the safe one (`choose`), with each
one's paired gain over random real images, and says in one line when the one it keeps is not
level with them. Its cost is estimated from a timed
probe of this device and printed before it starts; it may always spend `free_seconds`, and above
that at most `max_share` of the run's estimated recover time: its sizes are scaled down to fit,
or, below `min_scale`, it is skipped and says so. The record is cached in the store
(`pilot_record.keep_pilot`), where every door that builds a job finds it; its sets are ordinary
runs in `STORE/.pilots/`, so an interrupted pilot resumes where it stopped.
"""
from __future__ import annotations

import copy
import random
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from fadrm_ray.paired import paired_gain
from fadrm_ray.config import DistillConfig, EvalConfig, PilotConfig, make_config
from fadrm_ray.recipes import RECIPES, auto_recipe, pilot_candidates
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.fileio import sha256_file
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.estimate import RunShape, StepTimer, run_seconds, seconds_text
from fadrm_ray.evaluation.plan import student_step_seconds
from fadrm_ray.evaluation.training import DEFAULT_BATCH_SIZE, epochs_for_steps, resolve_protocol
from fadrm_ray.models import load_teacher
from fadrm_ray.pilot_record import (PILOTS_DIR, PilotRecord, PilotRow, cached_pilot, keep_pilot, machine_pilots,
                                    pilot_file, pilot_reason)
from fadrm_ray.evaluation.relabel import SoftLabeler
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, JobParts, build_job
from fadrm_ray.runtime import resolve_device

_MIN_STEPS = 50
# How the library's caller bounds or skips the pilot (a door with flags of its own says its own).
BOUND_HINT = "PilotConfig.budget bounds it (0 skips it), and recipe=NAME skips it"


def candidates(image_size: int, channels: int, ipc: int) -> list[str]:
    """The recipes a pilot tries on such images for a run at `ipc`: the size family's released
    one first, then `recipes.pilot_candidates`."""
    return [auto_recipe(image_size, channels), *pilot_candidates(ipc).recipes]


def choose(rows: Sequence[PilotRow], safe: str) -> str:
    """The recipe the pilot keeps: the best mean top-1 where it is clearly above (by more than two
    paired standard errors) the `safe` one (`recipes.pilot_candidates`: the one the full-size
    grids found best at such IPCs, the gentle recovery from IPC 2, which starts from random real
    images and stays near them); the safe one where the pilot cannot tell them apart, since a
    wrong guess there costs little and a wrong guess the other way can cost many points."""
    best = max(rows, key=lambda r: r.top1_mean)
    kept = next((r for r in rows if r.recipe == safe), None)
    if kept is None or best is kept:
        return best.recipe
    return best.recipe if paired_gain(best.top1_per_seed, kept.top1_per_seed).clearly_above else kept.recipe


def student_schedule(images: int, ipc: int, steps: int, seeds: int) -> EvalConfig:
    """The pilot's students: the first `steps` steps of the published schedule for `images`
    images at `ipc` (its learning rate at each step as there, not a shorter cosine that decays
    before the students have learned what tells the sets apart), `seeds` paired seeds."""
    published = resolve_protocol(EvalConfig(protocol="published"), images, ipc)
    epochs = min(published.epochs, epochs_for_steps(images, steps, DEFAULT_BATCH_SIZE))
    return published.model_copy(update={"epochs": epochs, "seeds": seeds,
                                        "cosine_stretch": published.epochs * published.cosine_stretch / epochs})


def _sample_classes(dataset: ImageDataset, count: int) -> list[int]:
    rng = random.Random(dataset.fingerprint())
    return sorted(rng.sample(range(dataset.num_classes), min(count, dataset.num_classes)))


# Test evaluations of each pilot student (`training.epochs_tested`: about six), each image a forward
# pass, about a third of a training step's work per image.
_TESTS_PER_STUDENT, _FORWARD_SHARE = 6, 1 / 3


def set_config(cfg: DistillConfig, base: dict, recipe: str, share: float) -> DistillConfig:
    """The pilot's set of `recipe` for a run of `cfg`: on its classes and IPC (`base`), the
    recipe's recover iterations cut to `share`."""
    iterations = max(cfg.k + 1, round(RECIPES[recipe].values["iterations"] * share))
    return DistillConfig.model_validate(cfg.model_copy(update={**base, "recipe": recipe, "iterations": iterations,
                                                               "stage_iterations": None}).model_dump())


class PilotPlan:
    """A pilot's sizes after its bound, and its cost and the run's, estimated from the real steps
    timed here (`estimate`: each set's patch scoring and recover steps as this process runs them,
    the students' steps; the run's units as `run_shape` runs them): seconds. The bound is the
    user's (`settings.budget`: 0 skips the pilot) or `free_seconds`, above it `max_share` of the
    run's estimated time at the size's own recipe (the first of `recipes`). `runs` is the run's
    estimate at each recipe, `sets` the estimate of each set in the order they are measured
    (random real images first), which the progress bar calibrates as they finish."""

    def __init__(self, settings: PilotConfig, recipes: list[str], cfg: DistillConfig, parts: JobParts,
                 run_shape: RunShape | None = None, student: str | None = None):
        dataset = parts.dataset
        teachers = [FrozenTeacher(model, in_chans=info.in_chans) for model, info in zip(parts.models, parts.infos)]
        try:
            self._plan(settings, recipes, cfg, parts, StepTimer(teachers, dataset, parts.device), run_shape, student)
        finally:
            for teacher in teachers:
                teacher.remove_hooks()

    def _plan(self, settings: PilotConfig, recipes: list[str], cfg: DistillConfig, parts: JobParts, timer: StepTimer,
              run_shape: RunShape | None, student: str | None) -> None:
        dataset = parts.dataset
        device_type = torch.device(parts.device).type
        self.recipes = recipes
        self.classes = _sample_classes(dataset, settings.classes)
        self.ipc = min(cfg.ipc, settings.ipc)
        self.base = {"classes": self.classes, "ipc": self.ipc, "seed": cfg.seed}
        images = len(self.classes) * self.ipc
        schedule = student_schedule(images, self.ipc, settings.student_steps, settings.seeds)
        labeler = SoftLabeler.from_loaded(parts.models, parts.infos, parts.device)
        per_step = student_step_seconds(dataset, labeler, student or EvalConfig().student, min(schedule.batch_size, images),
                                        parts.device)
        tests = len(dataset.test.of_classes(self.classes)) * _TESTS_PER_STUDENT * _FORWARD_SHARE / schedule.batch_size

        def resolved(config: DistillConfig) -> DistillConfig:
            return config.resolve(dataset.image_size, dataset.num_classes, dataset.hflip, device_type,
                                  channels=dataset.channels)

        def sets(share: float, steps: int) -> dict[str, float]:
            students = settings.seeds * (steps + tests) * per_step
            here = RunShape.here()
            return {"random-real": students, **{r: run_seconds(resolved(set_config(cfg, self.base, r, share)), dataset,
                                                               timer, here) + students for r in recipes}}

        full = sets(settings.recover_share, settings.student_steps)
        self.full = sum(full.values())
        shape = run_shape or RunShape.here()
        self.runs = {r: run_seconds(resolved(cfg.model_copy(update={"recipe": r})), dataset, timer, shape)
                     for r in recipes}
        self.run = self.runs[recipes[0]]
        self.budget = settings.budget if settings.budget is not None else \
            max(settings.free_seconds, settings.max_share * self.run)
        self.seeds = settings.seeds
        self.scale, self.sets = 1.0, full
        # Scaled down to fit the bound: not all of a set's cost scales (its patch scoring, the
        # students' least steps), so the sizes are fitted to the estimate at those sizes.
        for _ in range(3):
            if sum(self.sets.values()) <= self.budget * 1.02:
                break
            self.scale *= self.budget / sum(self.sets.values())
            self.sets = sets(settings.recover_share * self.scale, max(_MIN_STEPS, round(settings.student_steps *
                                                                                         self.scale)))
        self.share = settings.recover_share * self.scale
        self.steps = max(_MIN_STEPS, round(settings.student_steps * self.scale))
        self.estimate = sum(self.sets.values())

    def share_of_run(self) -> str:
        """The pilot's estimate beside the run's, as a share of it (or a multiple)."""
        if self.run <= 0:
            return "the run's estimate is not known"
        ratio = self.estimate / self.run
        share = f"{ratio:.0%} of" if ratio < 1 else f"{ratio:.1f}x"
        others = ", ".join(f"{seconds_text(seconds)} at {r}" for r, seconds in self.runs.items()
                           if r != self.recipes[0])
        return f"{share} this run's estimated {seconds_text(self.run)} at recipe {self.recipes[0]} ({others})"


def plan_pilot(cfg: DistillConfig, parts: JobParts, settings: PilotConfig,
               run_shape: RunShape | None = None) -> PilotPlan:
    """The pilot of a run of `cfg` on `parts.dataset`, sized to its bound from steps timed on this
    device; the run as `run_shape` will run it (default: in this process)."""
    return PilotPlan(settings, candidates(parts.dataset.image_size, parts.dataset.channels, cfg.ipc), cfg, parts,
                     run_shape)


class _Progress:
    """A progress bar of the pilot in seconds, with an ETA that calibrates the plan's estimate on
    the sets already measured (their time against their estimate), ticking while a set runs."""

    def __init__(self, plan: PilotPlan, show: bool):
        from tqdm.auto import tqdm

        self.plan, self.done, self.predicted, self.started = plan, [], [], time.perf_counter()
        self.bar = tqdm(total=round(plan.estimate), desc="pilot", unit="s", disable=not show, leave=False,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}")
        self.bar.set_postfix_str(f"about {plan.estimate:.0f} s left (estimated)")
        self.stop = threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True, name="fadrm-pilot-progress")
        self.ticker.start()

    def _left(self) -> float:
        factor = sum(self.done) / sum(self.predicted) if self.predicted else 1.0
        remaining = [s for name, s in self.plan.sets.items()][len(self.done):]
        return max(0.0, sum(remaining) * factor - (time.perf_counter() - self.started - sum(self.done)))

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            elapsed = time.perf_counter() - self.started
            self.bar.total = max(round(elapsed + self._left()), round(elapsed) + 1)
            self.bar.n = round(elapsed)
            calibrated = "calibrated on the sets measured" if self.done else "estimated"
            self.bar.set_postfix_str(f"about {self._left():.0f} s left ({calibrated})")

    def finished(self, name: str, seconds: float) -> None:
        self.done.append(seconds)
        self.predicted.append(self.plan.sets[name])

    def close(self) -> None:
        self.stop.set()
        self.ticker.join(timeout=5)
        self.bar.close()


def _placed(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A loaded teacher on `device`: itself where it is there already, else a copy moved there
    (`Module.to` moves in place, and the caller's teacher stays on its device)."""
    first = next(model.parameters(), None)
    if first is None or first.device == torch.device(device):
        return model
    return copy.deepcopy(model).to(device)


class PilotCaller(NamedTuple):
    """What the door that runs a pilot adds: a progress bar (`progress`), how the run the pilot
    sizes will run its units (`run_shape`, `estimate.RunShape`; None: this process), and how its
    user bounds or skips the pilot (`bound_hint`, said in its lines)."""

    progress: bool = True
    run_shape: RunShape | None = None
    bound_hint: str = BOUND_HINT


def ensure_pilot(cfg: DistillConfig, dataset: ImageDataset, teachers: Sequence[str | Path] | JobParts,
                 store: str | Path, settings: PilotConfig | None = None, *, device: str | None = None,
                 on_line: Callable[[str], None] = print, caller: PilotCaller | None = None) -> PilotRecord | None:
    """The pilot for a run of `cfg` on `dataset` with these teachers into `store`: None where no
    pilot is run (`pilot_reason`), the cached record where one was measured with these settings
    (in this store, or on this machine for another: then kept in this store too), else measured
    now (module docstring), cached and returned. Every line for the user (the cost before it
    starts, each set as it is measured, the choice, a set below random real images) goes to
    `on_line`; a progress bar with its ETA to stderr (`caller.progress`). `teachers`: their checkpoint
    paths, or the teachers the caller loaded already (`JobParts` of `dataset`), which are then
    neither hashed nor loaded again (and stay on the caller's device). `caller`: what the door
    adds (`PilotCaller`: the run's estimate follows its `run_shape`)."""
    settings, caller = settings or PilotConfig(), caller or PilotCaller()
    reason = pilot_reason(cfg, dataset)
    if reason is not None:
        return None
    loaded = teachers if isinstance(teachers, JobParts) else None
    fingerprint = dataset.fingerprint()
    shas = tuple(info.sha256 for info in loaded.infos) if loaded is not None else \
        tuple(sha256_file(p) for p in teachers)
    cached = cached_pilot(store, fingerprint, shas, cfg.ipc)
    if cached is not None and cached.settings.model_copy(update={"budget": settings.budget}) == settings:
        where = Path(store) / PILOTS_DIR
        if not (where / pilot_file(fingerprint, shas, cfg.ipc)).is_file():  # this machine's, for another store
            keep_pilot(store, cached)
            where = machine_pilots()
        on_line(f"{cached.summary()} (measured before: {where})")
        return cached
    common = dict(dataset=dataset.name, dataset_fingerprint=fingerprint, teachers=shas, ipc=cfg.ipc, settings=settings)
    if settings.budget == 0:
        record = PilotRecord(**common, chosen=candidates(dataset.image_size, dataset.channels, cfg.ipc)[0],
                             skipped="--pilot-budget 0")
        on_line(record.summary())
        return record
    device = resolve_device(device)
    if loaded is not None:
        parts = JobParts(loaded.dataset, [_placed(model, device) for model in loaded.models], loaded.infos, device)
    else:
        parts = JobParts.of(dataset, [load_teacher(p, device=device) for p in teachers], device)
    plan, bound_hint = plan_pilot(cfg, parts, settings, caller.run_shape), caller.bound_hint
    recipes = plan.recipes
    common.update(estimated_seconds=round(plan.estimate, 1), run_estimate_seconds=round(plan.run, 1),
                  run_estimates={r: round(v, 1) for r, v in plan.runs.items()})
    if plan.scale < settings.min_scale:
        bound = (f"its budget of {settings.budget:.0f} s" if settings.budget is not None else
                 f"its bound of {plan.budget:.0f} s (the larger of {settings.free_seconds:.0f} s and "
                 f"{settings.max_share:.0%} of this run's estimated {plan.run:.0f} s; {bound_hint})")
        record = PilotRecord(**common, chosen=recipes[0], skipped=(
            f"it would take about {plan.full:.0f} s, and at its smallest size ({settings.min_scale:.0%}) about "
            f"{plan.full * settings.min_scale:.0f} s, more than {bound}"))
        on_line(record.summary())
        return record
    on_line(f"pilot: {len(recipes)} recipes ({', '.join(recipes)}) beside random real images on {len(plan.classes)} "
            f"classes at IPC {plan.ipc}, each recover budget cut to {plan.share:.0%}, {plan.seeds} students of "
            f"{plan.steps} steps per set: about {plan.estimate:.0f} s here, {plan.share_of_run()}; {bound_hint}")
    started = time.perf_counter()
    bar = _Progress(plan, caller.progress)
    labeler = SoftLabeler.from_loaded(parts.models, parts.infos, device)
    eval_cfg = student_schedule(len(plan.classes) * plan.ipc, plan.ipc, plan.steps, plan.seeds)
    pilot_store = Path(store) / PILOTS_DIR
    base = plan.base

    def measure(name: str, set_cfg: DistillConfig) -> PilotRow:
        begun = time.perf_counter()
        job = build_job(set_cfg, dataset, dataset.name, parts.infos, pilot_store, torch.device(device).type)
        execute.run(job, ExecutionSpec(local=True, device=device, progress=False), parts)
        # Read at the pilot's IPC: a run holds every IPC of its settings, and another pilot of the
        # same data may have grown it further.
        result = evaluate_store_run(job.run_dir, EvalJob(config=eval_cfg, ipc=plan.ipc), EvalSpec(progress=False),
                                    parts=EvalParts(dataset=dataset, labeler=labeler)).evaluation
        row = PilotRow(recipe=name, run_id=job.run_id, top1_per_seed=result.top1_per_seed,
                       top1_mean=result.top1_mean, images=result.images, seconds=round(time.perf_counter() - begun, 1),
                       estimated_seconds=round(plan.sets[name], 1))
        bar.finished(name, row.seconds)
        on_line(f"pilot: {name}: top-1 {row.top1_mean:.2f} on the sampled classes ({row.seconds:.0f} s)")
        return row

    try:
        random_real = measure("random-real", make_config("random-real", overrides=base))
        rows = []
        for name in recipes:
            row = measure(name, set_config(cfg, base, name, plan.share))
            rows.append(row.model_copy(update={"vs_random": paired_gain(row.top1_per_seed,
                                                                        random_real.top1_per_seed)}))
    finally:
        bar.close()
    chosen = choose(rows, pilot_candidates(cfg.ipc).safe)
    record = PilotRecord(**common, classes=plan.classes, pilot_ipc=plan.ipc, scale=round(plan.scale, 3), rows=rows,
                         random_real=random_real, chosen=chosen, seconds=round(time.perf_counter() - started, 1))
    keep_pilot(store, record)
    on_line(record.summary() + f" (estimated {plan.estimate:.0f} s)")
    if record.below_random is not None:
        on_line(f"warning: {record.below_random}")
    if record.cannot_tell is not None:
        on_line(record.cannot_tell)
    return record
