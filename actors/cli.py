"""The `fadrm` console script: the library's CLI with the Ray door plugged in.

`fadrm_ray` never imports Ray; this module passes the Ray door (`actors.coordinator`'s `run` and
`device_type`, imported only when a run uses them) to `fadrm_ray.cli.main`, so that `fadrm
distill` runs through Ray by default and `--local` keeps the one-process path.
The subcommands of the layers above (`fadrm tune`, `fadrm serve`) are found through the
`fadrm.commands` entry points (pyproject.toml), so this module never imports them.
"""
from __future__ import annotations

import sys
from importlib.metadata import entry_points
from types import ModuleType

from fadrm_ray import cli
from fadrm_ray.runtime import ensure_process_env


class RayDoor:
    """`actors.coordinator` as a door (`fadrm_ray.runs.execute.Door`), with Ray imported only when
    a run goes through it."""

    @staticmethod
    def device_type(spec):
        from actors import coordinator

        return coordinator.device_type(spec)

    @staticmethod
    def run(job, spec, parts=None):
        from actors import coordinator

        return coordinator.run(job, spec, parts)


def commands() -> list[ModuleType]:
    """The subcommands registered by the layers above (`fadrm.commands`: modules with NAME, HEAVY,
    add_parser(sub) and run(args)); a layer whose package is not present adds none (an error
    inside a present one is raised)."""
    found = []
    for entry in entry_points(group="fadrm.commands"):
        try:
            found.append(entry.load())
        except ModuleNotFoundError as exc:
            if not entry.module.startswith(str(exc.name)):
                raise
    return found


def main(argv: list[str] | None = None) -> int:
    extra = commands()
    heavy = set(cli.HEAVY_COMMANDS) | {c.NAME for c in extra if c.HEAVY}
    if argv is None and sys.argv[1:2] and sys.argv[1] in heavy:
        # The command line itself: give the process its OpenMP and allocator settings before
        # anything loads torch (this may re-execute the command once).
        ensure_process_env()
    return cli.main(argv, ray_distill=RayDoor(), commands=extra)


if __name__ == "__main__":
    sys.exit(main())
