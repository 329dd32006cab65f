"""A sweep of DistillConfig values on Ray Tune: `fadrm tune ...`, or `python -m tune.sweep ...`
(the same command, for `ray job submit`; inside a job it joins the job's cluster).

`run_sweep` checks everything before any trial starts (the output folder, the teachers, the
dataset, every value of the search space against DistillConfig, the evaluation settings, the
search and scheduler), then on Ray (`actors.coordinator.ray_session`: an embedded local Ray, the
cluster at `--address`, or the Ray this process already joined):

- puts the dataset and the teachers' bytes into the object store once (`tune.with_parameters`)
  and scores the real patches once per patch setting (one Ray task each, with a trial's
  resources; kept in OUT/patches/ so a resumed sweep does not score them again);
- runs one function trial per configuration (tune.trainable) with `--cpus-per-trial` /
  `--gpus-per-trial` each (or a placement group of one bundle for the trial and one per
  DistillWorker with `--workers-per-trial`), ASHA on the students' intermediate top-1 by
  default, results under OUT/experiment (`tune.RunConfig(storage_path=OUT)`: shared storage on
  a cluster);
- resumes OUT/experiment when it exists (`Tuner.can_restore` / `Tuner.restore`, errored trials
  resumed): finished trials are not run again;
- writes results.csv, results.md, best.yaml and the plots (tune.results).
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fadrm_ray.settings import ConfigError

from tune.space import Param, parse_space, split_space, trial_config, validate_space

EXPERIMENT = "experiment"
SEARCHES = ("grid", "random", "optuna")
SCHEDULERS = ("asha", "fifo")
METRICS = ("top1",)
# ASHA on student_pct (percent of the students' schedule): rungs at 25 % and 50 %.
ASHA_GRACE, ASHA_MAX, ASHA_REDUCTION = 25, 100, 2


@dataclass
class SweepRequest:
    dataset: str
    teachers: list[str]
    out: str
    preset: str = "fadrm"
    ipc: int | None = None
    classes: list[int] | None = None
    seed: int | None = None
    params: list[str] = field(default_factory=list)
    space_file: str | None = None
    samples: int | None = None          # None: 1 for a grid, 10 for random and optuna
    search: str = "grid"
    scheduler: str = "asha"
    metric: str = "top1"
    student: str | None = None
    seeds: int | None = None
    epochs: int | None = None
    protocol: str | None = None
    eval_set: list[str] = field(default_factory=list)
    max_concurrent: int | None = None
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    workers_per_trial: int = 1
    address: str | None = None
    store: str | None = None            # default OUT/store
    data_root: str | None = None
    share: bool = True                  # dataset, teachers and patches shared (False: bench.sweep's control)
    progress: bool = True

    def identity(self) -> dict:
        """What makes a sweep this sweep (a rerun with the same identity resumes it)."""
        keep = ("dataset", "teachers", "preset", "ipc", "classes", "seed", "params", "space_file", "samples",
                "search", "scheduler", "metric", "student", "seeds", "epochs", "protocol", "eval_set")
        return {k: v for k, v in asdict(self).items() if k in keep}


@dataclass
class Prepared:
    request: SweepRequest
    out: Path
    store: Path
    dataset: Any
    base: dict                          # preset, flags and fixed values of every trial
    swept: dict[str, Param]
    eval_cfg: Any
    device: str
    checked: int                        # configurations checked before the sweep


def _check_numbers(req: SweepRequest) -> None:
    if req.search not in SEARCHES:
        raise ConfigError(f"--search must be one of {', '.join(SEARCHES)}, got {req.search!r}")
    if req.scheduler not in SCHEDULERS:
        raise ConfigError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {req.scheduler!r}")
    if req.metric not in METRICS:
        raise ConfigError(f"--metric must be one of {', '.join(METRICS)}, got {req.metric!r}")
    for name, value, low in (("--samples", req.samples, 1), ("--max-concurrent", req.max_concurrent, 1),
                             ("--workers-per-trial", req.workers_per_trial, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if not req.cpus_per_trial > 0:
        raise ConfigError(f"--cpus-per-trial must be > 0, got {req.cpus_per_trial}")
    if req.gpus_per_trial < 0:
        raise ConfigError(f"--gpus-per-trial must be >= 0, got {req.gpus_per_trial}")
    if req.search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("--search optuna needs optuna, which is not installed: pip install optuna") from None


def prepare(req: SweepRequest) -> Prepared:
    """Check every input before any trial: raises ConfigError (or a library error) in one line."""
    from fadrm_ray.config import parse_overrides
    from fadrm_ray.data import get_dataset
    from fadrm_ray.fileio import check_output_dir
    from fadrm_ray.settings import EvalConfig, layered

    _check_numbers(req)
    out = check_output_dir(Path(req.out).absolute(), "--out")
    store = Path(req.store).absolute() if req.store else out / "store"
    check_output_dir(store, "--store")
    if not req.teachers:
        raise ConfigError("--teacher is needed (a checkpoint from `fadrm squeeze`)")
    for path in req.teachers:
        if not Path(path).is_file():
            raise ConfigError(f"teacher checkpoint {path} does not exist")
    space = parse_space(req.params, req.space_file)
    fixed, swept = split_space(space)
    base = {"preset": req.preset, "ipc": req.ipc, "classes": req.classes, "seed": req.seed, "fixed": fixed}
    eval_cfg = layered(EvalConfig, parse_overrides(req.eval_set, EvalConfig),
                       flags={"student": req.student, "seeds": req.seeds, "epochs": req.epochs,
                              "protocol": req.protocol})
    _check_resume(out, req)
    dataset = get_dataset(req.dataset, root=req.data_root)
    device = "cuda" if req.gpus_per_trial > 0 else "cpu"
    checked = validate_space(base, swept, dataset, device)
    return Prepared(req, out, store, dataset, base, swept, eval_cfg, device, checked)


def _check_resume(out: Path, req: SweepRequest) -> None:
    saved = out / "sweep.json"
    if saved.is_file():
        before = json.loads(saved.read_text()).get("identity")
        if before != json.loads(json.dumps(req.identity())):
            changed = sorted(k for k in req.identity() if (before or {}).get(k) != req.identity()[k])
            raise ConfigError(f"--out {out} holds another sweep (it differs in {', '.join(changed)}); "
                              f"use a new --out, or the same command to resume it")


def trial_dirname(trial) -> str:
    return f"trial_{trial.trial_id}"


def trial_settings(p: Prepared) -> dict:
    """What every trial reads (tune.trainable.run_trial's `sweep`)."""
    req = p.request
    return {"base": p.base, "eval": p.eval_cfg.model_dump(mode="json"), "dataset": req.dataset,
            "data_root": req.data_root, "teachers": [str(Path(t).absolute()) for t in req.teachers],
            "store": str(p.store), "device": p.device, "threads": max(1, int(req.cpus_per_trial)),
            "workers_per_trial": req.workers_per_trial, "cpus_per_worker": req.cpus_per_trial,
            "gpus_per_worker": req.gpus_per_trial or None, "events": str(p.out / "events.jsonl")}


def shared_patches(p: Prepared, blobs: list[bytes]) -> tuple[dict, dict]:
    """{patch key: {label: ClassSelection}} for every patch setting the swept grid values give,
    each scored once (a Ray task with a trial's resources) or read from OUT/patches; and what it
    cost: {"keys", "scored", "seconds"}."""
    import itertools

    import ray

    from fadrm_ray.patches import ClassSelection
    from fadrm_ray.events import append_event
    from tune.trainable import PATCH_FIELDS, patch_key, score_patches

    req, ds = p.request, p.dataset
    keys = [k for k, q in p.swept.items() if q.kind in ("grid", "choice") and k in (*PATCH_FIELDS, "init",
                                                                                       "patch_selection")]
    wanted: dict[str, tuple] = {}
    for combo in itertools.product(*(p.swept[k].values for k in keys)):
        cfg = trial_config(p.base, dict(zip(keys, combo))).resolve(ds.image_size, ds.num_classes, ds.hflip, p.device)
        key = patch_key(cfg, ds.fingerprint(), [_sha256(b) for b in blobs])
        if key is not None:  # the classes of every configuration that shares the key
            labels = set(cfg.classes) if cfg.classes is not None else set(range(ds.num_classes))
            wanted[key] = (wanted.get(key, (cfg,))[0], sorted(labels | set(wanted.get(key, (None, []))[1])))
    out, cost, pending = {}, {"keys": len(wanted), "scored": 0, "seconds": 0.0}, {}
    folder = p.out / "patches"
    task = ray.remote(score_patches).options(num_cpus=req.cpus_per_trial, num_gpus=req.gpus_per_trial)
    for key, (cfg, labels) in wanted.items():
        saved = folder / f"{key}.json"
        if saved.is_file():
            out[key] = {s.label: s for s in map(ClassSelection.from_dict, json.loads(saved.read_text()))}
        else:
            pending[key] = task.remote(cfg.to_dict(), ray.put(ds), blobs, labels, p.device, max(1, int(req.cpus_per_trial)))
    for key, ref in pending.items():
        selections, seconds = ray.get(ref)
        out[key] = selections
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.json").write_text(json.dumps([s.to_dict() for s in selections.values()]))
        cost["scored"] += len(selections)
        cost["seconds"] += seconds
        append_event(str(p.out / "events.jsonl"), "patches_scored", key=key, classes=len(selections), seconds=seconds)
    return out, cost


def _sha256(blob: bytes) -> str:
    import hashlib

    return hashlib.sha256(blob).hexdigest()


def _tuner(p: Prepared, trainable, restore: bool):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from tune.results import ProgressLine
    from tune.trainable import TIME_ATTR

    req = p.request
    path = p.out / EXPERIMENT
    if restore:
        return tune.Tuner.restore(str(path), trainable=trainable, resume_errored=True)
    scheduler = (ASHAScheduler(time_attr=TIME_ATTR, max_t=ASHA_MAX, grace_period=ASHA_GRACE,
                               reduction_factor=ASHA_REDUCTION)
                 if req.scheduler == "asha" else FIFOScheduler())
    search_alg = None
    if req.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch
        search_alg = OptunaSearch()
    samples = req.samples or (1 if req.search == "grid" else 10)
    param_space = {k: q.tune_domain(req.search) for k, q in p.swept.items()}
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(metric=req.metric, mode="max", scheduler=scheduler, search_alg=search_alg,
                                    num_samples=samples, max_concurrent_trials=req.max_concurrent,
                                    trial_dirname_creator=trial_dirname, reuse_actors=True),
        run_config=tune.RunConfig(name=EXPERIMENT, storage_path=str(p.out), verbose=0,
                                  callbacks=[ProgressLine(p.swept, enabled=req.progress)],
                                  failure_config=tune.FailureConfig(max_failures=1)))


