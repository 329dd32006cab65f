"""`fadrm verify`: check every file of a run; `--repair` recomputes the units that fail."""
from __future__ import annotations

from fadrm_ray.cli.common import EXIT_FAILED, check_teachers, common_parser, emit

NAME = "verify"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser()], help="check every file of a run; --repair recomputes what fails")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--repair", action="store_true", help="recompute the units that fail, and finish the run")
    p.add_argument("--teacher", action="append", default=None,
                   help="where one of the run's teachers is now, if not where the run records it, for --repair "
                        "(checked by sha256; repeatable)")
    p.add_argument("--dataset", default=None,
                   help="where the run's data is now, if not where the run records it, for --repair (checked by "
                        "fingerprint)")
    p.add_argument("--device", default=None, help="cpu or cuda, for --repair")
    p.add_argument("--threads", type=int, default=None, help="torch threads, for --repair")
    return p


def run(args) -> None:
    """Check every file of a run; with --repair, recompute the units that fail (on `--threads`
    torch threads, which `main` sets for the whole command). Exits 1 while any unit fails."""
    from fadrm_ray.evaluation.report import stale_reports
    from fadrm_ray.store.verify import describe_check, verify_run

    if args.repair:
        from fadrm_ray.fileio import check_output_dir
        from fadrm_ray.repair import repair_run

        check_output_dir(args.run, "--run")
        check_teachers(args.teacher or [])
        outcome = repair_run(args.run, dataset=args.dataset, teacher_copies=args.teacher, device=args.device,
                             progress=not args.quiet)
        check, repaired = outcome.after, outcome.repaired
    else:
        check, repaired = verify_run(args.run), None
    check = check.model_copy(update={"report_stale": stale_reports(args.run)})
    ok = not check.bad_units
    lines = describe_check(check, repaired)
    emit(args, {**check.model_dump(mode="json"), "repaired": repaired, "ok": ok}, "\n".join(lines))
    if not ok:
        raise SystemExit(EXIT_FAILED)
