"""A sweep of DistillConfig values on Ray Tune: `fadrm tune ...`, or `python -m tune.sweep ...`
(the same command, for `ray job submit`; inside a job it joins the job's cluster).

`run_sweep` first resolves every path it was given (the dataset's, the teachers, OUT, the store,
the space file, the data root) against the working folder it started in (tune.request), then
checks everything before any trial starts: first what needs neither torch nor the data (the
flags, as `SweepRequest` is built; the folders, local paths only; the teachers; the space and
each of its values alone; the evaluation settings; whether OUT holds another sweep), then every
combination of the space's values against the loaded dataset. Then, working in OUT, on Ray
(tune.session: the Ray this process joined, the cluster at `--address`, or an embedded local Ray
whose session and logs are under OUT/ray) it:

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
the trials: Tune ends its fit and saves its state, the confirmation) ends the sweep with its
results written as interrupted: every trial labelled done, stopped, error, interrupted or
pending, and no best.yaml; the same command resumes it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fadrm_ray.config import EvalConfig
from fadrm_ray.fileio import atomic_write_text
from fadrm_ray.settings import ConfigError

from tune.request import FLAGS, SweepRequest, flag, with_absolute_paths
from tune.settings import PatchScoring, TrialBase, TrialSettings
from tune.space import Param, check_values, parse_space, split_space, trial_config, validate_space

if TYPE_CHECKING:
    from fadrm_ray.data.base import ImageDataset
    from fadrm_ray.pilot_record import PilotRecord

    from tune.outputs import SweepSummary
    from tune.results import TrialRow

__all__ = ["FLAGS", "Prepared", "SweepFailed", "SweepRequest", "check", "flag", "prepare", "run_sweep",
           "trial_count", "with_pilot"]

EXPERIMENT = "experiment"
# ASHA on student_pct (percent of the students' schedule): one rung, at 50 %. The rung metric is
# a student's test top-1 part-way through its cosine schedule, while the learning rate is still
# high; an earlier rung ranks trials by noise (docs/benchmarks/sweeps.md).
ASHA_GRACE, ASHA_MAX, ASHA_REDUCTION = 50, 100, 2


@dataclass(frozen=True)
class Prepared:
    """A checked request, with every path absolute; the dataset, the device and the count of
    configurations checked once the data is loaded (`prepare`)."""

    request: SweepRequest
    out: Path
    store: Path
    teachers: list[Path]
    data_root: str | None
    base: TrialBase                     # preset, flags and fixed values of every trial
    swept: dict[str, Param]
    eval_cfg: EvalConfig
    total: int                          # trials of the whole sweep
    dataset: "ImageDataset | None" = None
    device: str = "cpu"
    checked: int = 0                    # configurations checked before the sweep


def trial_count(swept: dict[str, Param], search: str, samples: int) -> int:
    """The trials of a whole sweep: Tune runs every grid point `samples` times; random and optuna
    searches draw `samples` trials (their grids become choices)."""
    if search != "grid":
        return samples
    return samples * math.prod(len(q.values) for q in swept.values() if q.kind == "grid")


def _check_search(req: SweepRequest) -> None:
    if req.search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("--search optuna needs optuna, which is not installed: pip install optuna") from None


def check(req: SweepRequest) -> Prepared:
    """The checks that need neither torch nor the data, on the request with its paths resolved:
    raises ConfigError in one line."""
    from fadrm_ray.config import parse_overrides
    from fadrm_ray.fileio import check_output_dir
    from fadrm_ray.settings import layered

    given, req = req, with_absolute_paths(req)
    _check_search(req)
    if req.device == "cpu" and req.gpus_per_trial > 0:
        raise ConfigError(f"--device cpu with --gpus-per-trial {req.gpus_per_trial}: a CPU trial holds no GPU; "
                          f"drop one of them", ("device",))
    out = check_output_dir(Path(req.out), "--out")
    store = Path(req.store) if req.store else out / "store"
    check_output_dir(store, "--store")
    if not req.teachers:
        raise ConfigError("--teacher is needed (a checkpoint from `fadrm squeeze`)")
    for path, named in zip(req.teachers, given.teachers):
        if not Path(path).is_file():
            raise ConfigError(f"teacher checkpoint {named} does not exist" + (f" ({path})" if named != path else ""))
    space = parse_space(req.params, req.space_file)
    fixed, swept = split_space(space)
    base = TrialBase(preset=req.preset, ipc=req.ipc, classes=req.classes, seed=req.seed, fixed=fixed)
    check_values(base, swept)
    eval_cfg = layered(EvalConfig, parse_overrides(req.eval_set, EvalConfig),
                       flags={"student": req.student, "seeds": req.seeds, "epochs": req.epochs,
                              "protocol": req.protocol})
    _check_resume(out, req, given)
    return Prepared(req, out, store, [Path(t) for t in req.teachers], req.data_root, base, swept, eval_cfg,
                    trial_count(swept, req.search, req.sample_count))


def prepare(req: SweepRequest | Prepared) -> Prepared:
    """Check every input before any trial (`check`, then every combination of the space against
    the loaded dataset): raises ConfigError (or a library error) in one line."""
    p = req if isinstance(req, Prepared) else check(req)
    from fadrm_ray.data import get_dataset  # torch loads here, after every check that does not need it

    dataset = get_dataset(p.request.dataset, root=p.data_root)
    device = p.request.trial_device
    return replace(p, dataset=dataset, device=device, checked=validate_space(p.base, p.swept, dataset, device))


def _check_resume(out: Path, req: SweepRequest, given: SweepRequest) -> None:
    """A sweep.json in OUT must be this sweep's: the same identity, with its paths resolved (or
    as given, for a sweep saved before its paths were resolved)."""
    saved = out / "sweep.json"
    if saved.is_file():
        before = json.loads(saved.read_text()).get("identity")
        now = json.loads(json.dumps(req.identity()))
        if before not in (now, json.loads(json.dumps(given.identity()))):
            changed = sorted(k for k in now if (before or {}).get(k) != now[k])
            raise ConfigError(f"--out {out} holds another sweep (it differs in {', '.join(changed)}); "
                              f"use a new --out, or the same command to resume it")


def trial_dirname(trial) -> str:
    return f"trial_{trial.trial_id}"


def trial_settings(p: Prepared) -> TrialSettings:
    """What every trial reads (tune.trainable.run_trial's `sweep`)."""
    req = p.request
    return TrialSettings(base=p.base, eval=p.eval_cfg, dataset=req.dataset, data_root=p.data_root,
                         teachers=[str(t) for t in p.teachers], store=str(p.store), device=p.device,
                         threads=max(1, int(req.cpus_per_trial)), workers_per_trial=req.workers_per_trial,
                         cpus_per_worker=req.cpus_per_trial, gpus_per_worker=req.trial_gpus or None,
                         events=str(p.out / "events.jsonl"))


def shared_patches(p: Prepared, blobs: list[bytes]) -> tuple[dict, dict]:
    """{patch key: {label: ClassSelection}} for every patch setting the swept grid values give,
    each scored once (a Ray task with a trial's resources) or read from OUT/patches; and what it
    cost: {"keys", "scored", "seconds"}."""
    import itertools

    import ray

    from pydantic import TypeAdapter

    from fadrm_ray.events import append_event
    from fadrm_ray.fileio import atomic_write_bytes
    from fadrm_ray.store.run_files import ClassSelection
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
        selections, seconds = ray.get(ref)
        out[key] = selections
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / f"{key}.json", selections_file.dump_json(list(selections.values())))
        cost["scored"] += len(selections)
        cost["seconds"] += seconds
        append_event(str(p.out / "events.jsonl"), "patches_scored", key=key, classes=len(selections), seconds=seconds)
    return out, cost