def run_sweep(req: SweepRequest) -> dict:
    """Run (or resume) the sweep; returns the summary (files, best trial, costs)."""
    from actors.coordinator import ray_session
    from tune.results import collect_rows, write_results

    p = prepare(req)
    started = time.perf_counter()
    p.out.mkdir(parents=True, exist_ok=True)
    (p.out / "sweep.json").write_text(json.dumps({"identity": req.identity(), "request": asdict(req)}, indent=1))
    with ray_session(req.address):
        from ray import tune

        blobs = [Path(t).read_bytes() for t in req.teachers]
        patches, patch_cost = shared_patches(p, blobs) if req.share else ({}, {"keys": 0, "scored": 0, "seconds": 0.0})
        shared = {"dataset": p.dataset, "teacher_blobs": blobs, "selections": patches} if req.share else {}
        from tune.trainable import run_trial

        trainable = tune.with_parameters(run_trial, sweep=trial_settings(p), **shared)
        if req.workers_per_trial > 1:
            # One bundle for the trial itself (it evaluates the student), one per DistillWorker.
            bundle = {k: v for k, v in {"CPU": req.cpus_per_trial, "GPU": req.gpus_per_trial}.items() if v}
            bundles = [dict(bundle) for _ in range(req.workers_per_trial + 1)]
            resources = tune.PlacementGroupFactory(bundles)
        else:
            resources = {"cpu": req.cpus_per_trial, "gpu": req.gpus_per_trial}
        trainable = tune.with_resources(trainable, resources)
        restore = tune.Tuner.can_restore(str(p.out / EXPERIMENT))
        with contextlib.redirect_stdout(sys.stderr):  # Tune's own tables: stdout is for the result
            grid = _tuner(p, trainable, restore).fit()
    rows = collect_rows(grid, p.swept)
    files, best = write_results(p, rows)
    summary = {"out": str(p.out), "experiment": str(p.out / EXPERIMENT), "store": str(p.store), "resumed": restore,
               "trials": len(rows), "configs_checked": p.checked, "swept": {k: q.describe() for k, q in p.swept.items()},
               "patches": patch_cost, "wall_seconds": round(time.perf_counter() - started, 2), "best": best,
               "files": files, "rows": rows}
    (p.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
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
