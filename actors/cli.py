"""The `fadrm` console script: the library's CLI with the Ray executor registered.

`fadrm_ray` never imports Ray; this module plugs the Ray-backed `distill` in, so that
`fadrm distill` runs through Ray by default and `--local` keeps the one-process path.
"""
from __future__ import annotations

import sys

from fadrm_ray import cli


def _distill_with_ray(cfg, dataset_spec, teacher_paths, out_root, args):
    from actors.coordinator import distill_on_ray

    return distill_on_ray(cfg, dataset_spec, teacher_paths, out_root, address=args.address,
                          workers=args.workers, cpus_per_worker=args.cpus_per_worker,
                          gpus_per_worker=args.gpus_per_worker, data_root=getattr(args, "data_root", None),
                          progress=not args.quiet)


def main(argv: list[str] | None = None) -> int:
    cli.register_executor("ray", _distill_with_ray)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