def _tuner(p: Prepared, trainable, restore: bool, progress):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from tune.settings import TIME_ATTR

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


class SweepFailed(RuntimeError):
    """Something unexpected failed after every check passed (the cause is chained): not a bad
    command, so tune.sweep_command shows its traceback."""


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


def run_sweep(req: SweepRequest) -> "SweepSummary":
    """Run (or resume) the sweep; returns its summary (files, best trial, costs, and whether it
    was interrupted). Every file is written before Ray is left; a SIGINT at any moment after the
    checks ends it with its results written as interrupted."""
    from tune.session import held_interrupt, sweep_ray

    stage = _Stage(check(req), time.perf_counter())
    try:
        import ray.tune  # noqa: F401 - here, so that a Ctrl-C inside the import is an interrupted sweep too

        p = prepare(stage.p)
        stage.p, stage.what = p, "during the pilot"
        p, stage.pilot = with_pilot(p)
        stage.p = p
        p.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p.out / "sweep.json", json.dumps({"identity": p.request.identity(),
                                                            "request": p.request.model_dump(mode="json")}, indent=1))
        stage.what = "while Ray started"
        with _working_folder(p.out), contextlib.ExitStack() as ray_up:
            # Ray's processes are forked while it starts, and a SIGINT that lands in a fork handler
            # is dropped by Python: held off until Ray is up, then the sweep ends as interrupted.
            with held_interrupt() as came:
                stage.ray_dir = ray_up.enter_context(sweep_ray(p.out, p.request.address))
            if came():
                raise KeyboardInterrupt
            try:
                return _sweep_on_ray(p, stage)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                raise SweepFailed(f"the sweep failed after its checks: {type(exc).__name__}: {exc}") from exc
    except KeyboardInterrupt:
        from tune.results import saved_rows

        with held_interrupt():
            return _finish(stage.p, saved_rows(stage.p), stage, interrupted=True)


