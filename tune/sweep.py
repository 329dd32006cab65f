"""A sweep of DistillConfig values on Ray Tune: `fadrm tune ...`, or `python -m tune.sweep ...`
(the same command, for `ray job submit`; inside a job it joins the job's cluster).

`run_sweep` checks everything before any trial starts: first what needs neither torch nor the
data (the flags, as `SweepRequest` is built; the folders, local paths only; the teachers; the
space and each of its values alone; the evaluation settings; whether OUT holds another sweep),
then every combination of the space's values against the loaded dataset. Then, from absolute
paths and working in OUT, on Ray (`actors.coordinator.ray_session`: an embedded local Ray, the
cluster at `--address`, or the Ray this process already joined) it:

- puts the dataset and the teachers' bytes into the object store once (`tune.with_parameters`)
  and scores the real patches once per patch setting (one Ray task each, with a trial's
  resources; kept in OUT/patches/ so a resumed sweep does not score them again);
- runs one function trial per configuration (tune.trainable) with `--cpus-per-trial` /
  `--gpus-per-trial` each (or a placement group of one bundle for the trial and one per
  DistillWorker with `--workers-per-trial`), ASHA on the students' intermediate top-1 by
  default (one rung, at half the students' schedule), under OUT/experiment;
- resumes OUT/experiment when it exists (`Tuner.restore`, errored and interrupted trials
  resumed): finished trials are not run again;
- writes results.csv, results.md, best.yaml, the plots (tune.results) and summary.json before it
  leaves Ray. A sweep stopped by SIGINT (Tune ends its fit and saves its state) is written as
  interrupted, with its running and not yet started trials labelled so and no best.yaml.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from fadrm_ray.config import EvalConfig
from fadrm_ray.settings import ConfigError, Count, Index, Indices, describe, error_loc

from tune.settings import PatchScoring, TrialBase, TrialSettings
from tune.space import Param, check_values, parse_space, split_space, trial_config, validate_space

if TYPE_CHECKING:
    from fadrm_ray.pilot_record import PilotRecord
    from fadrm_ray.data.base import ImageDataset

    from tune.results import TrialRow

EXPERIMENT = "experiment"
# ASHA on student_pct (percent of the students' schedule): one rung, at 50 %. The rung metric is
# a student's test top-1 part-way through its cosine schedule, while the learning rate is still
# high; an earlier rung ranks trials by noise (docs/benchmarks/sweeps.md).
ASHA_GRACE, ASHA_MAX, ASHA_REDUCTION = 50, 100, 2
# The flags of fields whose flag is not `--` + the field's name with `-` for `_` (tune.sweep_command).
FLAGS = {"teachers": "--teacher", "params": "--param", "space_file": "--space", "progress": "--quiet"}
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def flag(field: str) -> str:
    """The command-line flag of a SweepRequest field."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def _local_folder(path: str | None) -> str | None:
    # The driver writes results into OUT and trials write into the store with plain file I/O, so
    # a URI (s3://, gs://) would become a local folder named "s3:".
    if path is not None and _URI.match(path):
        raise ValueError(f"must be a local or mounted folder, not a URI, got {path!r}")
    return path


Folder = Annotated[str, AfterValidator(_local_folder)]


