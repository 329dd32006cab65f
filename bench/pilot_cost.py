"""What the pilot costs, beside the run it serves (fadrm_ray/pilot.py).

    python -m bench.pilot_cost --dataset SPEC --teacher PATH [--ipc 10] [--set KEY=VALUE ...]
                               [--pilot-set KEY=VALUE ...] [--run --store DIR] [--device cpu] [--json]

Times the probe `plan_pilot` uses on this device, then prints the pilot's sizes after its bound,
its estimated seconds, the run's estimated recover seconds (the run as `--set` and `--ipc` give
it) and the pilot's share of them, or why the pilot would be skipped. With `--run` it also runs
the pilot into `--store` (cached there: a second call reads it back) and prints the seconds it
took and its choice. Name the CPU of any figure: the estimates are this machine's.
"""
from __future__ import annotations

import argparse
import json
import time

from fadrm_ray.config import make_config, parse_overrides
from fadrm_ray.data import get_dataset
from fadrm_ray.models import load_teacher
from fadrm_ray.pilot import ensure_pilot, plan_pilot
from fadrm_ray.pilot_record import pilot_reason
from fadrm_ray.runs.job import JobParts
from fadrm_ray.runtime import resolve_device
from fadrm_ray.config import PilotConfig
from fadrm_ray.settings import layered

from bench.decode import cpu_name


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--ipc", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the run's DistillConfig")
    parser.add_argument("--pilot-set", action="append", default=[], metavar="KEY=VALUE", help="a PilotConfig value")
    parser.add_argument("--run", action="store_true", help="also run the pilot (into --store)")
    parser.add_argument("--store", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.run and not args.store:
        parser.error("--run needs --store")
    cfg = make_config("fadrm", overrides=args.set, ipc=args.ipc)
    settings = layered(PilotConfig, parse_overrides(args.pilot_set, PilotConfig))
    dataset = get_dataset(args.dataset)
    reason = pilot_reason(cfg, dataset)
    device = resolve_device(args.device)
    out: dict = {"dataset": dataset.name, "classes": dataset.num_classes, "image_size": dataset.image_size,
                 "ipc": args.ipc, "cpu": cpu_name(), "device": device, "no_pilot": reason}
    if reason is None:
        started = time.perf_counter()
        plan = plan_pilot(cfg, JobParts.of(dataset, [load_teacher(args.teacher, device=device)], device), settings)
        out.update(probe_seconds=round(time.perf_counter() - started, 2), pilot_full_seconds=round(plan.full, 1),
                   pilot_seconds=round(plan.estimate, 1), run_recover_seconds=round(plan.run, 1),
                   budget_seconds=round(plan.budget, 1), scale=round(plan.scale, 3),
                   skipped=plan.scale < settings.min_scale, share=round(plan.estimate / plan.run, 4) if plan.run else None)
        if args.run:
            started = time.perf_counter()
            record = ensure_pilot(cfg, dataset, [args.teacher], args.store, settings, device=device,
                                  on_line=lambda line: print(line, flush=True))
            out.update(measured_seconds=round(time.perf_counter() - started, 1), chosen=record.chosen,
                       summary=record.summary(), below_random=record.below_random)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>20}  {value}")
    return out


if __name__ == "__main__":
    main()
