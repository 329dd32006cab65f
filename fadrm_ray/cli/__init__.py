"""The `fadrm` command: one subcommand per phase, each a module of this package with
`add_parser(sub)` (its subparser, arguments and help), `run(args)` (a thin wrapper over a library
function), `NAME` and `HEAVY`.

Every subcommand prints a short human summary, or with `--json` one JSON object on stdout
(progress bars go to stderr). Bad input, argparse's own complaints included, exits with status 2
and one line naming what is wrong, before any work starts: output locations are checked first
(a directory, or one that can be created, that this process can write to; an output never
replaces anything). Storage that fails during the work (full, read-only) exits with status 1
and one line; what was half-written is removed.

Each phase's settings are built once from the command line (a flag left unset means the
model's default), and the runtime options become one `ExecutionSpec`. Without `--local`,
`fadrm distill` and `fadrm demo` run through `ray_distill`, the Ray door (`run(job, spec,
parts)` and `device_type(spec)`, as `fadrm_ray.runs.execute.Door` says) that the Ray layer passes
to `main` (actors/cli.py), so this package never imports Ray. The layers above (`tune`, `api`)
add their own subcommands the same way: each is a module of the same shape that the console
script finds through the `fadrm.commands` entry points and passes to `main`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from typing import TYPE_CHECKING, Sequence

from fadrm_ray.cli import (demo, distill, evaluate, export, import_teacher, info, squeeze, train_student,
                           verify)
from fadrm_ray.cli.common import (EXIT_BAD_INPUT, EXIT_FAILED, USER_ERRORS, CLIError, Parser, add_skip_bad_images,
                                  one_line, skip_bad_images_in)
from fadrm_ray.runtime import torch_threads

if TYPE_CHECKING:
    from fadrm_ray.runs.execute import Door

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "HEAVY_COMMANDS", "SUBCOMMANDS", "USER_ERRORS", "CLIError",
           "build_parser", "main"]

# The subcommands of the library, in the order `fadrm --help` lists them.
SUBCOMMANDS = (squeeze, import_teacher, train_student, distill, export, evaluate, info, verify, demo)
# Subcommands that train or distill: their process starts with runtime.heavy_process_env.
HEAVY_COMMANDS = tuple(command.NAME for command in SUBCOMMANDS if command.HEAVY)


def build_parser(ray_distill: "Door | None" = None, commands: Sequence = ()) -> argparse.ArgumentParser:
    """The `fadrm` parser: the library's subcommands, then `commands` (modules, or objects, with
    NAME, HEAVY, add_parser(sub) and run(args), from the layers above). `ray_distill`, the Ray
    door, is every parsed command's `args.ray_distill`. Every command whose `--dataset` takes a
    spec gets `--skip-bad-images` here (`add_skip_bad_images`), which `main` turns into the spec."""
    parser = Parser(prog="fadrm", description="FADRM dataset distillation.")
    parser.set_defaults(ray_distill=ray_distill)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (*SUBCOMMANDS, *commands):
        parser_of = command.add_parser(sub)
        parser_of.set_defaults(func=command.run)
        add_skip_bad_images(parser_of)
    return parser


def main(argv: list[str] | None = None, *, ray_distill: "Door | None" = None, commands: Sequence = ()) -> int:
    """Run one `fadrm` subcommand; `ray_distill` (the Ray door) runs distillations without
    --local, and `commands` are the subcommands of the layers above."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights never come from a hub here
    parser = build_parser(ray_distill, commands)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's one-line error (Parser)
        return int(exc.code or 0)
    try:
        skip_bad_images_in(args)
        # --threads is the torch thread count of the whole command (every phase it runs), set
        # here once.
        heavy = args.command in HEAVY_COMMANDS or any(c.HEAVY and c.NAME == args.command for c in commands)
        with torch_threads(getattr(args, "threads", None) if heavy else None):
            args.func(args)
    except USER_ERRORS as exc:
        if os.environ.get("FADRM_DEBUG"):
            raise
        print(f"fadrm {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # the reader of our output left (`fadrm info | head`): as a Unix tool does
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stdout without a descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        return 0
    except OSError as exc:  # the storage failed during the work: full, read-only, gone
        if os.environ.get("FADRM_DEBUG"):
            raise
        print(f"fadrm {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except SystemExit as exc:
        return int(exc.code or 0)
    except KeyboardInterrupt:
        print(f"fadrm {args.command}: interrupted; finished units are kept and a rerun resumes", file=sys.stderr)
        return 130
    except Exception:
        if os.environ.get("FADRM_DEBUG"):
            raise
        traceback.print_exc()
        print(f"fadrm {args.command}: internal error: a fault of fadrm, not of the input; the traceback above "
              f"shows where", file=sys.stderr)
        return EXIT_FAILED
    return 0
