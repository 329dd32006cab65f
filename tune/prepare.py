"""A sweep's request checked before any trial starts: `check` (what needs neither torch nor the
data), then `prepare` (every combination of the space against the loaded dataset), then
`with_pilot` (the recipe `auto` takes for the data, fixed in every trial).

`check` first resolves every path the request names (the dataset's, the teachers, OUT, the
store, the space file, the data root) against the working folder the command started in
(tune.request), then checks, each failure one ConfigError line: the flags (as `SweepRequest` is
built), the folders (local paths only), the teachers, the space and each of its values alone,
the evaluation settings, and whether OUT holds another sweep. What it returns, `Prepared`, is
what every later step of the sweep reads.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fadrm_ray.config import EvalConfig
from fadrm_ray.settings import ConfigError

from tune.request import SweepRequest, with_absolute_paths
from tune.settings import EVENTS, TrialBase, TrialSettings
from tune.space import Param, check_values, parse_space, split_space, trial_config, validate_space

if TYPE_CHECKING:
    from fadrm_ray.data.base import ImageDataset
    from fadrm_ray.pilot_record import PilotRecord


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


def trial_settings(p: Prepared) -> TrialSettings:
    """What every trial reads (tune.trainable.run_trial's `sweep`)."""
    req = p.request
    return TrialSettings(base=p.base, eval=p.eval_cfg, dataset=req.dataset, data_root=p.data_root,
                         teachers=[str(t) for t in p.teachers], store=str(p.store), device=p.device,
                         threads=max(1, int(req.cpus_per_trial)), workers_per_trial=req.workers_per_trial,
                         cpus_per_worker=req.cpus_per_trial, gpus_per_worker=req.trial_gpus or None,
                         events=str(p.out / EVENTS))



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
