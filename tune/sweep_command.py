"""`fadrm tune`: sweep DistillConfig values on Ray Tune (tune.sweep), registered with the `fadrm`
command through the `fadrm.commands` entry point (pyproject.toml): a subcommand module of the
shape of `fadrm_ray.cli`'s (NAME, HEAVY, add_parser(sub), run(args)).

Exit status: 0 when the sweep ended with at least one finished trial; 2 for a bad command (one
line); 130 when it was interrupted (SIGINT, at any moment): the results so far are written and
marked interrupted, and the same command resumes it; 1 when no trial finished (the first trial's
error in one line on stderr; each failed trial's on stdout and in results.md), or when something
unexpected failed after the checks, with its traceback on stderr.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import TYPE_CHECKING, Literal, get_args, get_origin

if TYPE_CHECKING:
    from tune.outputs import SweepSummary

EXIT_FAILED, EXIT_INTERRUPTED = 1, 130


def _choices(field: str) -> list[str]:
    """The values SweepRequest accepts for a Literal field (or an optional one): the one list
    the flag offers."""
    from tune.request import SweepRequest

    annotation = SweepRequest.model_fields[field].annotation
    literal = next((a for a in (annotation, *get_args(annotation)) if get_origin(a) is Literal), annotation)
    return list(get_args(literal))


NAME = "tune"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub) -> argparse.ArgumentParser:
    from fadrm_ray.cli.common import DATASET_HELP, VERBOSE_HELP, common_parser
    from fadrm_ray.recipes import PRESETS

    p = sub.add_parser(NAME, parents=[common_parser()],
                       help="sweep config values (alpha, k, downsample_size, ...) on Ray Tune; writes results, "
                            "best.yaml, plots")
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--teacher", action="append", required=True, help="teacher checkpoint (repeat for fadrm+)")
    p.add_argument("--preset", default="fadrm", choices=list(PRESETS))
    p.add_argument("--ipc", type=int, default=None, help="images per class")
    p.add_argument("--classes", default=None, help="comma-separated class indices (default: all)")
    p.add_argument("--seed", type=int, default=None, help="distillation seed (default 0)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=SPEC",
                   help="a swept DistillConfig key: V1,V2,... (a grid), uniform(a,b), loguniform(a,b), "
                        "randint(a,b) or choice(V1,V2,...); one value fixes the key (repeatable)")
    p.add_argument("--space", default=None, metavar="FILE.yaml", help="keys and specs as a YAML mapping")
    p.add_argument("--samples", type=int, default=None,
                   help="Tune samples (default: 1 for a grid, i.e. each grid point once; 10 for random/optuna)")
    p.add_argument("--search", default="grid", choices=_choices("search"))
    p.add_argument("--scheduler", default="asha", choices=_choices("scheduler"),
                   help="asha (default): stop trials whose students lag at 50%% of their schedule")
    p.add_argument("--metric", default="top1", choices=_choices("metric"), help="student test top-1, maximized")
    p.add_argument("--student", default=None, help="student model (default convnet-bn)")
    p.add_argument("--seeds", type=int, default=None, help="student seeds per trial (default 3)")
    p.add_argument("--epochs", type=int, default=None, help="student epochs (default: by the protocol)")
    p.add_argument("--protocol", default=None, choices=_choices("protocol"), help="as in fadrm evaluate")
    p.add_argument("--confirm-seeds", type=int, default=3,
                   help="student seeds, beyond the trials' own, on which the 3 best trials are evaluated again "
                        "beside random real images before best.yaml is written (default 3; 0: none, the best "
                        "compared on the trials' own seeds; 1 and 2 are refused: their standard error is not usable)")
    p.add_argument("--eval-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one EvalConfig value of the students (repeatable)")
    p.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: as resources allow)")
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--gpus-per-trial", type=float, default=0.0,
                   help="GPU share per trial (fractions allowed; default 0, or 1 with --device cuda)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="where trials distill and train their students (default: cuda when --gpus-per-trial "
                        "gives them GPUs, else cpu)")
    p.add_argument("--workers-per-trial", type=int, default=1,
                   help="DistillWorker actors per trial, in the trial's placement group (default 1: in the trial)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: an embedded local Ray)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("--store", default=None, help="store the trials distill into (default OUT/store)")
    p.add_argument("--data-root", default=None)
    p.add_argument("--out", required=True,
                   help="sweep folder (local or mounted, not a URI); the same command on it resumes the sweep")
    return p


def run(args: argparse.Namespace) -> None:
    from fadrm_ray.cli.common import parse_classes
    from tune.request import SweepRequest
    from tune.sweep import SweepFailed, run_sweep

    request = SweepRequest(
        dataset=args.dataset, teachers=args.teacher, out=args.out, preset=args.preset, ipc=args.ipc,
        classes=parse_classes(args.classes), seed=args.seed, params=args.param, space_file=args.space,
        samples=args.samples, search=args.search, scheduler=args.scheduler, metric=args.metric,
        student=args.student, seeds=args.seeds, epochs=args.epochs, protocol=args.protocol,
        eval_set=args.eval_set, confirm_seeds=args.confirm_seeds, max_concurrent=args.max_concurrent, cpus_per_trial=args.cpus_per_trial,
        gpus_per_trial=args.gpus_per_trial, device=args.device, workers_per_trial=args.workers_per_trial, address=args.address,
        store=args.store, data_root=args.data_root, progress=not args.quiet, verbose=args.verbose)
    try:
        summary = run_sweep(request)
    except SweepFailed as exc:
        traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"fadrm tune: error: {exc}; the traceback is above. Tune's state is in {args.out}/experiment "
              f"and the same command resumes the sweep", file=sys.stderr)
        raise SystemExit(EXIT_FAILED) from None
    if args.json:
        print(summary.model_dump_json())
    if summary.interrupted:
        s = summary.states
        print(f"fadrm tune: interrupted {summary.interrupted_during}: {s['done']} of {summary.trials_total} trials "
              f"finished ({s['stopped']} stopped, {s['error']} errored, {s['interrupted']} interrupted, "
              f"{s['pending']} not started); the results so far are in {summary.files['results_md']}, no best.yaml; "
              f"the same command resumes the sweep", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED)
    if not args.json:
        _say(summary)
    if summary.finished == 0:
        first = summary.failed[0] if summary.failed else None
        reason = (f"{len(summary.failed)} of {summary.trials} trials failed; the first, trial {first.trial}: "
                  f"{first.error}") if first else "every trial was stopped"
        print(f"fadrm tune: error: no trial finished: {reason}; see {summary.files['results_md']}",
              file=sys.stderr)
        raise SystemExit(EXIT_FAILED)


def _say(summary: "SweepSummary") -> None:
    print(f"{summary.trials} trials ({'resumed' if summary.resumed else 'new'} sweep) in "
          f"{summary.wall_seconds:.0f} s; results in {summary.files['results_md']}")
    for failed in summary.failed:
        values = " ".join(f"{k}={v}" for k, v in failed.values.items())
        print(f"trial {failed.trial} {values}: error: {failed.error}")
    best = summary.best
    if best is None:
        print("no trial finished")
        return
    values = " ".join(f"{k}={best[k]}" for k in summary.swept)
    confirmed = summary.confirmation
    if confirmed is not None and confirmed.new_seeds:
        top = confirmed.trials[0]
        spread = f" ± {top.stderr:.2f} s.e." if top.stderr is not None else ""
        print(f"best: trial {best['trial']} {values}: top-1 {top.mean:.2f}{spread} on {len(confirmed.seeds)} new "
              f"student seed{'s' if len(confirmed.seeds) != 1 else ''} (run {best['run_id']})")
    else:
        print(f"best: trial {best['trial']} {values}: top-1 {best['top1']:.2f} ± {best['top1_std'] or 0:.2f} "
              f"(run {best['run_id']})")
    for line in (confirmed.lines if confirmed is not None else []):
        if line.startswith("- "):
            print(line[2:])
    print(f"config: {summary.files['best_yaml']}")
