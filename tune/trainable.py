"""One trial of a sweep: distill its config into the sweep's store, then evaluate a student on it.

`run_trial` is a Tune function trainable (`tune.with_parameters` hands it the sweep's shared
objects, put into the object store once per sweep: the dataset, the teachers' bytes and the
patch rankings scored once per sweep). A trial

1. builds its `DistillConfig` with `make_config` (the sweep's preset, fixed values and flags,
   then the trial's values);
2. distills it into the sweep's store, which is content-addressed: a run with the same
   identity is served from the store (`DistillResult.units_skipped`), not recomputed. Before
   it runs, the rankings of the real patches the sweep scored once are written into the run's
   `patches/` (`RunLayout.patch_selection`), where the distillation reads them instead of
   scoring them again. With `workers_per_trial` > 1 the run is distilled by DistillWorker
   actors inside the trial's own placement group (`actors.coordinator`);
3. evaluates a student on the run with `evaluate_store_run`, the protocol and the cache of
   `fadrm evaluate`, reporting the student's test top-1 at each of its test evaluations under
   the time attribute `student_pct` (percent of the students' whole schedule), which ASHA
   schedules on; the last report is the mean over the student seeds (`final`). Each report is
   a `tune.settings.TrialReport`, dumped for Tune and validated back by tune.results.

The report after distillation carries a checkpoint (the run), so a trial resumed after an
error evaluates without distilling again. Every trial appends what it did to the sweep's
`events.jsonl` (trial_started, distilled, evaluated), one JSON object per line.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fadrm_ray.events import append_event

from tune.session import pause_point
from tune.settings import PatchScoring, TrialReport, TrialSettings, TrialStarted, TrialState

if TYPE_CHECKING:
    from fadrm_ray.runs.job import ExecutionSpec

# What a patch ranking depends on besides the data and the teachers (patches.score_class).
PATCH_FIELDS = ("seed", "patch_crops", "patch_crop_scale", "patch_candidates", "precision", "channels_last")


def patch_key(resolved_cfg, dataset_fingerprint: str, teacher_shas: list[str]) -> str | None:
    """The rankings a resolved config's patches come from, by what decides them; None when the
    config scores no patches."""
    from fadrm_ray.patches import scored

    if not scored(resolved_cfg):
        return None
    values = {f: getattr(resolved_cfg, f) for f in PATCH_FIELDS}
    payload = json.dumps({"cfg": values, "data": dataset_fingerprint, "teachers": teacher_shas}, sort_keys=True,
                         default=list)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def score_patches(job: PatchScoring, dataset, teacher_blobs: list[bytes]) -> tuple[dict, float]:
    """Score the real patches of `job.labels` under `job.config`, a resolved config (a Ray task
    of the sweep's driver, once per patch key): ({label: ClassSelection}, seconds)."""
    import torch

    from fadrm_ray.runs.stages import frozen_teachers
    from fadrm_ray.runs.job import JobParts
    from fadrm_ray.models import load_teacher
    from fadrm_ray.patches import score_class

    pause_point("patches")
    torch.set_num_threads(job.threads)
    cfg, device = job.config, job.device
    started = time.perf_counter()
    loaded = [load_teacher(f"teacher {i}", device, blob=blob) for i, blob in enumerate(teacher_blobs)]
    parts = JobParts.of(dataset, loaded, device)
    teachers = frozen_teachers(parts, cfg)
    selections = {label: score_class(parts.dataset, label, cfg, teachers, device) for label in job.labels}
    return selections, time.perf_counter() - started


def teacher_files(sweep: TrialSettings, blobs: list[bytes]) -> list[str]:
    """Teacher paths this node can read: the sweep's own paths where they exist here (shared
    storage), else a local copy of the bytes the object store brought."""
    paths = []
    for path, blob in zip(sweep.teachers, blobs):
        if Path(path).is_file() and Path(path).stat().st_size == len(blob):
            paths.append(path)
            continue
        local = Path(tempfile.gettempdir()) / "fadrm-tune-teachers" / f"{hashlib.sha256(blob).hexdigest()[:16]}.pt"
        if not local.is_file():
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, local)
        paths.append(str(local))
    return paths


