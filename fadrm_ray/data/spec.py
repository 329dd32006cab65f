"""How a dataset spec is written: `NAME`, `NAME:PATH`, or `NAME+OPTION:PATH` (the registry of the
names is the package's `DATASETS`). Imports nothing: the `fadrm` command reads specs before torch loads."""
from __future__ import annotations

# The option of a folder's spec (`imagefolder+skip-bad-images:PATH`) and the flag of the commands
# that read one (`--skip-bad-images`): files that cannot be read are left out, not refused.
SKIP_BAD_IMAGES = "skip-bad-images"


def split_spec(spec: str) -> tuple[str, list[str], bool, str]:
    """`imagefolder+skip-bad-images:/x` -> ("imagefolder", ["skip-bad-images"], True, "/x"): the
    name (lower case), its options, whether a path was given, and the path."""
    kind, sep, arg = spec.strip().partition(":")
    name, *options = kind.split("+")
    return name.lower(), [o.strip().lower() for o in options], bool(sep), arg
