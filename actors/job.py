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


if __name__ == "__main__":
    ensure_process_env()  # before torch loads (may re-execute the job's command once)
    argv = sys.argv[1:]
    if argv and argv[0] in ("distill", "demo"):
        argv = with_job_address(argv)
    sys.exit(main(argv))