def run_trial(config: dict, *, sweep: TrialSettings, dataset=None, teacher_blobs=None, selections=None) -> None:
    """The Tune function trainable (module docstring). `config` holds the trial's swept values;
    `sweep` the sweep's settings (tune.settings.TrialSettings); `dataset`, `teacher_blobs` and
    `selections` ({patch key: {label: ClassSelection}}) are shared, or None when the sweep
    shares nothing (each trial then loads and scores for itself, as bench.sweep compares)."""
    import ray
    import torch
    from ray import tune

    from fadrm_ray.data import get_dataset
    from fadrm_ray.evaluation.store_run import evaluate_store_run
    from tune.space import trial_config

    threads = sweep.threads
    torch.set_num_threads(threads)
    trial_id = tune.get_context().get_trial_id()
    node = {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
    events = sweep.events
    said = TrialStarted(trial=trial_id, values=config, **node)
    append_event(events, said.event, **said.model_dump(exclude={"event"}))
    pause_point("trial")
    started = time.perf_counter()
    if dataset is None:
        dataset = get_dataset(sweep.dataset, root=sweep.data_root)
    paths = teacher_files(sweep, teacher_blobs) if teacher_blobs is not None else list(sweep.teachers)
    cfg = trial_config(sweep.base, config)

    state: TrialState | None = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = TrialState.model_validate_json((Path(folder) / "trial.json").read_bytes())
    labeler = None  # the teachers the distillation loaded, reused for the soft labels
    if state is None:
        state, labeler = distill_trial(cfg, dataset, paths, sweep, selections)
        append_event(events, "distilled", trial=trial_id, **state.model_dump(), **node)
    run_dir = state.run_dir

    eval_cfg = sweep.eval
    seeds = eval_cfg.seed_list
    # What every report carries; each evaluation adds the student's top-1 and how far it got.
    progress = TrialReport(top1=0.0, student_pct=0.0, final=False, run_id=Path(run_dir).name,
                           distill_seconds=state.distill_seconds, units_run=state.units_run,
                           patches_scored=state.patches_scored, **node)
    pending = {"checkpoint": _checkpoint(state)}  # goes with the first report

    def on_eval(seed: int, epoch: int, epochs: int, top1: float) -> None:
        pct = 100.0 * (seeds.index(seed) * epochs + epoch) / (epochs * len(seeds))
        if pct >= 100.0:
            return  # the last evaluation is reported below, as the mean over the seeds
        report = progress.model_copy(update={"top1": top1, "student_pct": round(pct, 3)})
        tune.report(report.model_dump(), checkpoint=pending.pop("checkpoint", None))

    evaluated = time.perf_counter()
    device = sweep.device
    from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalParts, EvalSpec

    job = EvalJob(config=eval_cfg, teacher_paths=paths if labeler is None else None, ipc=cfg.ipc)
    spec = EvalSpec(device=device, threads=threads, progress=False)
    result = evaluate_store_run(run_dir, job, spec, parts=EvalParts(dataset=dataset, labeler=labeler),
                                hooks=EvalHooks(on_eval=on_eval)).evaluation
    student_seconds = time.perf_counter() - evaluated
    append_event(events, "evaluated", trial=trial_id, run_dir=run_dir, top1=result.top1_mean,
                 cached=result.cached, seconds=student_seconds, **node)
    final = progress.model_copy(update={
        "top1": result.top1_mean, "top1_std": result.top1_std, "top1_per_seed": list(result.top1_per_seed),
        "student_pct": 100.0, "final": True, "student_seconds": round(student_seconds, 3),
        "evaluation_cached": result.cached, "trial_seconds": round(time.perf_counter() - started, 3)})
    tune.report(final.model_dump(), checkpoint=pending.pop("checkpoint", None))


def _checkpoint(state: TrialState):
    from ray import tune

    folder = tempfile.mkdtemp(prefix="fadrm-trial-")
    (Path(folder) / "trial.json").write_text(state.model_dump_json())
    return tune.Checkpoint.from_directory(folder)


def trial_spec(sweep: TrialSettings) -> ExecutionSpec:
    """How a trial's distillation runs: in this process on the trial's device, or (with
    `workers_per_trial` > 1) on DistillWorker actors in the trial's placement group, which get the
    trial's GPUs, none for a CPU trial."""
    from fadrm_ray.runs.job import ExecutionSpec

    if sweep.workers_per_trial <= 1:
        return ExecutionSpec(local=True, device=sweep.device, progress=False)
    # No GPUs (0, not None) for a CPU trial: left None, the pool takes one GPU per worker
    # wherever the cluster has GPUs, and the job resolved for the CPU would not run there.
    gpus = sweep.gpus_per_worker if sweep.device == "cuda" else 0.0
    return ExecutionSpec(workers=sweep.workers_per_trial, cpus_per_worker=sweep.cpus_per_worker, gpus_per_worker=gpus,
                         progress=False)


def distill_trial(cfg, dataset, teacher_paths: list[str], sweep: TrialSettings,
                  selections: dict | None) -> tuple[TrialState, Any]:
    """Distill `cfg` into the sweep's store (content-addressed: what the store holds is not
    recomputed), with the sweep's patch rankings written into the run first. The trial builds
    its job once (teachers loaded once) and runs it through the door of its `trial_spec`: in this
    process, or on DistillWorker actors in the trial's placement group with `workers_per_trial`
    > 1 (which stop on every path). Returns what it did and the teachers as a SoftLabeler for the
    evaluation."""
    from fadrm_ray.runs import execute
    from fadrm_ray.runs.stages import needed_classes
    from fadrm_ray.store.selections import keep_selection
    from fadrm_ray.runs.units import plan_units
    from fadrm_ray.runs.job import prepare_job
    from fadrm_ray.layout import RunLayout
    from fadrm_ray.evaluation.relabel import SoftLabeler

    started = time.perf_counter()
    spec = trial_spec(sweep)
    if spec.local:
        door = execute
    else:
        from actors import coordinator as door
    job, parts = prepare_job(cfg, dataset, sweep.dataset, teacher_paths, sweep.store,
                             device=sweep.device if spec.local else "cpu", device_type=sweep.device,
                             data_root=sweep.data_root)
    layout = RunLayout(job.run_dir)
    labels = needed_classes(plan_units(job.config, job.num_classes, image_size=job.image_size), job.config)
    key = patch_key(job.config, job.dataset_fingerprint, [t.sha256 for t in job.teachers])
    shared = (selections or {}).get(key, {})
    for label in labels:
        if label in shared and not layout.patch_selection(label).is_file():
            keep_selection(layout, shared[label])
    before = sum(layout.patch_selection(label).is_file() for label in labels)
    result = door.run(job, spec, parts)
    after = sum(layout.patch_selection(label).is_file() for label in labels)
    state = TrialState(run_dir=str(result.run_dir), units_run=len(result.units_run),
                       units_skipped=len(result.units_skipped), patches_scored=after - before,
                       distill_seconds=round(time.perf_counter() - started, 3))
    return state, SoftLabeler.from_loaded(parts.models, parts.infos, sweep.device)
