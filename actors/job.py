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

if __name__ == "__main__":
    ensure_process_env()  # before torch loads (may re-execute the job's command once)
    argv = sys.argv[1:]
    address = os.environ.get("RAY_ADDRESS")
    if address and argv and argv[0] in ("distill", "demo") and "--address" not in argv and "--local" not in argv:
        argv = [*argv, "--address", address]
    sys.exit(main(argv))