class SweepRequest(BaseModel):
    """What `fadrm tune` was asked (tune.sweep_command builds it from the flags). A bad value fails when
    it is built, as one ConfigError line that names the flag."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = Field(min_length=1)
    teachers: list[str]
    out: Folder
    preset: str = "fadrm"
    ipc: Count | None = None
    classes: Indices | None = None
    seed: Index | None = None
    params: list[str] = []
    space_file: str | None = None
    samples: Count | None = None        # None: 1 for a grid, 10 for random and optuna
    search: Literal["grid", "random", "optuna"] = "grid"
    scheduler: Literal["asha", "fifo"] = "asha"
    metric: Literal["top1"] = "top1"
    student: str | None = None
    seeds: Count | None = None
    epochs: Count | None = None
    protocol: Literal["short", "published"] | None = None
    eval_set: list[str] = []
    max_concurrent: Count | None = None
    cpus_per_trial: float = Field(1.0, gt=0)
    gpus_per_trial: float = Field(0.0, ge=0)
    # Where the trials distill and train their students: cuda gives each trial a whole GPU unless
    # --gpus-per-trial says its share; None: cuda when --gpus-per-trial gives the trials GPUs.
    device: Literal["cpu", "cuda"] | None = None
    workers_per_trial: Count = 1
    address: str | None = None
    store: Folder | None = None         # default OUT/store
    data_root: str | None = None
    share: bool = True                  # dataset, teachers and patches shared (False: bench.sweep's control)
    progress: bool = True

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(_request_error(exc, data), error_loc(exc)) from None

    @property
    def trial_device(self) -> str:
        """Where each trial runs: cuda when it is given a GPU share."""
        return "cuda" if self.trial_gpus > 0 else "cpu"

    @property
    def trial_gpus(self) -> float:
        """The GPU share of each trial: --gpus-per-trial, or one GPU for --device cuda."""
        return self.gpus_per_trial or (1.0 if self.device == "cuda" else 0.0)

    @property
    def sample_count(self) -> int:
        return self.samples or (1 if self.search == "grid" else 10)

    def identity(self) -> dict:
        """What makes a sweep this sweep (a rerun with the same identity resumes it)."""
        keep = ("dataset", "teachers", "preset", "ipc", "classes", "seed", "params", "space_file", "samples",
                "search", "scheduler", "metric", "student", "seeds", "epochs", "protocol", "eval_set")
        return {k: v for k, v in self.model_dump(mode="json").items() if k in keep}


def _request_error(exc: ValidationError, data: dict) -> str:
    """One line for the first problem, naming the flag."""
    errors = exc.errors()
    unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return f"unknown sweep setting(s) {', '.join(unknown)}; known: {', '.join(SweepRequest.model_fields)}"
    err = errors[0]
    name = str(err["loc"][0])
    if err["type"] == "value_error":  # a validator of the field said what is wrong
        return f"{flag(name)} {err['ctx']['error']}"
    return f"{flag(name)} must be {_accepts(SweepRequest.model_fields[name])}, got {data.get(name, err['input'])!r}"


def _accepts(field) -> str:
    # A flag left out is None, so "or null" would only confuse.
    options = [a for a in get_args(field.annotation) if a is not type(None)]
    if len(options) == 1 and get_origin(options[0]) is Literal:  # an optional choice
        return "one of " + ", ".join(map(str, get_args(options[0])))
    return describe(field).removesuffix(" or null")


@dataclass(frozen=True)
class Prepared:
    """A checked request, with every path absolute (a Ray job's working folder may vanish)."""

    request: SweepRequest
    out: Path
    store: Path
    teachers: list[Path]
    data_root: str | None
    dataset: ImageDataset
    base: TrialBase                     # preset, flags and fixed values of every trial
    swept: dict[str, Param]
    eval_cfg: EvalConfig
    device: str
    checked: int                        # configurations checked before the sweep
    total: int                          # trials of the whole sweep


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


def prepare(req: SweepRequest) -> Prepared:
    """Check every input before any trial: raises ConfigError (or a library error) in one line.
    The flags, the folders, the teachers, the space and each value alone are checked before
    torch and the dataset load, so a bad command is refused at once."""
    from fadrm_ray.config import parse_overrides
    from fadrm_ray.fileio import check_output_dir
    from fadrm_ray.settings import layered

    _check_search(req)
    if req.device == "cpu" and req.gpus_per_trial > 0:
        raise ConfigError(f"--device cpu with --gpus-per-trial {req.gpus_per_trial}: a CPU trial holds no GPU; "
                          f"drop one of them", ("device",))
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
    base = TrialBase(preset=req.preset, ipc=req.ipc, classes=req.classes, seed=req.seed, fixed=fixed)
    check_values(base, swept)
    eval_cfg = layered(EvalConfig, parse_overrides(req.eval_set, EvalConfig),
                       flags={"student": req.student, "seeds": req.seeds, "epochs": req.epochs,
                              "protocol": req.protocol})
    _check_resume(out, req)
    from fadrm_ray.data import get_dataset  # torch loads here, after every check that does not need it

    data_root = str(Path(req.data_root).absolute()) if req.data_root else None
    dataset = get_dataset(req.dataset, root=data_root)
    device = req.trial_device
    checked = validate_space(base, swept, dataset, device)
    return Prepared(req, out, store, [Path(t).absolute() for t in req.teachers], data_root, dataset, base, swept,
                    eval_cfg, device, checked, trial_count(swept, req.search, req.sample_count))


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

    from fadrm_ray.patches import ClassSelection
    from fadrm_ray.events import append_event
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
    out, cost, pending = {}, {"keys": len(wanted), "scored": 0, "seconds": 0.0}, {}
    folder = p.out / "patches"
    task = ray.remote(score_patches).options(num_cpus=req.cpus_per_trial, num_gpus=req.trial_gpus)
    for key, (cfg, labels) in wanted.items():
        saved = folder / f"{key}.json"
        if saved.is_file():
            out[key] = {s.label: s for s in map(ClassSelection.from_dict, json.loads(saved.read_text()))}
        else:
            job = PatchScoring(config=cfg, labels=labels, device=p.device, threads=max(1, int(req.cpus_per_trial)))
            pending[key] = task.remote(job, ray.put(ds), blobs)
    for key, ref in pending.items():
        selections, seconds = ray.get(ref)
        out[key] = selections
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.json").write_text(json.dumps([s.to_dict() for s in selections.values()]))
        cost["scored"] += len(selections)
        cost["seconds"] += seconds
        append_event(str(p.out / "events.jsonl"), "patches_scored", key=key, classes=len(selections), seconds=seconds)
    return out, cost


def random_reference(p: Prepared, blobs: list[bytes]):
    """A Ray task (`tune.trainable.random_real_top1`, with a trial's resources) that trains the
    students of random real images the trials are compared with; None where the trials differ
    in what those images are (a swept seed or class list)."""
    import ray

    from tune.trainable import random_real_top1

    if {"seed", "classes"} & set(p.swept):
        return None
    req = p.request
    task = ray.remote(random_real_top1).options(num_cpus=req.cpus_per_trial, num_gpus=req.trial_gpus)
    return task.remote(trial_settings(p), p.dataset, blobs)


def mark_below_random(rows: list[TrialRow], reference, interrupted: bool) -> str:
    """Each finished row's gain over random real images, seed by seed (`vs_random`, a
    `baselines.gain_text`), and `below_random` where it is clearly below them (more than two
    standard errors); returns one line on what was compared. An interrupted sweep does not train
    those students: the same command, resuming, compares."""
    import ray

    from fadrm_ray.evaluation.baselines import gain_text, paired_gain

    if interrupted:
        return "not compared: the sweep was interrupted (resuming it compares)"
    if reference is None:
        return "not compared: the trials sweep the seed or the classes, so random real images differ between them"
    try:
        random_top1 = ray.get(reference)
    except Exception as exc:  # noqa: BLE001 - the sweep's results stand without the comparison
        return f"not compared: the random real images' students failed ({type(exc).__name__}: {exc})"
    below = 0
    for row in rows:
        if row.state != "done" or not row.top1_per_seed or len(row.top1_per_seed) != len(random_top1):
            continue
        gain = paired_gain(row.top1_per_seed, random_top1)
        row.vs_random = gain_text(gain)
        row.below_random = gain.clearly_below
        below += row.below_random
    return (f"random real images: {sum(random_top1) / len(random_top1):.2f} top-1 over seeds "
            f"{', '.join(f'{v:.2f}' for v in random_top1)}; {below} finished trial{'s' if below != 1 else ''} "
            f"clearly below them (paired, more than two standard errors)")


def _tuner(p: Prepared, trainable, restore: bool, progress):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from tune.settings import TIME_ATTR

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
    param_space = {k: q.tune_domain(req.search) for k, q in p.swept.items()}
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
    before = os.getcwd()  # it exists: prepare() has just resolved the paths against it
    os.chdir(folder)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.chdir(before)


def run_sweep(req: SweepRequest) -> dict:
    """Run (or resume) the sweep; returns the summary (files, best trial, costs, and whether it
    was interrupted). Every file is written before Ray is left."""
    p = prepare(req)
    from actors.coordinator import ray_session

    started = time.perf_counter()
    p, pilot = with_pilot(p)
    p.out.mkdir(parents=True, exist_ok=True)
    (p.out / "sweep.json").write_text(json.dumps({"identity": req.identity(), "request": req.model_dump(mode="json")},
                                                 indent=1))
    with _working_folder(p.out), ray_session(req.address):
        try:
            return _sweep_on_ray(p, started, pilot)
        except Exception as exc:
            raise SweepFailed(f"the sweep failed after its checks: {type(exc).__name__}: {exc}") from exc


def with_pilot(p: Prepared) -> "tuple[Prepared, PilotRecord | None]":
    """The sweep with the recipe `auto` takes for its data fixed in every trial: the pilot's
    (fadrm_ray/pilot.py, measured or read back from the store) where it runs, so the trials and
    the patches shared between them resolve alike; unchanged where it does not or the recipe
    is swept."""
    from dataclasses import replace

    from fadrm_ray.pilot import ensure_pilot

    if "recipe" in p.swept:
        return p, None
    pilot = ensure_pilot(trial_config(p.base, {}), p.dataset, p.teachers, p.store, device=p.device,
                         on_line=lambda line: print(f"fadrm tune: note: {line}", file=sys.stderr))
    if pilot is None:
        return p, None
    base = p.base.model_copy(update={"fixed": {**p.base.fixed, "recipe": pilot.chosen}})
    return replace(p, base=base), pilot


def _sweep_on_ray(p: Prepared, started: float, pilot: "PilotRecord | None" = None) -> dict:
    from ray import tune

    from tune.results import SweepProgress, collect_rows, write_results
    from tune.trainable import run_trial

    req = p.request
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
    restore = tune.Tuner.can_restore(str(p.out / EXPERIMENT))
    progress = SweepProgress(p.swept, p.total, enabled=req.progress).activate()
    with contextlib.redirect_stdout(sys.stderr):  # Tune's own tables: stdout is for the result
        grid = _tuner(p, trainable, restore, progress).fit()
    rows = collect_rows(grid, p, progress.statuses)
    states = {s: sum(r.state == s for r in rows) for s in ("done", "stopped", "error", "interrupted", "pending")}
    interrupted = bool(states["interrupted"] or states["pending"])
    # After the trials, not beside them: started first, its students would hold a trial's
    # resources while the first trials wait for them.
    reference = None if interrupted else random_reference(p, blobs)
    random_note = mark_below_random(rows, reference, interrupted)
    files, best = write_results(p, rows, interrupted)
    summary = {"out": str(p.out), "experiment": str(p.out / EXPERIMENT), "store": str(p.store), "resumed": restore,
               "interrupted": interrupted, "trials": len(rows), "trials_total": p.total, "states": states,
               "configs_checked": p.checked, "swept": {k: q.describe() for k, q in p.swept.items()},
               "patches": patch_cost, "random_real": random_note, "wall_seconds": round(time.perf_counter() - started, 2),
               "best": None if interrupted else best, "best_so_far": best if interrupted else None,
               "files": files, "rows": [r.flat() for r in rows]}
    if pilot is not None:
        summary["pilot"] = pilot.summary()
    if interrupted:
        summary["resume"] = (f"run the same command again: it resumes {p.out / EXPERIMENT} (the finished trials "
                             f"are kept, interrupted ones continue from their last checkpoint, pending ones start)")
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
