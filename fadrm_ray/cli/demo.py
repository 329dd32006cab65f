"""`fadrm demo`: the whole pipeline on an offline dataset (squeeze, distill, evaluate, report,
export), its distillation through the same door as `fadrm distill` (`--local` or Ray)."""
from __future__ import annotations

from fadrm_ray.cli.common import common_parser, door_of, emit, execution_parser, execution_spec

NAME = "demo"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser(), execution_parser()],
                       help="the whole pipeline on an offline dataset (main job)")
    p.add_argument("--out", default="fadrm-demo", help="output directory")
    p.add_argument("--dataset", default="digits", choices=("digits", "mnist-sample"),
                   help="digits or mnist-sample")
    p.add_argument("--ipc", type=int, default=10)
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    return p


def run(args) -> None:
    """The main job on the embedded default: train a teacher on a real offline dataset, distill, export."""
    from fadrm_ray.fileio import check_output_dir
    from fadrm_ray.demo import run_demo

    check_output_dir(args.out, "--out")
    spec = execution_spec(args)
    door = door_of(spec, args.ray_distill)
    summary = run_demo(out=args.out, dataset_name=args.dataset, ipc=args.ipc, iterations=args.iterations,
                       epochs=args.epochs, spec=spec, door=door)
    lines = [f"{k}: {v}" for k, v in summary.items() if not isinstance(v, dict)]
    emit(args, summary, "\n".join(lines))
