"""The `fadrm` console script: the library's CLI with the Ray-backed distill plugged in.

`fadrm_ray` never imports Ray; this module passes `distill_on_ray` to `fadrm_ray.cli.main`, so
that `fadrm distill` runs through Ray by default and `--local` keeps the one-process path.
"""
from __future__ import annotations

import sys

from fadrm_ray import cli
from fadrm_ray.runtime import ensure_process_env


def _distill_on_ray(cfg, dataset_spec, teacher_paths, out_root, spec):
    from actors.coordinator import distill_on_ray  # Ray is imported only when a run uses it

    return distill_on_ray(cfg, dataset_spec, teacher_paths, out_root, spec)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] and sys.argv[1] in cli.HEAVY_COMMANDS:
        # The command line itself: give the process its OpenMP and allocator settings before
        # anything loads torch (this may re-execute the command once).
        ensure_process_env()
    return cli.main(argv, ray_distill=_distill_on_ray)


if __name__ == "__main__":
    sys.exit(main())
