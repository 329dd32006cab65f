"""The `fadrm` console script: the library's CLI with the Ray-backed distill plugged in.

`fadrm_ray` never imports Ray; this module passes `distill_on_ray` to `fadrm_ray.commands.main`, so
that `fadrm distill` runs through Ray by default and `--local` keeps the one-process path.
The subcommands of the layers above (`fadrm tune`, `fadrm serve`) are found through the
`fadrm.commands` entry points (pyproject.toml), so this module never imports them.
"""
from __future__ import annotations

import sys
from importlib.metadata import entry_points

from fadrm_ray import commands as fadrm_commands
from fadrm_ray.runtime import ensure_process_env


def _distill_on_ray(cfg, dataset_spec, teacher_paths, out_root, spec, dataset=None):
    from actors.coordinator import distill_on_ray  # Ray is imported only when a run uses it

    return distill_on_ray(cfg, dataset_spec, teacher_paths, out_root, spec, dataset=dataset)


def commands() -> list[fadrm_commands.Command]:
    """The subcommands registered by the layers above (`fadrm.commands`); a layer whose package
    is not present adds none (an error inside a present one is raised)."""
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
    heavy = set(fadrm_commands.HEAVY_COMMANDS) | {c.name for c in extra if c.heavy}
    if argv is None and sys.argv[1:2] and sys.argv[1] in heavy:
        # The command line itself: give the process its OpenMP and allocator settings before
        # anything loads torch (this may re-execute the command once).
        ensure_process_env()
    return fadrm_commands.main(argv, ray_distill=_distill_on_ray, commands=extra)


if __name__ == "__main__":
    sys.exit(main())
