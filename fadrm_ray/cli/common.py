"""What the `fadrm` subcommands share: the parser class and its help formatter, the common and
execution flags, the exit statuses and the errors reported in one line, the one `ExecutionSpec`
of the execution flags, and the small helpers that print (`emit`, `note`) or check input
(`parse_classes`, `check_teachers`).

Nothing here imports torch or Ray: a subcommand module imports this at its top, and the
process must still be able to set its OpenMP and allocator environment before torch loads
(`runtime.ensure_process_env`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from fadrm_ray.data import dataset_help
from fadrm_ray.errors import InputError

if TYPE_CHECKING:
    from fadrm_ray.runs.execute import Door
    from fadrm_ray.runs.job import ExecutionSpec

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
# What --dataset takes, for every command that reads one (fadrm tune's too): the data registry's.
DATASET_HELP = dataset_help()
STUDENT_DEVICE_HELP = ("where the students train and the teachers label: cpu, cuda or cuda:N (default: cuda when "
                       "torch sees a GPU); on CUDA in mixed precision, channels-last")
IPC_HELP = "read the run at this IPC: IPC indices 0..N-1 of every class (default: every image it holds)"
SKIP_BAD_IMAGES_HELP = ("with an image folder as --dataset: leave out its image files that cannot be read (each "
                        "named once, the count recorded in the run) instead of refusing the folder")
# The Ray doors: Ray's and Tune's own lines go to a ray.log under the run or sweep folder unless asked.
VERBOSE_HELP = "show Ray's (and Tune's) own lines on the terminal instead of the ray.log of the run or sweep"


class CLIError(Exception):
    """A user error the CLI reports in one line."""


# Bad input, in one line. Every error class of the library for it (ConfigError, DatasetError,
# EvaluationError, ModelError, StoreError, ...) is an `InputError`, whose module imports nothing,
# so a refused command stays fast. Any other exception, a plain ValueError too, is a fault of the
# program: status 1, with its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (CLIError, FileNotFoundError, InputError)


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, where it has one worth saying (not None, not
    a flag's False, not the True of a --no-X flag) and the help does not say it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        if isinstance(action, argparse._StoreFalseAction):  # --no-X: X is done unless the flag is given
            return text
        return f"{text} (default: {default})" if text else f"(default: {default})"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors in the CLI's form (one line, status 2, no usage block), and
    every subcommand's help showing its defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def common_parser() -> Parser:
    """The flags of every subcommand (a parent parser of each)."""
    common = Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    common.add_argument("--quiet", action="store_true", help="no progress bars")
    return common


def execution_parser() -> Parser:
    """The flags of the subcommands that distill (`distill`, `demo`): they become one `ExecutionSpec`."""
    execution = Parser(add_help=False)
    execution.add_argument("--local", action="store_true", help="run in this process, without Ray")
    execution.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    execution.add_argument("--threads", type=int, default=None, help="torch threads per process")
    execution.add_argument("--address", default=None, help="Ray cluster address (default: an embedded local Ray)")
    execution.add_argument("--workers", type=int, default=None,
                           help="distill actors (default: one per GPU, else one per --cpus-per-worker CPUs)")
    execution.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs each distill actor holds")
    execution.add_argument("--gpus-per-worker", type=float, default=None, help="GPU share per actor (fractions allowed)")
    execution.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return execution


def add_skip_bad_images(parser: argparse.ArgumentParser) -> None:
    """`--skip-bad-images` on a subcommand whose `--dataset` takes a dataset spec (no fixed
    choices), where it lacks the flag: the one spelling that a refused folder's line names works
    on every command that reads a dataset, the layers' above (`fadrm tune`) included."""
    options = {o: a for a in parser._actions for o in a.option_strings}
    dataset = options.get("--dataset")
    if dataset is not None and dataset.choices is None and "--skip-bad-images" not in options:
        parser.add_argument("--skip-bad-images", action="store_true", help=SKIP_BAD_IMAGES_HELP)


def skip_bad_images_in(args) -> None:
    """With `--skip-bad-images`, the `--dataset` spec that leaves out unreadable files
    (`imagefolder+skip-bad-images:PATH`; refused for a dataset that is not an image folder).
    Without `--dataset` (evaluate, verify: the run's recorded data) there is nothing to add: the
    recorded spec already leaves out what the run's distill left out."""
    if getattr(args, "skip_bad_images", False) and getattr(args, "dataset", None):
        from fadrm_ray.data import skipping_bad_images

        args.dataset = skipping_bad_images(args.dataset)


def execution_spec(args) -> "ExecutionSpec":
    from fadrm_ray.runs.job import ExecutionSpec

    return ExecutionSpec(local=args.local, address=args.address, workers=args.workers,
                         cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker,
                         device=args.device, threads=args.threads, data_root=getattr(args, "data_root", None),
                         progress=not args.quiet, verbose=args.verbose)


def door_of(spec: "ExecutionSpec", ray_distill: "Door | None") -> "Door":
    """The door a run of `spec` goes through: this process (`fadrm_ray.runs.execute`) with
    `--local`, else `ray_distill`, the Ray door the console script passes to `main`."""
    if spec.local:
        from fadrm_ray.runs import execute

        return execute
    if ray_distill is None:
        raise CLIError("the Ray executor is not available in this entry point; pass --local "
                       "or use the `fadrm` console script")
    return ray_distill


def parse_classes(text: str | None, names: Sequence[str] | None = None) -> list[int] | None:
    """`--classes`: comma-separated class indices, or the dataset's class names (`names`), as the
    REST service takes them."""
    if text is None:
        return None
    items = [c.strip() for c in text.split(",")]
    known = {str(n): i for i, n in enumerate(names or ())}
    if not all(c.isdigit() or c in known for c in items):
        unknown = [c for c in items if not c.isdigit() and c not in known]
        hint = f"; the dataset's classes are {', '.join(list(known)[:8])}{', ...' if len(known) > 8 else ''}" \
            if known else ""
        raise CLIError(f"--classes takes comma-separated class indices like 0,3,7, or the dataset's class names: "
                       f"{unknown[0]!r} is neither{hint}")
    classes = [int(c) if c.isdigit() and c not in known else known[c] for c in items]
    repeated = sorted({c for c in classes if classes.count(c) > 1})
    if repeated:
        raise CLIError(f"--classes names class {repeated[0]} more than once: {text!r}")
    return classes


def check_teachers(paths: Sequence[str]) -> None:
    for path in paths:
        if Path(path).is_dir():
            raise CLIError(f"teacher checkpoint {path} is a directory, not a checkpoint file")
        if not Path(path).is_file():
            raise CLIError(f"teacher checkpoint {path} does not exist")


def warn_incomplete(args, reader_complete: bool) -> None:
    if not reader_complete:
        print(f"fadrm {args.command}: warning: {args.run} is incomplete (the run was not finished); "
              f"using the units written so far", file=sys.stderr)


def note(line: str) -> None:
    """One line on stderr the user should read before trusting a figure (a split made here)."""
    print(f"fadrm: note: {line}", file=sys.stderr)


def emit(args, payload: dict, human: str) -> None:
    if args.json:
        print(json.dumps(payload, default=str, ensure_ascii=False))
    else:
        print(human)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
