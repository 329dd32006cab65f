"""`python -m fadrm_ray.cli`: the `fadrm` command without Ray (`--local` runs only)."""
import sys

from fadrm_ray.cli import HEAVY_COMMANDS, main
from fadrm_ray.runtime import ensure_process_env

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in HEAVY_COMMANDS:
        ensure_process_env()  # before torch loads (may re-execute this command once)
    sys.exit(main())
