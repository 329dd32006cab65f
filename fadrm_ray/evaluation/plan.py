"""What an evaluation will train, said before it trains anything: its plan.

`fadrm evaluate` trains much more than the students asked for: the baselines beside the run
(random real images, the run's starting patches: each distilled first, then its students),
DD-Ranking's full-data reference (once per dataset) and its hard-label students, ARS's students
without augmentation. `plan_evaluation` lists each set it will train, how many students (those
already kept are read back, not counted), their steps, the estimated seconds of each and the flag
that skips it, and the total; from a student step timed here (`student_step_seconds`: soft
labels with augmentation, hard labels without; the pilot's students are timed by it too) and,
for a baseline still to distill, its steps timed as the run's are (`estimate.run_seconds`). The
door prints it first and the time it took at the end.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from fadrm_ray.config import EvalConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.estimate import RunShape, StepTimer, run_seconds, seconds_text, timed
from fadrm_ray.evaluation.baselines import BASELINES, baseline_configs, baseline_eval_job, baseline_job, same_images
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec, OpenedRun
from fadrm_ray.evaluation.evaluate import kept_files, read_for_evaluation, run_classes
from fadrm_ray.evaluation.ranking import REFERENCES, full_data_plan, hard_label_files
from fadrm_ray.evaluation.relabel import AugmentSpec, apply_plan, draw_plan, epoch_generator, steps_per_epoch, to_unit
from fadrm_ray.evaluation.training import epochs_tested, kd_loss, param_groups
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.layout import RunLayout
from fadrm_ray.models import create_model
from fadrm_ray.store import StoreError, open_run

# A test image's forward pass, as a share of a training step's work per view (no backward, no
# teacher, no augmentation).
_FORWARD_SHARE = 1 / 3


class PlannedSet(BaseModel):
    """One set an evaluation trains students on."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str                  # what the set is
    students: int              # students to train (those kept are read back)
    kept: int = 0              # students already kept
    steps: int = 0             # optimizer steps of each
    seconds: float = 0.0       # estimated: its students, and what is distilled first
    first: str = ""            # what comes before its students (a baseline distilled)
    detail: str = ""           # what else it is
    flag: str                  # the flag that skips (or sizes) it