def with_pilot(p: Prepared) -> "tuple[Prepared, PilotRecord | None]":
    """The sweep with the recipe `auto` takes for its data fixed in every trial: the pilot's
    (fadrm_ray/pilot.py, measured or read back from the store) where it runs, so the trials and
    the patches shared between them resolve alike; unchanged where it does not or the recipe
    is swept."""
    from fadrm_ray.pilot import ensure_pilot

    if "recipe" in p.swept:
        return p, None
    pilot = ensure_pilot(trial_config(p.base, {}), p.dataset, p.teachers, p.store, device=p.device,
                         on_line=lambda line: print(f"fadrm tune: note: {line}", file=sys.stderr))
    if pilot is None:
        return p, None
    base = p.base.model_copy(update={"fixed": {**p.base.fixed, "recipe": pilot.chosen}})
    return replace(p, base=base), pilot


def _sweep_on_ray(p: Prepared, stage: _Stage) -> "SweepSummary":
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
    with tune_fit_interrupts() as came, contextlib.redirect_stdout(sys.stderr):  # stdout is for the result
        grid = _tuner(p, trainable, restore, progress).fit()
    with held_interrupt() as held:
        rows = collect_rows(grid, p, progress)
    stage.resumed, stage.patches = restore, patch_cost
    if came() or held() or any(r.state in ("interrupted", "pending") for r in rows):
        with held_interrupt():
            return _finish(p, rows, stage, interrupted=True)
    stage.what = "during the confirmation of the best trials"
    try:
        confirmation, again = run_confirmation(p, rows, trial_settings(p), ray.put(p.dataset), ray.put(blobs),
                                               wait_interruptibly)
    except KeyboardInterrupt:
        with held_interrupt():
            return _finish(p, rows, stage, interrupted=True)
    except Exception as exc:  # noqa: BLE001 - the trials' results stand without it
        confirmation, again = None, {}
        stage.random_note = f"not compared: the confirmation of the best trials failed ({error_line(exc)})"
    with held_interrupt():
        return _finish(p, rows, stage, confirmation=confirmation, again=again)


def _finish(p: Prepared, rows: "list[TrialRow]", stage: _Stage, interrupted: bool = False, confirmation=None,
            again: dict | None = None) -> "SweepSummary":
    """Write the results and summary.json; returns the summary."""
    from tune.confirm import random_real_note
    from tune.outputs import SweepSummary, failures, write_results

    note, random = random_real_note(p, rows, again or {})
    if interrupted:
        note = "not compared: the sweep was interrupted (resuming it compares)"
    during = stage.what if interrupted else None
    files, best = write_results(p, rows, interrupted, None if interrupted else confirmation, random, during)
    states = {s: sum(r.state == s for r in rows) for s in ("done", "stopped", "error", "interrupted", "pending")}
    summary = SweepSummary(
        out=str(p.out), experiment=str(p.out / EXPERIMENT), store=str(p.store),
        ray_session=str(stage.ray_dir) if stage.ray_dir else None,
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
