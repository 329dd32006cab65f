"""`fadrm evaluate`: train students on a run's images and report their test top-1, beside the
baselines (random real images, the run's starting patches) and DD-Ranking's scores."""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from fadrm_ray.cli.common import (IPC_HELP, STUDENT_DEVICE_HELP, check_teachers, common_parser, emit, note,
                                  warn_incomplete)

if TYPE_CHECKING:
    from fadrm_ray.store.reader import RunReader

NAME = "evaluate"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser()], help="train students on a run's images, report test top-1")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--ipc", type=int, default=None, help=IPC_HELP)
    p.add_argument("--student", default=None, help="student model name (default convnet-bn)")
    p.add_argument("--epochs", type=int, default=None, help="student epochs (default: by the protocol)")
    p.add_argument("--seeds", type=int, default=None, help="students trained, seeds 0..N-1 (default 3)")
    p.add_argument("--soft-labels", default=None, choices=["online", "stored"],
                   help="teacher soft labels computed on the fly (the default), or precomputed into the run")
    p.add_argument("--protocol", default=None, choices=["short", "published"],
                   help="student schedule: short (about 600 steps, the default) or published (300 epochs, "
                        "1000 at IPC 1, stretched cosine)")
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="skip the baselines (random real images, the run's starting patches) and DD-Ranking's scores")
    p.add_argument("--no-ranking", dest="ranking", action="store_false",
                   help="skip DD-Ranking's HLR and LRS (hard-label students on the run and, once per dataset, "
                        "on its whole training split)")
    p.add_argument("--ars", action="store_true",
                   help="add DD-Ranking's ARS: the run and random real images evaluated again without augmentation")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one EvalConfig value, e.g. cosine_stretch=2 (repeatable)")
    p.add_argument("--dataset", default=None,
                   help="where the run's data is now, if not where the run records it (checked by fingerprint)")
    p.add_argument("--teacher", action="append", default=None,
                   help="where one of the run's teachers is now, if not where the run records it (checked by "
                        "sha256; repeatable)")
    p.add_argument("--device", default=None, help=STUDENT_DEVICE_HELP)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--incomplete", action="store_true", help="allow a run that was not finished")
    return p


def run(args) -> None:
    from fadrm_ray.estimate import seconds_text
    from fadrm_ray.evaluation.baselines import BASELINES, gain_text
    from fadrm_ray.config import EvalConfig, parse_overrides
    from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalSpec
    from fadrm_ray.evaluation.store_run import EvalScope, evaluate_store_run
    from fadrm_ray.data.base import OWN_SPLIT
    from fadrm_ray.runtime import process_info, resolve_device
    from fadrm_ray.settings import layered

    cfg = layered(EvalConfig, parse_overrides(args.set or [], EvalConfig),
                  flags={"student": args.student, "epochs": args.epochs, "seeds": args.seeds,
                         "soft_labels": args.soft_labels, "protocol": args.protocol})
    # The run's own data and teachers: where it records them, or where --dataset/--teacher say
    # they are now (checked by fingerprint and sha256 either way). The run is opened once; its
    # parts are read and checked before a dataset is loaded or a teacher read.
    job = EvalJob(config=cfg, incomplete=args.incomplete, ipc=args.ipc, dataset=args.dataset,
                  teacher_copies=args.teacher)
    spec = EvalSpec(device=resolve_device(args.device), threads=args.threads, progress=not args.quiet)
    scope = EvalScope(baselines=args.baselines, ranking="full" if args.baselines and args.ranking else "none",
                      ars=args.ars, report=True)
    planned = []

    def plan(said) -> None:  # what it will train, said before it trains
        planned.append(said)
        for line in said.lines():
            print(f"fadrm evaluate: {line}", file=sys.stderr, flush=True)

    hooks = EvalHooks(on_note=lambda line: print(f"fadrm evaluate: {line}", file=sys.stderr, flush=True),
                      on_open=lambda reader: opened(args, reader), on_plan=plan)
    started = time.perf_counter()
    measured = evaluate_store_run(args.run, job, spec, scope, hooks=hooks)
    took = time.perf_counter() - started
    result, report = measured.evaluation, measured.report
    recorded = measured.run.reader.provenance.dataset
    made = recorded.test_split if recorded is not None else None
    if made and made != OWN_SPLIT:
        note(f"the run's dataset has no test split of its own: its test images were {made}")
    per_seed = ", ".join(f"{v:.2f}" for v in result.top1_per_seed)
    tested = "" if result.classes is None else f", tested on its {len(result.classes)} classes ({result.test_size} images)"
    lines = [f"student {result.student} on {args.run}: top-1 {result.top1_mean:.2f} "
             f"± {result.top1_std:.2f}% over {len(result.top1_per_seed)} seeds ({per_seed}){tested}"]
    for name, base in result.baselines.items():
        if base.same_as is not None:
            lines.append(f"  {BASELINES[name]}: the same images as {BASELINES[base.same_as]} (above)")
        elif base.error is not None:
            lines.append(f"  {BASELINES[name]}: not available ({base.error})")
        else:
            lines.append(f"  {BASELINES[name]}: {base.top1_mean:.2f} ± {base.top1_std:.2f}% "
                         f"(gain {gain_text(result.paired_gains[name])})")
    if result.ranking is not None:
        from fadrm_ray.evaluation.ranking import hard_label_line, ranking_text

        lines.append(f"  DD-Ranking: {ranking_text(result.ranking)}")
        lines.extend(f"    not measured: {why}" for why in result.ranking.missing)
        hard = hard_label_line(result.ranking, result.top1_mean)
        if hard is not None:
            lines.append(f"  {hard}")
    lines.extend(f"  warning: {line}" for line in result.warnings)
    lines.append(f"report: {report.get('evaluation_plot', report.get('grid', ''))}")
    if planned and measured.planned_seconds is not None:
        lines.append(f"took {seconds_text(took)}: the planned sets {seconds_text(measured.planned_seconds)} (planned "
                     f"about {seconds_text(planned[0].seconds)}), the rest opening the run, timing the plan and "
                     f"writing the report")
    result = {**result.model_dump(mode="json"), "report": report, "process": process_info(), "seconds": round(took, 1),
              "plan": planned[0].model_dump(mode="json") if planned else None,
              "planned_sets_seconds": None if measured.planned_seconds is None else round(measured.planned_seconds, 1)}
    emit(args, result, "\n".join(lines))


def opened(args, reader: RunReader) -> None:
    """What is checked as soon as the run is open, before it is read: its report folder can be
    written, it is finished (or said not to be), the teachers named exist."""
    from fadrm_ray.fileio import check_output_dir

    check_output_dir(reader.layout.report_dir, "the run's report folder")
    warn_incomplete(args, reader.complete)
    check_teachers(args.teacher or [])