class EvalPlan(BaseModel):
    """An evaluation's sets, in the order they train, and what they cost."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    sets: list[PlannedSet]
    student: str
    step_seconds: float        # a soft-label student's step, as timed here

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.sets)

    def lines(self) -> list[str]:
        """The plan as the user reads it: one line per set, then the total."""
        out = [f"plan: {sum(s.students for s in self.sets)} {self.student} students in {len(self.sets)} sets, about "
               f"{seconds_text(self.seconds)} (from a student step timed here: {self.step_seconds * 1000:.0f} ms)"]
        for s in self.sets:
            kept = f" ({s.kept} kept)" if s.kept else ""
            students = f"{s.students} student{'' if s.students == 1 else 's'} of {s.steps:,} steps{kept}" \
                if s.students else f"nothing to train{kept}"
            first = f"{s.first}, then " if s.first else ""
            detail = f" {s.detail}" if s.detail else ""
            out.append(f"  {s.name}: {first}{students}{detail}, about {seconds_text(s.seconds)}; {s.flag}")
        return out


def plan_evaluation(run: OpenedRun, job: EvalJob, spec: EvalSpec | None = None, *, baselines: bool = False,
                    ranking: str = "none", ars: bool = False) -> EvalPlan:
    """The plan of evaluating the opened run under `job` as `spec` runs it, with the baselines,
    DD-Ranking's scores (`ranking`: "none", "hard-labels", "full") and ARS as asked
    (`store_run.EvalScope`)."""
    spec = spec or EvalSpec()
    device, dataset = spec.on_device(), run.dataset
    cfg, _, cached, seed_files = kept_files(run, job, spec)
    batch = min(cfg.batch_size, run.images.shape[0])
    steps = cfg.epochs * steps_per_epoch(run.images.shape[0], cfg.batch_size)
    test_images = len(dataset.test.of_classes(run_classes(run.reader.config, dataset.num_classes)))
    tests = len(epochs_tested(cfg.epochs, cfg.eval_every)) * test_images
    soft = student_step_seconds(dataset, run.labeler, cfg.student, batch, device)

    def student_seconds(step: float, count: int, per_student: int = steps, views: int = batch) -> float:
        return count * (per_student * step + tests * _FORWARD_SHARE * step / views)

    def kept(files: Sequence[Path]) -> int:
        return sum(1 for path in files if path.is_file())

    whole = cached.is_file() and job.cache
    known = len(seed_files) if whole else kept(seed_files.values())
    sets = [PlannedSet(name="the run", students=len(seed_files) - known, kept=known, steps=steps,
                       seconds=student_seconds(soft, len(seed_files) - known),
                       flag="--seeds and --epochs size it")]
    if baselines:
        sets += _baselines(run, job, spec, steps, lambda count: student_seconds(soft, count))
    hard_step = None
    if ranking in ("hard-labels", "full"):
        hard_step = student_step_seconds(dataset, None, cfg.student, batch, device, augment=False)
    if ranking == "full":
        full = full_data_plan(dataset, cfg, run.reader.run_dir.parent / REFERENCES, run_classes(
            run.reader.config, dataset.num_classes), device)
        if full.kept or full.over_budget:
            why = "(kept from before)" if full.kept else \
                f"(over the budget of {cfg.reference_steps:,} steps: the teacher's recorded test top-1 stands in)"
            sets.append(PlannedSet(name="DD-Ranking's full-data reference", students=0, kept=int(full.kept),
                                   detail=why, flag="--no-ranking skips it"))
        else:
            views = min(full.config.batch_size, full.images)
            step = student_step_seconds(dataset, None, cfg.student, views, device, augment=False)
            step += _decode_seconds(dataset, views)  # the split is streamed from its files
            sets.append(PlannedSet(name="DD-Ranking's full-data reference", students=1, steps=full.steps,
                                   seconds=student_seconds(step, 1, full.steps, views),
                                   detail=f"on the {full.images:,} training images (once for this data, kept in "
                                          f"{full.path.parent})",
                                   flag="--no-ranking skips it"))
    if hard_step is not None:
        files = hard_label_files(run, cfg, device)
        known = kept(files.values())
        sets.append(PlannedSet(name="DD-Ranking's hard-label students on the run's images", students=len(files) - known,
                               kept=known, steps=steps, seconds=student_seconds(hard_step, len(files) - known),
                               flag="--no-ranking skips them"))
    if ars and ranking == "full" and baselines:
        count = 2 * len(seed_files)
        sets.append(PlannedSet(name="ARS: the run and random real images without augmentation", students=count,
                               steps=steps, seconds=student_seconds(soft, count), flag="asked for with --ars"))
    return EvalPlan(sets=sets, student=cfg.student, step_seconds=soft)


def student_step_seconds(dataset: ImageDataset, labeler, student: str, batch: int,
                         device: str | torch.device = "cpu", *, augment: bool = True) -> float:
    """Seconds per step of a student of `batch` views on `device`, as training.train_student takes
    it: its views cut (`augment`), the targets (the soft labels of `labeler`'s teachers, or, with
    None, hard labels), its loss and AdamW's update."""
    cfg = EvalConfig()
    model = create_model(student, dataset.num_classes, in_chans=dataset.channels, image_size=dataset.image_size)
    model = model.to(device)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    size = (2 * batch, dataset.channels, dataset.image_size, dataset.image_size)
    images01 = to_unit(torch.randint(0, 256, size, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    images01 = images01.to(device)
    spec = AugmentSpec(out_size=dataset.image_size, hflip=dataset.hflip)
    plan = draw_plan(torch.arange(batch), dataset.image_size, dataset.image_size, spec, epoch_generator(0, 0))
    mean = torch.tensor(dataset.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(dataset.std, device=device).view(1, -1, 1, 1)
    labels = torch.zeros(batch, dtype=torch.long, device=device)

    def step():
        view = apply_plan(images01, plan, spec.out_size) if augment else images01[:batch]
        logits = model((view - mean) / std)
        loss = kd_loss(logits, labeler(view), cfg.temperature) if labeler is not None else \
            F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return timed(step, device, repeats=3)


def _baselines(run: OpenedRun, job: EvalJob, spec: EvalSpec, steps: int, students) -> list[PlannedSet]:
    """The baselines' sets: each distilled first where it is not yet (its steps timed here), then
    its students, those kept read back; a baseline of the same images as one before it is none."""
    flag = "--no-baselines skips it (and DD-Ranking's scores)"
    if run.reader.config is None or run.own_missing is not None:
        return []
    out, built = [], {}
    teachers = [FrozenTeacher(model, in_chans=info.in_chans) for model, info in run.own_teachers]
    try:
        timer = StepTimer(teachers, run.dataset, spec.on_device())
        for name, bcfg in baseline_configs(run.reader.config, job.ipc).items():
            distill_job, _ = baseline_job(run, bcfg, list(run.own_teachers), spec)
            twin = next((other for other, config in built.items() if same_images(config, distill_job.config)), None)
            built[name] = distill_job.config
            if twin is not None:
                out.append(PlannedSet(name=BASELINES[name], students=0, detail=f"(the same images as {BASELINES[twin]})",
                                      flag=flag))
                continue
            seeds = len(job.config.seed_list)
            known, distill, first = _kept_baseline(run, job, spec, distill_job), 0.0, "distilled already"
            if known is None:
                distill, known = run_seconds(distill_job.config, run.dataset, timer, RunShape.here(spec.threads)), 0
                first = f"distilled first (about {seconds_text(distill)})"
            out.append(PlannedSet(name=BASELINES[name], students=seeds - known, kept=known, steps=steps,
                                  seconds=distill + students(seeds - known), first=first, flag=flag))
    finally:
        for teacher in teachers:
            teacher.remove_hooks()
    return out


def _kept_baseline(run: OpenedRun, job: EvalJob, spec: EvalSpec, distill_job) -> int | None:
    """The students of a baseline already kept, where its run is distilled already; None where it
    is not (then it is distilled first)."""
    layout = RunLayout(Path(distill_job.store) / distill_job.run_id)
    if not layout.manifest.is_file():
        return None
    try:
        reader = open_run(layout.run_dir, ipc=distill_job.config.ipc)
        opened = read_for_evaluation(reader, baseline_eval_job(job, reader), spec,
                                     EvalParts(dataset=run.dataset, labeler=run.labeler))
    except StoreError:
        return None
    _, _, cached, seed_files = kept_files(opened, baseline_eval_job(job, reader), spec)
    return len(seed_files) if cached.is_file() else sum(1 for path in seed_files.values() if path.is_file())


def _decode_seconds(dataset, count: int) -> float:
    """Seconds to read `count` training images from their files (decoded as a step reads them)."""
    indices = torch.arange(min(count, len(dataset.train)))
    return timed(lambda: dataset.train.load(indices), repeats=2) if len(indices) else 0.0
