"""`fadrm distill`: distill a dataset into a store run.

The run's settings are built once from the command line (`build_config`: preset -> --config ->
--set -> --ipc/--classes/--seed), the execution flags become one `ExecutionSpec`, and everything
the input decides is checked in this process before any cluster starts. The job is then built
once, for the device type of the door that runs it (`fadrm_ray.runs.execute` with `--local`,
otherwise the Ray door the console script passes to `main`), and handed to that door whole with
the spec: `door.run(job, spec, parts)`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fadrm_ray.cli.common import (DATASET_HELP, CLIError, check_teachers, common_parser,
                                  door_of, emit, execution_parser, execution_spec, note, parse_classes)

if TYPE_CHECKING:
    from fadrm_ray.config import DistillConfig
    from fadrm_ray.runs.job import ExecutionSpec, JobParts

NAME = "distill"
# How this command bounds or skips the pilot, as its lines say.
BOUND_FLAGS = "--pilot-budget SECONDS bounds it, 0 or --set recipe=NAME skips it"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub):
    from fadrm_ray.recipes import PRESETS

    p = sub.add_parser(NAME, parents=[common_parser(), execution_parser()], help="distill a dataset into a store run")
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--teacher", action="append", required=True, help="teacher checkpoint (repeat for fadrm+)")
    p.add_argument("--preset", default="fadrm", choices=list(PRESETS), metavar="PRESET",
                   help=f"the method, one of {', '.join(PRESETS)} (docs/method.md section 7)")
    p.add_argument("--ipc", type=int, default=None, help="images per class (default 10)")
    p.add_argument("--classes", default=None, help="comma-separated class indices or class names, e.g. 0,3,7 "
                                                  "(default: all)")
    p.add_argument("--seed", type=int, default=None, help="the run's seed: the same seed, settings and data give "
                                                               "the same images (default 0)")
    p.add_argument("--config", default=None, help="YAML file of config values")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one DistillConfig value, e.g. alpha=0.6 (repeatable); every key is listed in "
                        "docs/architecture.md#configuration, and a wrong key's error lists them all")
    p.add_argument("--pilot-set", action="append", metavar="KEY=VALUE",
                   help="one setting of the pilot that picks `auto`'s recipe on colour data no one measured, "
                        "e.g. seeds=5 (repeatable; config.PilotConfig, docs/method.md section 7b)")
    p.add_argument("--pilot-budget", type=float, default=None, metavar="SECONDS",
                   help="at most this many seconds for the pilot (its sizes are scaled down to fit; below a "
                        "quarter of them it is skipped and the size's recipe taken); 0 skips it (default: 600 s, "
                        "or a tenth of the run's estimated recovery where that is more)")
    p.add_argument("--out", required=True, help="store root; the run goes to OUT/<run_id>")
    p.add_argument("--data-root", default=None, help="where downloadable datasets (cifar10, cifar100) live")
    return p


def build_config(args, class_names=None) -> "DistillConfig":
    """The run's config in one pass: preset -> --config -> --set -> --ipc/--classes/--seed
    (`--classes` by index, or by the dataset's `class_names`)."""
    from fadrm_ray.config import make_config

    return make_config(args.preset, args.config, args.set or [], ipc=args.ipc,
                       classes=parse_classes(args.classes, class_names), seed=args.seed)


def run(args) -> None:
    from fadrm_ray.recipes import RECIPE_FIELDS
    from fadrm_ray.data import dataset_notes, get_dataset
    from fadrm_ray.fileio import check_output_dir
    from fadrm_ray.estimate import seconds_text
    from fadrm_ray.layout import RunLayout
    from fadrm_ray.models import check_teacher_fits, load_teacher
    from fadrm_ray.runs.job import JobParts, build_job
    from fadrm_ray.runtime import process_info

    check_teachers(args.teacher)
    check_output_dir(args.out, "--out store")
    spec = execution_spec(args)
    door = door_of(spec, args.ray_distill)
    # Everything the input decides is checked here, in this process, before any cluster starts:
    # the dataset, the classes and every setting against it, the teachers against the dataset.
    dataset = get_dataset(args.dataset, root=spec.data_root)
    cfg = build_config(args, dataset.class_names)
    # Everything that needs no computation first, so that no pilot runs (and no Ray starts) for a
    # refused run: the settings against the data (classes, sizes), the teachers against the data
    # (classes, their order, size, channels), the device against what the door can give.
    cfg.resolve(dataset.image_size, dataset.num_classes, dataset.hflip, channels=dataset.channels)
    teachers = [load_teacher(path) for path in args.teacher]
    for _, info in teachers:
        check_teacher_fits(info, dataset)
    split_note = dataset.split_note(imported_teachers=any(info.imported is not None for _, info in teachers))
    for line in [split_note] * (split_note is not None) + dataset_notes(dataset):
        note(line)
    device_type = door.device_type(spec)
    parts = JobParts.of(dataset, teachers, "cpu")
    pilot = _pilot(args, cfg, dataset, spec, parts, device_type)
    # The job is built, and checked, once, for the device type its door runs on, then run there.
    job = build_job(cfg, dataset, args.dataset, parts.infos, args.out, device_type, spec.data_root)
    # The run's time as the pilot estimated it, at the recipe it chose, for a run that starts from
    # nothing (what the estimate is of).
    said = pilot.run_estimate() if pilot is not None and not RunLayout(job.run_dir).unit_ids() else None
    estimate = said[0] if said is not None else None
    if said is not None:
        note(f"this run: about {seconds_text(estimate)} at recipe {pilot.chosen}, {said[1]}")
    result = door.run(job, spec, parts)

    recipe = result.recipe or "not recorded"
    taken = [name for name in RECIPE_FIELDS if getattr(cfg, name) == "auto"]
    recipe += f"; it gave {', '.join(taken)}" if taken else "; every value it sets was given explicitly"
    payload = {**result.to_dict(), "recipe": recipe, "process": process_info()}
    waited = f", after waiting {result.waited_seconds:.0f} s for another process writing it" \
        if result.waited_seconds else ""
    estimated = f" (estimated {seconds_text(estimate)})" if estimate is not None and result.units_run else ""
    if estimated:
        payload["estimated_seconds"] = estimate
    lines = [f"distilled {result.images} images ({len(result.units_run)} units run, "
             f"{len(result.units_skipped)} already done{waited}) in {result.seconds:.1f} s{estimated}",
             f"recipe: {recipe}"]
    if pilot is not None:
        payload["pilot"] = {"summary": pilot.summary(), "below_random": pilot.below_random,
                            "record": pilot.model_dump(mode="json")}
        lines.append(pilot.summary())
        if pilot.below_random is not None:
            lines.append(f"warning: {pilot.below_random}")
        if pilot.cannot_tell is not None:
            lines.append(pilot.cannot_tell)
    lines.append(f"run: {result.run_dir} (read it at this IPC with --ipc {result.ipc})")
    emit(args, payload, "\n".join(lines))


def _pilot(args, cfg: "DistillConfig", dataset, spec: "ExecutionSpec", parts: "JobParts", device_type: str):
    """The pilot of this run (fadrm_ray/pilot.py), measured or read back, when its recipe is
    left to `auto` on colour data no one measured; None otherwise. `parts`: the run's teachers,
    loaded here once, which the pilot takes as they are; the run's estimate is of its units as
    the spec runs them (`RunShape.of_spec`: on `device_type`)."""
    from fadrm_ray.config import PilotConfig, parse_overrides
    from fadrm_ray.estimate import RunShape
    from fadrm_ray.pilot import PilotCaller, ensure_pilot
    from fadrm_ray.settings import layered

    if args.pilot_budget is not None and args.pilot_budget < 0:
        raise CLIError(f"--pilot-budget must be 0 (skip the pilot) or a number of seconds, got {args.pilot_budget:g}")
    settings = layered(PilotConfig, parse_overrides(args.pilot_set or [], PilotConfig),
                       flags={"budget": args.pilot_budget})
    return ensure_pilot(cfg, dataset, parts, args.out, settings, device=spec.device if spec.local else None,
                        on_line=note, caller=PilotCaller(progress=not args.quiet,
                                                         run_shape=RunShape.of_spec(spec, device_type),
                                                         bound_hint=BOUND_FLAGS))
