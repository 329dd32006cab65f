"""`fadrm train-student`: students trained from a downloaded distilled set's files alone (the
images, the teacher(s) or stored soft labels, the recipe)."""
from __future__ import annotations

from pathlib import Path

from fadrm_ray.cli.common import DATASET_HELP, STUDENT_DEVICE_HELP, CLIError, check_teachers, common_parser, emit

NAME = "train-student"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser()],
                       help="train a student from a downloaded distilled set, its teacher and its recipe")
    p.add_argument("--data", required=True, help="the distilled Parquet file (a job's dataset download)")
    p.add_argument("--teacher", action="append", default=None,
                   help="the teacher checkpoint that gives the soft labels (repeat for a committee)")
    p.add_argument("--soft-labels", default=None,
                   help="stored soft labels instead of a teacher (`fadrm export --soft-labels`, GET .../soft-labels)")
    p.add_argument("--recipe", default=None, help="the student recipe, an EvalConfig as JSON (default: the defaults)")
    p.add_argument("--test", default=None, help=f"score on this dataset's test images of the file's classes: {DATASET_HELP}")
    p.add_argument("--seed", type=int, default=None, help="train one student with this seed")
    p.add_argument("--seeds", type=int, default=None,
                   help="train N students, the recipe's first N seeds (default 1: the recipe's first seed; the "
                        "report's figure is the mean over the recipe's seeds)")
    p.add_argument("--device", default=None, help=STUDENT_DEVICE_HELP)
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--data-root", default=None, help="where downloadable datasets live")
    return p


def run(args) -> None:
    """Students trained from downloaded files alone: the images, the teacher(s), the recipe."""
    import itertools
    import math

    from fadrm_ray.runtime import process_info, resolve_device
    from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
    from fadrm_ray.evaluation.from_files import read_recipe, train_from_files

    check_teachers(args.teacher or [])
    if args.soft_labels is not None and not Path(args.soft_labels).is_file():
        raise CLIError(f"soft-label file {args.soft_labels} does not exist")
    recipe = read_recipe(args.recipe)
    if args.seed is not None and args.seeds is not None:
        raise CLIError("--seed trains one student with that seed, --seeds N the recipe's first N: give one of them")
    if args.seeds is not None and args.seeds < 1:
        raise CLIError(f"--seeds must be at least 1, got {args.seeds}")
    # One student unless more are asked for: the recipe's seeds first (those its report averaged),
    # then the next integers.
    if args.seed is not None:
        seeds = [args.seed]
    else:
        more = itertools.count(max(recipe.seed_list) + 1)
        seeds = list(itertools.islice(itertools.chain(recipe.seed_list, more), args.seeds or 1))
    recipe = recipe.model_copy(update={"seeds": seeds})
    job = EvalJob(config=recipe, teacher_paths=args.teacher or [], dataset=args.test)
    spec = EvalSpec(device=resolve_device(args.device), threads=args.threads, progress=not args.quiet)
    result = train_from_files(args.data, job, spec, soft_labels=args.soft_labels, data_root=args.data_root)
    tested = not math.isnan(result.top1_mean)
    payload = {"top1": result.top1_mean if tested else None, "top1_per_seed": result.top1_per_seed if tested else None,
               "seeds": result.seeds, "images": result.images, "classes": result.classes,
               "test_size": result.test_size if tested else 0, "evaluation": result.model_dump(mode="json"),
               "process": process_info()}
    per_seed = ", ".join(f"{v:.2f}" for v in result.top1_per_seed)
    where = "" if result.classes is None else f" of its {len(result.classes)} classes"
    human = (f"student {result.student} on {result.images} images, {result.epochs} epochs, seeds {result.seeds}: "
             + (f"test top-1 {result.top1_mean:.2f}% ({per_seed}) on {result.test_size} test images{where}"
                if tested else "trained (no --test dataset, so no test top-1)"))
    emit(args, payload, human)
