"""`fadrm verify`: check every file of a run (its units against their manifests, every other file
read whole: `fadrm_ray.evaluation.verify_files.check_run`); `--repair` recomputes the units
that fail (`fadrm_ray.repair`) and mends the other files it can (the evaluation's:
`fadrm_ray.evaluation.mend_files`), saying which it cannot and what to do."""
from __future__ import annotations

from fadrm_ray.cli.common import EXIT_FAILED, check_teachers, common_parser, emit

NAME = "verify"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser()],
                       help="check every file of a run; --repair recomputes what fails where it can")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--repair", action="store_true",
                   help="recompute the units that fail and finish the run; mend the other damaged files (stored "
                        "soft labels recomputed from the teachers), or say what cannot be")
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
    """Check every file of a run; with --repair, recompute the units that fail and mend the other
    files (on `--threads` torch threads, which `main` sets for the whole command). Exits 1 while
    any unit or file fails."""
    from fadrm_ray.evaluation.report import stale_reports
    from fadrm_ray.evaluation.verify_files import check_run, evaluation_file_problems
    from fadrm_ray.store.verify import describe_check

    mended, left, repaired = None, {}, None
    if args.repair:
        from fadrm_ray.evaluation.mend_files import left_unmended, mend_evaluation_files
        from fadrm_ray.fileio import check_output_dir
        from fadrm_ray.repair import repair_run

        check_output_dir(args.run, "--run")
        check_teachers(args.teacher or [])
        outcome = repair_run(args.run, dataset=args.dataset, teacher_copies=args.teacher, device=args.device,
                             progress=not args.quiet)
        mended, left = mend_evaluation_files(args.run, args.teacher, args.device)
        repaired, mended = outcome.repaired, outcome.mended + mended
        files = left_unmended(evaluation_file_problems(args.run), left)
        check = outcome.after.model_copy(update={"files": {**outcome.after.files, **files}})
    else:
        check = check_run(args.run)
    check = check.model_copy(update={"report_stale": stale_reports(args.run)})
    lines = describe_check(check, repaired)
    if mended is not None:
        lines[2:2] = [f"mended {len(mended)} other file(s): {', '.join(mended) or '-'}",
                      *(f"could not mend {path}: {why}" for path, why in left.items())]
    emit(args, {**check.model_dump(mode="json"), "repaired": repaired, "mended": mended, "not_mended": left,
                "ok": check.ok}, "\n".join(lines))
    if not check.ok:
        raise SystemExit(EXIT_FAILED)
