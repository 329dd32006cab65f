"""Entry point for cluster jobs:

    ray job submit --working-dir . -- python -m actors.job distill --dataset ... --teacher ... --out ...

Inside a job, RAY_ADDRESS names the cluster the job runs on, so `--address` defaults to it;
everything else is the `fadrm` command.
"""
from __future__ import annotations

import os
import sys

from actors.cli import main
from fadrm_ray.runtime import ensure_process_env


def with_job_address(argv: list[str]) -> list[str]:
    """`argv` with `--address $RAY_ADDRESS` added, inside a Ray job, unless it names an address
    or runs without Ray (`--local`)."""
    address = os.environ.get("RAY_ADDRESS")
    if address and "--address" not in argv and "--local" not in argv:
        return [*argv, "--address", address]
    return list(argv)


PATH_FLAGS = ("--out", "--teacher", "--run", "--config", "--dataset", "--data-root")


def relative_paths(argv: list[str]) -> list[str]:
    """The paths of `argv` that are relative (a folder or Parquet dataset's path included): inside a
    Ray job they resolve in the job's uploaded working directory."""
    from fadrm_ray.data import path_source, split_spec  # loads no torch

    found = []
    for flag, given in zip(argv, argv[1:]):
        if flag not in PATH_FLAGS:
            continue
        if flag == "--dataset" and path_source(given) is None:
            continue
        value = split_spec(given)[3] if flag == "--dataset" else given
        if value and not os.path.isabs(os.path.expanduser(value)):
            found.append(f"{flag} {given}")
    return found


if __name__ == "__main__":
    ensure_process_env()  # before torch loads (may re-execute the job's command once)
    argv = sys.argv[1:]
    if os.environ.get("RAY_ADDRESS"):
        for said in relative_paths(argv):
            print(f"fadrm: note: {said} is a relative path: in this job it resolves in the job's uploaded working "
                  f"directory ({os.getcwd()}), not where `ray job submit` ran; give an absolute path on shared "
                  f"storage", file=sys.stderr)
    if argv and argv[0] in ("distill", "demo"):
        argv = with_job_address(argv)
    sys.exit(main(argv))
