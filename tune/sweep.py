"""A sweep of DistillConfig values on Ray Tune: `fadrm tune ...` (tune.sweep_command), or
`python -m tune.sweep ...` (the same command, for `ray job submit`; inside a job it joins the
job's cluster). The top of tune/: the command is the only module that imports it.

`run_sweep` checks everything before any trial starts (tune.prepare: the request, then every
combination of the space against the loaded dataset, then the pilot), then, working in OUT, on
Ray (tune.session: the Ray this process joined, the cluster at `--address`, or an embedded local
Ray whose session and logs are under OUT/ray; Ray's and Tune's own lines in OUT/ray.log, or on
the terminal with `--verbose`, actors.ray_output) it:

- puts the dataset and the teachers' bytes into the object store once (`tune.with_parameters`)
  and scores the real patches once per patch setting (one Ray task each, with a trial's
  resources; kept in OUT/patches/ so a resumed sweep does not score them again);
- runs one function trial per configuration (tune.trainable) with `--cpus-per-trial` /
  `--gpus-per-trial` each (or a placement group of one bundle for the trial and one per
  DistillWorker with `--workers-per-trial`), ASHA on the students' intermediate top-1 by
  default (one rung, at half the students' schedule), under OUT/experiment;
- resumes OUT/experiment when it exists (`Tuner.restore`, errored and interrupted trials
  resumed): finished trials are not run again;
- evaluates the best finished trials again on new student seeds, beside random real images
  (tune.confirm), and writes results.csv, results.md, best.yaml, the plots and summary.json
  (tune.outputs) before it leaves Ray.

A SIGINT at any moment after the checks (loading the data, the pilot, Ray starting, the patches,
the trials: Tune ends its fit and saves its state, the confirmation, the writing of the results)
ends the sweep with its results written as interrupted: every trial labelled done, stopped,
error, interrupted or pending, and no best.yaml; the same command resumes it. That holds where
the command inherited SIGINT ignored, too (tune.session.obeyed_interrupt). Once the sweep is
ending, a SIGINT is held off to the end (tune.session.held_from_then): a second one while an
interrupted sweep leaves Ray, reads Tune's saved experiment and writes its results changes
nothing, nor does one while a finished sweep leaves Ray, its files written.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from fadrm_ray.fileio import atomic_write_text

from tune.prepare import Prepared, check, prepare, trial_settings, with_pilot
from tune.request import SweepRequest
from tune.settings import EVENTS, EXPERIMENT, RAY_LOG, TIME_ATTR, PatchScoring
from tune.space import trial_config

if TYPE_CHECKING:
    from tune.outputs import SweepSummary
    from tune.results import TrialRow

# ASHA on student_pct (percent of the students' schedule): one rung, at 50 %. The rung metric is
# a student's test top-1 part-way through its cosine schedule, while the learning rate is still
# high; an earlier rung ranks trials by noise (docs/benchmarks/sweeps.md).
ASHA_GRACE, ASHA_MAX, ASHA_REDUCTION = 50, 100, 2


class SweepFailed(RuntimeError):
    """Something unexpected failed after every check passed (the cause is chained): not a bad
    command, so tune.sweep_command shows its traceback."""


def trial_dirname(trial) -> str:
    return f"trial_{trial.trial_id}"


def shared_patches(p: Prepared, blobs: list[bytes]) -> tuple[dict, dict]:
    """{patch key: {label: ClassSelection}} for every patch setting the swept grid values give,
    each scored once (a Ray task with a trial's resources, all submitted at once, each kept as
    it comes) or read from OUT/patches; and what it cost: {"keys", "scored", "seconds"}."""
    import itertools

    import ray

    from pydantic import TypeAdapter

    from fadrm_ray.events import append_event
    from fadrm_ray.fileio import atomic_write_bytes
    from fadrm_ray.store.run_files import ClassSelection
    from tune.session import wait_interruptibly
    from tune.trainable import PATCH_FIELDS, patch_key, score_patches

    req, ds = p.request, p.dataset
    keys = [k for k, q in p.swept.items() if q.kind in ("grid", "choice") and k in (*PATCH_FIELDS, "init",
                                                                                       "patch_selection")]
    wanted: dict[str, tuple] = {}
    for combo in itertools.product(*(p.swept[k].values for k in keys)):
        cfg = trial_config(p.base, dict(zip(keys, combo))).resolve(
            ds.image_size, ds.num_classes, ds.hflip, p.device, channels=ds.channels)
        key = patch_key(cfg, ds.fingerprint(), [hashlib.sha256(b).hexdigest() for b in blobs])
        if key is not None:  # the classes of every configuration that shares the key
            labels = set(cfg.classes) if cfg.classes is not None else set(range(ds.num_classes))
            wanted[key] = (wanted.get(key, (cfg,))[0], sorted(labels | set(wanted.get(key, (None, []))[1])))
    selections_file = TypeAdapter(list[ClassSelection])  # OUT/patches/<key>.json
    out, cost, pending = {}, {"keys": len(wanted), "scored": 0, "seconds": 0.0}, {}
    folder = p.out / "patches"
    task = ray.remote(score_patches).options(num_cpus=req.cpus_per_trial, num_gpus=req.trial_gpus)
    for key, (cfg, labels) in wanted.items():
        saved = folder / f"{key}.json"
        if saved.is_file():
            out[key] = {s.label: s for s in selections_file.validate_json(saved.read_bytes())}
        else:
            job = PatchScoring(config=cfg, labels=labels, device=p.device, threads=max(1, int(req.cpus_per_trial)))
            pending[key] = task.remote(job, ray.put(ds), blobs)
    for key, ref in pending.items():
        [(selections, seconds)] = wait_interruptibly([ref])
        out[key] = selections
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / f"{key}.json", selections_file.dump_json(list(selections.values())))
        cost["scored"] += len(selections)
        cost["seconds"] += seconds
        append_event(str(p.out / EVENTS), "patches_scored", key=key, classes=len(selections), seconds=seconds)
    return out, cost


def _tuner(p: Prepared, trainable, restore: bool, progress):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    req = p.request
    path = p.out / EXPERIMENT
    param_space = {k: q.tune_domain(req.search) for k, q in p.swept.items()}
    if restore:  # the space again: Tune does not keep it, and needs it where it saved no trial yet
        return tune.Tuner.restore(str(path), trainable=trainable, resume_errored=True, param_space=param_space)
    scheduler = (ASHAScheduler(time_attr=TIME_ATTR, max_t=ASHA_MAX, grace_period=ASHA_GRACE,
                               reduction_factor=ASHA_REDUCTION)
                 if req.scheduler == "asha" else FIFOScheduler())
    search_alg = None
    if req.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch
        search_alg = OptunaSearch()
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(metric=req.metric, mode="max", scheduler=scheduler, search_alg=search_alg,
                                    num_samples=req.sample_count, max_concurrent_trials=req.max_concurrent,
                                    trial_dirname_creator=trial_dirname, reuse_actors=True),
        run_config=tune.RunConfig(name=EXPERIMENT, storage_path=str(p.out), verbose=0, callbacks=[progress],
                                  failure_config=tune.FailureConfig(max_failures=1)))


@contextlib.contextmanager
def _working_folder(folder: Path):
    """Work in `folder`, then go back if the old folder still exists. Under `ray job submit` the
    driver starts in the job's working_dir, which Ray deletes as the job's driver leaves; Tune
    itself asks for the current folder as a fit ends (os.path.relpath), and a bare
    `[Errno 2] No such file or directory` would lose a finished sweep."""
    before = os.getcwd()  # it exists: check() has just resolved the paths against it
    os.chdir(folder)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.chdir(before)


class _Stage:
    """Where the sweep is (for the line of an interrupted sweep) and what it has learnt on the way,
    for its summary."""

    def __init__(self, p: Prepared, started: float):
        self.p, self.started, self.what, self.pilot, self.ray_dir = p, started, "while the data loaded", None, None
        self.resumed: bool | None = None       # None: whether OUT holds Tune's experiment
        self.patches: dict = {}
        self.random_note: str | None = None    # what replaces the comparison with random real images


def _ray_lines(p: Prepared):
    """Ray's and Tune's own lines in OUT/ray.log, or on the terminal with --verbose."""
    from actors.ray_output import ray_output

    return ray_output(p.out / RAY_LOG, p.request.verbose, stdout=True)


def run_sweep(req: SweepRequest) -> "SweepSummary":
    """Run (or resume) the sweep; returns its summary (files, best trial, costs, and whether it
    was interrupted). Every file is written before Ray is left; a SIGINT at any moment after the
    checks ends it with its results written as interrupted."""
    from tune.session import check_pause, held_from_then, held_interrupt, obeyed_interrupt, pause_point, sweep_ray

    check_pause()
    with obeyed_interrupt(), held_from_then() as hold:
        stage = _Stage(check(req), time.perf_counter())
        try:
            import ray.tune  # noqa: F401 - here, so that a Ctrl-C inside the import is an interrupted sweep too

            p = prepare(stage.p)
            stage.p, stage.what = p, "during the pilot"
            p, stage.pilot = with_pilot(p)
            stage.p = p
            p.out.mkdir(parents=True, exist_ok=True)
            saved = {"identity": p.request.identity(), "request": p.request.model_dump(mode="json")}
            atomic_write_text(p.out / "sweep.json", json.dumps(saved, indent=1))
            stage.what = "while Ray started"
            with _ray_lines(p), _working_folder(p.out), contextlib.ExitStack() as ray_up:
                # Ray's processes are forked while it starts, and a SIGINT that lands in a fork handler
                # is dropped by Python: held off until Ray is up, then the sweep ends as interrupted.
                with held_interrupt() as came:
                    stage.ray_dir = ray_up.enter_context(sweep_ray(p.out, p.request.address))
                    # However the sweep ends (its files written, interrupted, failed), a SIGINT
                    # during Ray's teardown is held off: it would cut the teardown short, and a
                    # finished sweep would be written again as interrupted.
                    ray_up.callback(lambda: pause_point("shutdown", until=hold()))
                if came():
                    raise KeyboardInterrupt
                try:
                    return _sweep_on_ray(p, stage, hold)
                except KeyboardInterrupt:
                    raise
                except Exception as exc:
                    raise SweepFailed(f"the sweep failed after its checks: {type(exc).__name__}: {exc}") from exc
        except KeyboardInterrupt:
            # Interrupted: a second Ctrl-C while Tune's saved experiment is read and the results
            # are written changes nothing.
            held = hold()
            from tune.results import saved_rows

            pause_point("saved", until=held)
            with _ray_lines(stage.p):  # Tune's warnings as it reads its saved experiment
                return _finish(stage.p, saved_rows(stage.p), stage, hold, interrupted=True)


def _sweep_on_ray(p: Prepared, stage: _Stage, hold: Callable[[], Callable[[], bool]]) -> "SweepSummary":
    import ray
    from ray import tune

    from tune.confirm import run_confirmation
    from tune.progress import SweepProgress
    from tune.results import collect_rows, error_line
    from tune.session import held_interrupt, tune_fit_interrupts, wait_interruptibly
    from tune.trainable import run_trial

    req = p.request
    stage.what = "before any trial started"
    blobs = [t.read_bytes() for t in p.teachers]
    patches, patch_cost = shared_patches(p, blobs) if req.share else ({}, {"keys": 0, "scored": 0, "seconds": 0.0})
    shared = {"dataset": p.dataset, "teacher_blobs": blobs, "selections": patches} if req.share else {}
    trainable = tune.with_parameters(run_trial, sweep=trial_settings(p), **shared)
    if req.workers_per_trial > 1:
        # One bundle for the trial itself (it evaluates the student), one per DistillWorker.
        bundle = {k: v for k, v in {"CPU": req.cpus_per_trial, "GPU": req.trial_gpus}.items() if v}
        bundles = [dict(bundle) for _ in range(req.workers_per_trial + 1)]
        resources = tune.PlacementGroupFactory(bundles)
    else:
        resources = {"cpu": req.cpus_per_trial, "gpu": req.trial_gpus}
    trainable = tune.with_resources(trainable, resources)
    # Tune's experiment, where it saved one: a sweep interrupted as Tune started may have left
    # the tuner without any experiment state, and starts anew.
    restore = tune.Tuner.can_restore(str(p.out / EXPERIMENT)) and any((p.out / EXPERIMENT).glob("experiment_state*"))
    progress = SweepProgress(p.swept, p.total, enabled=req.progress).activate()
    stage.what = "during the trials"
    with tune_fit_interrupts() as came:
        grid = _tuner(p, trainable, restore, progress).fit()
    with held_interrupt() as held:
        rows = collect_rows(grid, p, progress)
    stage.resumed, stage.patches = restore, patch_cost
    if came() or held() or any(r.state in ("interrupted", "pending") for r in rows):
        return _finish(p, rows, stage, hold, interrupted=True)
    stage.what = "during the confirmation of the best trials"
    try:
        confirmation, again = run_confirmation(p, rows, trial_settings(p), ray.put(p.dataset), ray.put(blobs),
                                               wait_interruptibly)
    except KeyboardInterrupt:
        return _finish(p, rows, stage, hold, interrupted=True)
    except Exception as exc:  # noqa: BLE001 - the trials' results stand without it
        confirmation, again = None, {}
        stage.random_note = f"not compared: the confirmation of the best trials failed ({error_line(exc)})"
    return _finish(p, rows, stage, hold, confirmation=confirmation, again=again)


def _finish(p: Prepared, rows: "list[TrialRow]", stage: _Stage, hold: Callable[[], Callable[[], bool]],
            interrupted: bool = False, confirmation=None, again: dict | None = None) -> "SweepSummary":
    """Write the results and summary.json, each file whole. From here to the sweep's end a SIGINT
    is held off (`hold`, tune.session.held_from_then): one while the files are written has a
    finished sweep's results written again as interrupted (no best.yaml); one after that, as
    the sweep leaves Ray, changes nothing. Returns the summary."""
    came = hold()
    summary = _write(p, rows, stage, interrupted, confirmation, again, came)
    if came() and not interrupted:
        stage.what = "while the results were written"
        summary = _write(p, rows, stage, True, None, None, came)
    return summary


def _write(p: Prepared, rows: "list[TrialRow]", stage: _Stage, interrupted: bool, confirmation, again: dict | None,
           came: Callable[[], bool]) -> "SweepSummary":
    from tune.confirm import random_real_note
    from tune.outputs import SweepSummary, failures, write_results
    from tune.session import pause_point

    note, random = random_real_note(p, rows, again or {})
    if interrupted:
        note = "not compared: the sweep was interrupted (resuming it compares)"
    during = stage.what if interrupted else None
    files, best = write_results(p, rows, interrupted, None if interrupted else confirmation, random, during)
    if not interrupted:
        pause_point("results", until=came)
    states = {s: sum(r.state == s for r in rows) for s in ("done", "stopped", "error", "interrupted", "pending")}
    summary = SweepSummary(
        out=str(p.out), experiment=str(p.out / EXPERIMENT), store=str(p.store),
        ray_session=str(stage.ray_dir) if stage.ray_dir else None,
        ray_log=None if p.request.verbose else str(p.out / RAY_LOG),
        resumed=(p.out / EXPERIMENT).is_dir() if stage.resumed is None else stage.resumed, interrupted=interrupted,
        interrupted_during=during, trials=len(rows), trials_total=p.total, states=states, configs_checked=p.checked,
        swept={k: q.describe() for k, q in p.swept.items()}, patches=stage.patches, random_real=stage.random_note or note,
        confirm_seeds=p.request.confirm_seeds, confirmation=None if interrupted else confirmation,
        wall_seconds=round(time.perf_counter() - stage.started, 2), best=None if interrupted else best,
        best_so_far=best if interrupted else None, failed=failures(rows), files=files, rows=[r.flat() for r in rows],
        pilot=stage.pilot.summary() if stage.pilot is not None else None,
        resume=(f"run the same command again: it resumes {p.out / EXPERIMENT} (the finished trials are kept, "
                f"interrupted ones continue from their last checkpoint, pending ones start)") if interrupted else None)
    atomic_write_text(p.out / "summary.json", summary.model_dump_json(indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    """`python -m tune.sweep ARGS` = `fadrm tune ARGS`; inside a Ray job, joins the job's cluster."""
    from actors.cli import main as fadrm

    from actors.job import with_job_address

    return fadrm(with_job_address(["tune", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    from fadrm_ray.runtime import ensure_process_env

    ensure_process_env()  # before torch loads (may re-execute this command once)
    sys.exit(main())
