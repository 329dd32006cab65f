"""`python -m bench.api_probes SUBCOMMAND ...` (the package docstring lists them)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.api_probes import __doc__ as DOC
from bench.api_probes import limits, probes, store, strings
from bench.api_probes.server import prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.api_probes", description=DOC.split("\n\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default=None, help="folder for the stores and the teacher (default: a temp dir)")
    common.add_argument("--json", action="store_true", help="one JSON object")
    sub.add_parser("limits", parents=[common], help="requests that ask for work without bound")
    floods = sub.add_parser("floods", parents=[common], help="what a client can make the service spend or keep")
    floods.add_argument("--seconds", type=float, default=15.0, help="length of each flood")
    strs = sub.add_parser("strings", parents=[common], help="strings, descriptors, a broken teacher, a damaged run")
    strs.add_argument("--bursts", type=int, default=10)
    strs.add_argument("--idle", type=float, default=11.0, help="seconds of quiet before each burst")
    strs.add_argument("--teacher-mb", type=int, default=200)
    st = sub.add_parser("store", parents=[common], help="the store under a hostile client")
    st.add_argument("--seconds", type=float, default=30.0, help="of the retention race")
    st.add_argument("--records", type=int, default=10, help="FADRM_MAX_JOB_RECORDS")
    st.add_argument("--soft-label-mib", type=int, default=104)
    health = sub.add_parser("health", parents=[common], help="/healthz and /readyz under pollers, a distill running")
    health.add_argument("--pollers", type=int, default=40)
    health.add_argument("--seconds", type=float, default=20.0)
    health.add_argument("--interval", type=float, default=0.0, help="seconds each poller waits between requests")
    health.add_argument("--iterations", type=int, default=4000, help="recover iterations of the job running meanwhile")
    health.add_argument("--code", default=None, help="run the service of this checkout instead (code before a change)")
    sub.add_parser("catalog", parents=[common], help="the first GET /v1/datasets after a start")
    labels = sub.add_parser("soft-labels", parents=[common], help="the first soft-label download of many epochs")
    labels.add_argument("--epochs", type=int, nargs="+", default=[300, 1000, 2000])
    args = parser.parse_args(argv)
    root = prepare(args.out, f"fadrm-api-probes-{args.probe}-")
    if args.probe == "limits":
        result = limits.limits(root)
        if not args.json:
            limits.print_limits(result)
            return 0
    else:
        result = {"floods": lambda: limits.floods(root, args.seconds),
                  "strings": lambda: strings.run_all(root, args.bursts, args.idle, args.teacher_mb),
                  "store": lambda: store.run_all(root, args.seconds, args.records, args.soft_label_mib),
                  "health": lambda: probes.health(root, args.pollers, args.seconds, args.interval, args.iterations,
                                                  Path(args.code) if args.code else None),
                  "catalog": lambda: probes.catalog(root),
                  "soft-labels": lambda: probes.soft_labels(root, args.epochs)}[args.probe]()
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
