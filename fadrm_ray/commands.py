"""The `fadrm` command: one subcommand per phase, each a thin wrapper over a library function.

Every subcommand prints a short human summary, or with `--json` one JSON object on stdout
(progress bars go to stderr). Bad input, argparse's own complaints included, exits with status 2
and one line naming what is wrong, before any work starts: output locations are checked first
(a directory, or one that can be created, that this process can write to; an output never
replaces anything). Storage that fails during the work (full, read-only) exits with status 1
and one line; what was half-written is removed.

Each phase's settings are built once from the command line (a flag left unset means the
model's default), and the runtime options become one `ExecutionSpec`. Without `--local`,
`fadrm distill` and `fadrm demo` run through `ray_distill`, which the Ray layer passes to `main`
(actors/cli.py), so this package never imports Ray. The layers above (`tune`, `api`) add their
own subcommands the same way: each is a `Command` that the console script finds through the
`fadrm.commands` entry points and passes to `main`.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from fadrm_ray.errors import InputError
from fadrm_ray.runtime import ensure_process_env, torch_threads

if TYPE_CHECKING:
    from fadrm_ray.config import DistillConfig
    from fadrm_ray.pilot_record import PilotRecord
    from fadrm_ray.run.execute import DistillResult
    from fadrm_ray.run.job import ExecutionSpec

    # ray_distill(cfg, dataset_spec, teacher_paths, out_root, spec, dataset=LOADED) -> DistillResult
    RayDistill = Callable[..., DistillResult]

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
# Subcommands that train or distill: their process starts with runtime.heavy_process_env.
HEAVY_COMMANDS = ("squeeze", "import-teacher", "distill", "evaluate", "demo", "verify", "train-student")
# What --dataset takes, for every command that reads one (fadrm tune's too).
DATASET_HELP = "digits, mnist-sample, fashion-mnist, clipart10, cifar10, cifar100, imagefolder:PATH or parquet:PATH"


class Command(Protocol):
    """A subcommand from a layer above the library (`fadrm tune`, `fadrm serve`).

    `add_arguments` fills its parser (the common `--json`/`--quiet` are already there);
    `run(args)` does the work, raising `InputError`/`CLIError` for bad input (one line, status 2).
    """

    name: str
    help: str
    heavy: bool  # the process gets runtime.heavy_process_env before torch loads

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> None: ...


class CLIError(Exception):
    """A user error the CLI reports in one line."""


class _Defaults(argparse.HelpFormatter):
    """Help that ends each option with its default, where it has one worth saying (not None, not
    a flag's False) and the help does not say it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: {default})" if text else f"(default: {default})"


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in the CLI's form (one line, status 2, no usage block), and
    every subcommand's help showing its defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Defaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def execution_spec(args) -> "ExecutionSpec":
    from fadrm_ray.run.job import ExecutionSpec

    return ExecutionSpec(local=args.local, address=args.address, workers=args.workers,
                         cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker,
                         device=args.device, threads=args.threads, data_root=getattr(args, "data_root", None),
                         progress=not args.quiet)


def _needs_ray(ray_distill: "RayDistill | None") -> "RayDistill":
    if ray_distill is None:
        raise CLIError("the Ray executor is not available in this entry point; pass --local "
                       "or use the `fadrm` console script")
    return ray_distill


# Bad input, in one line. Every error class of the library for it (ConfigError, DatasetError,
# EvaluationError, ModelError, StoreError, ...) is an `InputError`, whose module imports nothing,
# so a refused command stays fast. Any other exception, a plain ValueError too, is a fault of the
# program: status 1, with its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (CLIError, FileNotFoundError, InputError)


def _parse_classes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    items = [c.strip() for c in text.split(",")]
    if not all(c.isdigit() for c in items):
        raise CLIError(f"--classes must be comma-separated class indices like 0,3,7, got {text!r}")
    classes = [int(c) for c in items]
    repeated = sorted({c for c in classes if classes.count(c) > 1})
    if repeated:
        raise CLIError(f"--classes names class {repeated[0]} more than once: {text!r}")
    return classes


def _check_teachers(paths: Sequence[str]) -> None:
    for path in paths:
        if Path(path).is_dir():
            raise CLIError(f"teacher checkpoint {path} is a directory, not a checkpoint file")
        if not Path(path).is_file():
            raise CLIError(f"teacher checkpoint {path} does not exist")


def _warn_incomplete(args, reader_complete: bool) -> None:
    if not reader_complete:
        print(f"fadrm {args.command}: warning: {args.run} is incomplete (the run was not finished); "
              f"using the units written so far", file=sys.stderr)


def _note(line: str) -> None:
    """One line on stderr the user should read before trusting a figure (a split made here)."""
    print(f"fadrm: note: {line}", file=sys.stderr)


def _emit(args, payload: dict, human: str) -> None:
    if args.json:
        print(json.dumps(payload, default=str))
    else:
        print(human)


# --------------------------------------------------------------------------- subcommands
def cmd_squeeze(args) -> None:
    from fadrm_ray.config import parse_overrides
    from fadrm_ray.data import get_dataset
    from fadrm_ray.runtime import process_info
    from fadrm_ray.settings import SqueezeConfig, layered
    from fadrm_ray.squeeze import squeeze

    from fadrm_ray.squeeze import check_out_dir

    check_out_dir(args.out)
    cfg = layered(SqueezeConfig, parse_overrides(args.set or [], SqueezeConfig),
                  flags={"model": args.model, "epochs": args.epochs, "seed": args.seed})
    dataset = get_dataset(args.dataset, root=args.data_root)
    if dataset.split_note is not None:
        _note(dataset.split_note)
    result = squeeze(dataset, cfg, out_dir=args.out, num_threads=args.threads, progress=not args.quiet)
    payload = {"teacher": str(result.path), "model": cfg.model, "dataset": dataset.name,
               "test_accuracy": result.test_accuracy, "train_seconds": result.train_seconds,
               "epochs": result.epochs, "config": cfg.model_dump(mode="json"), "process": process_info()}
    _emit(args, payload, f"teacher {cfg.model} on {dataset.name}: test top-1 {result.test_accuracy:.2f}% "
                         f"after {result.epochs} epochs ({result.train_seconds:.1f} s)\nwritten to {result.path}")


def build_config(args) -> "DistillConfig":
    """The run's config in one pass: preset -> --config -> --set -> --ipc/--classes/--seed."""
    from fadrm_ray.config import make_config

    return make_config(args.preset, args.config, args.set or [], ipc=args.ipc, classes=_parse_classes(args.classes),
                       seed=args.seed)


def cmd_distill(args, ray_distill: "RayDistill | None" = None) -> None:
    from fadrm_ray.data import get_dataset
    from fadrm_ray.fileio import check_output_dir
    from fadrm_ray.run.job import prepare_job

    _check_teachers(args.teacher)
    check_output_dir(args.out, "--out store")
    cfg = build_config(args)
    spec = execution_spec(args)
    ray = None if spec.local else _needs_ray(ray_distill)
    # Everything the input decides is checked here, in this process, before any cluster starts:
    # the dataset, the classes and every setting against it, the teachers against the dataset.
    dataset = get_dataset(args.dataset, root=spec.data_root)
    if dataset.split_note is not None:
        _note(dataset.split_note)
    if spec.threads:
        import torch
        torch.set_num_threads(spec.threads)
    # The settings against the data first (classes, sizes), so that no pilot runs for a refused run.
    cfg.resolve(dataset.image_size, dataset.num_classes, dataset.hflip, channels=dataset.channels)
    pilot = _pilot(args, cfg, dataset, spec)
    if ray is None:  # the job is built, and checked, once, then run here
        from fadrm_ray.run.execute import LocalExecutor, run_job
        executor = LocalExecutor(spec.device, spec.progress)
        job, parts = prepare_job(cfg, dataset, args.dataset, args.teacher, args.out, executor.device,
                                 data_root=spec.data_root)
        result = run_job(job, executor, parts)
    else:  # checked here; the Ray door builds the job again for its workers' device type
        prepare_job(cfg, dataset, args.dataset, args.teacher, args.out, device="cpu", data_root=spec.data_root)
        result = ray(cfg, args.dataset, args.teacher, args.out, spec, dataset=dataset)
    from fadrm_ray.runtime import process_info

    from fadrm_ray.config import RECIPE_FIELDS

    recipe = result.recipe or "not recorded"
    taken = [name for name in RECIPE_FIELDS if getattr(cfg, name) == "auto"]
    recipe += f"; it gave {', '.join(taken)}" if taken else "; every value it sets was given explicitly"
    payload = {**result.to_dict(), "recipe": recipe, "process": process_info()}
    lines = [f"distilled {result.images} images ({len(result.units_run)} units run, "
             f"{len(result.units_skipped)} already done) in {result.seconds:.1f} s", f"recipe: {recipe}"]
    if pilot is not None:
        payload["pilot"] = {"summary": pilot.summary(), "below_random": pilot.below_random,
                            "record": pilot.model_dump(mode="json")}
        lines.append(pilot.summary())
        if pilot.below_random is not None:
            lines.append(f"warning: {pilot.below_random}")
    lines.append(f"run: {result.run_dir} (read it at this IPC with --ipc {result.ipc})")
    _emit(args, payload, "\n".join(lines))


def _pilot(args, cfg: "DistillConfig", dataset, spec: "ExecutionSpec"):
    """The pilot of this run (fadrm_ray/pilot.py), measured or read back, when its recipe is
    left to `auto` on colour data no one measured; None otherwise."""
    from fadrm_ray.config import parse_overrides
    from fadrm_ray.pilot import ensure_pilot
    from fadrm_ray.settings import PilotConfig, layered

    settings = layered(PilotConfig, parse_overrides(args.pilot_set or [], PilotConfig))
    return ensure_pilot(cfg, dataset, args.teacher, args.out, settings, device=spec.device if spec.local else None,
                        on_line=_note)


def run_recipe(reader) -> str:
    """The recipe a run's "auto" values came from, with why (`config.recipe_reason`), from its
    saved config and the image size and channels its provenance records."""
    from fadrm_ray.config import recipe_reason

    data = reader.provenance.get("dataset") or {}
    size, channels = data.get("image_size"), data.get("channels")
    known = isinstance(size, int) and isinstance(channels, int)
    return recipe_reason(str(reader.config.get("recipe", "")), size if known else None, channels if known else 1,
                         piloted=reader.provenance.get("pilot") is not None)


def run_pilot(reader) -> "PilotRecord | None":
    """The pilot whose choice the run's recipe is, as its provenance records it; None when none was."""
    from fadrm_ray.pilot_record import PilotRecord

    recorded = reader.provenance.get("pilot")
    return None if recorded is None else PilotRecord.model_validate(recorded)


def cmd_export(args) -> None:
    from fadrm_ray.fileio import check_new_output
    from fadrm_ray.store import export_imagefolder, export_parquet, export_tensors, open_run

    classes = _parse_classes(args.classes)
    check_new_output(args.out, "--out", empty_dir_ok=args.format == "imagefolder")
    if (args.topk is not None or args.label_epochs is not None) and not args.soft_labels:
        raise CLIError("--topk and --label-epochs shape the stored soft labels: add --soft-labels")
    for flag, value in (("--topk", args.topk), ("--label-epochs", args.label_epochs)):
        if value is not None and value < 1:
            raise CLIError(f"{flag} must be at least 1, got {value}")
    complete = open_run(args.run, incomplete=args.incomplete).complete
    _warn_incomplete(args, complete)
    payload = {"run": args.run, "format": args.format, "out": args.out, "complete": complete}
    if args.with_teacher or args.soft_labels:  # what the report's top-1 needs, with the images
        from fadrm_ray.settings import LabelStorage
        from fadrm_ray.store.product import Shipped, export_with_product

        storage = LabelStorage(topk=args.topk, epochs=args.label_epochs) if args.soft_labels else None
        count, product, files = export_with_product(args.run, args.out, args.format, classes,
                                                    incomplete=args.incomplete, ipc=args.ipc,
                                                    shipped=Shipped(teachers=args.with_teacher, soft_labels=storage),
                                                    progress=not args.quiet)
        teachers = [str(p) for p in files[:len(product.teachers)]]
        payload.update(images=count, teachers=teachers, recipe=str(files[-1]), recipe_from=product.recipe_from)
        shipped = [f"the teacher(s) {', '.join(teachers)}"] if teachers else []
        if product.soft_labels is not None:
            labels = str(files[len(product.teachers)])
            payload.update(soft_labels=labels, soft_label_bytes_per_image=round(product.soft_label_bytes_per_image, 1),
                           soft_label_topk=product.recipe.soft_label_topk,
                           soft_label_epochs=product.recipe.soft_label_epochs or product.recipe.epochs)
            shipped.append(f"the stored soft labels {labels} ({product.soft_label_bytes_per_image:,.0f} bytes per "
                           f"image and seed, top-{product.recipe.soft_label_topk or 'all'} logits, "
                           f"{product.recipe.soft_label_epochs or product.recipe.epochs} epochs)")
        _emit(args, payload,
              f"exported {count} images as {args.format} to {args.out}, with {' and '.join(shipped)} and the student "
              f"recipe {files[-1]} (from {product.recipe_from}): the reported top-1 trains students with the "
              "teachers' soft labels")
        return
    if args.format == "imagefolder":
        count = export_imagefolder(args.run, args.out, classes=classes, incomplete=args.incomplete, ipc=args.ipc)
    elif args.format == "parquet":
        count = export_parquet(args.run, args.out, classes=classes, incomplete=args.incomplete, ipc=args.ipc)
    else:
        count = export_tensors(args.run, args.out, classes=classes, incomplete=args.incomplete, ipc=args.ipc)
    _emit(args, {**payload, "images": count}, f"exported {count} images as {args.format} to {args.out}")


def cmd_evaluate(args) -> None:
    from fadrm_ray.baselines import BASELINES, evaluate_with_baselines, gain_text
    from fadrm_ray.config import parse_overrides
    from fadrm_ray.eval_job import EvalJob
    from fadrm_ray.evaluate import evaluate_run
    from fadrm_ray.report import write_report
    from fadrm_ray.data.base import OWN_SPLIT
    from fadrm_ray.runtime import process_info, resolve_device
    from fadrm_ray.settings import EvalConfig, layered

    from fadrm_ray.fileio import check_output_dir
    from fadrm_ray.layout import RunLayout
    from fadrm_ray.store import open_run

    cfg = layered(EvalConfig, parse_overrides(args.set or [], EvalConfig),
                  flags={"student": args.student, "epochs": args.epochs, "seeds": args.seeds,
                         "soft_labels": args.soft_labels, "protocol": args.protocol})
    reader = open_run(args.run, incomplete=args.incomplete, ipc=args.ipc)
    check_output_dir(RunLayout(args.run).report_dir, "the run's report folder")
    _warn_incomplete(args, reader.complete)
    _check_teachers(args.teacher or [])
    reader.verify()  # before a dataset is loaded or a teacher read
    # The run's own data and teachers: where it records them, or where --dataset/--teacher say
    # they are now (checked by fingerprint and sha256 either way).
    job = EvalJob(config=cfg, device=resolve_device(args.device), threads=args.threads, progress=not args.quiet,
                  incomplete=args.incomplete, ipc=args.ipc, dataset=args.dataset, teacher_copies=args.teacher)
    from fadrm_ray.eval_job import EvalParts

    parts = EvalParts(on_note=lambda line: print(f"fadrm evaluate: {line}", file=sys.stderr, flush=True))
    if args.baselines:
        result = evaluate_with_baselines(args.run, job, parts, ranking=args.ranking, ars=args.ars)
    else:
        result = evaluate_run(args.run, job, parts)
    report = write_report(args.run, evaluation=result, incomplete=args.incomplete)
    made = (reader.provenance.get("dataset") or {}).get("test_split")
    if made and made != OWN_SPLIT:
        _note(f"the run's dataset has no test split of its own: its test images were {made}")
    per_seed = ", ".join(f"{v:.2f}" for v in result.top1_per_seed)
    tested = "" if result.classes is None else f", tested on its {len(result.classes)} classes ({result.test_size} images)"
    lines = [f"student {result.student} on {args.run}: top-1 {result.top1_mean:.2f} "
             f"± {result.top1_std:.2f}% over {len(result.top1_per_seed)} seeds ({per_seed}){tested}"]
    for name, base in result.baselines.items():
        if base.error is not None:
            lines.append(f"  {BASELINES[name]}: not available ({base.error})")
        else:
            lines.append(f"  {BASELINES[name]}: {base.top1_mean:.2f} ± {base.top1_std:.2f}% "
                         f"(gain {gain_text(result.paired_gains[name])})")
    if result.ranking is not None:
        from fadrm_ray.ranking import hard_label_line, ranking_text

        lines.append(f"  DD-Ranking: {ranking_text(result.ranking)}")
        lines.extend(f"    not measured: {why}" for why in result.ranking.missing)
        hard = hard_label_line(result.ranking, result.top1_mean)
        if hard is not None:
            lines.append(f"  {hard}")
    lines.extend(f"  warning: {line}" for line in result.warnings)
    lines.append(f"report: {report.get('evaluation_plot', report.get('grid', ''))}")
    result = {**result.model_dump(mode="json"), "report": report, "process": process_info()}
    _emit(args, result, "\n".join(lines))


def cmd_info(args) -> None:
    """Describe the run, checked against its manifests; a run still being written (or left
    unfinished) is described too, marked `complete: False`, with the process writing it."""
    from fadrm_ray.report import report_files, stale_reports
    from fadrm_ray.store import open_run

    reader = open_run(args.run, incomplete=True, ipc=args.ipc)
    info = reader.info()
    data = reader.provenance.get("dataset") or {}
    # The spec `fadrm evaluate` and `fadrm verify --repair` reopen it by (older runs record a name only).
    info["dataset"] = {"spec": data.get("spec") or data.get("name"), "fingerprint": data.get("fingerprint")}
    info["recipe"] = run_recipe(reader)
    pilot = run_pilot(reader)
    if pilot is not None:
        info["pilot"] = pilot.summary()
        if pilot.below_random is not None:
            info["pilot_warning"] = pilot.below_random
    if reader.config.get("committee") == "prior":  # CV-DD: each teacher's say in every step
        from fadrm_ray.committee import committee_weights
        priors = [t.get("test_accuracy") for t in info["teachers"]]
        with contextlib.suppress(ValueError):
            info["committee_votes"] = [round(w, 4) for w in
                                       committee_weights(priors, reader.config.get("committee_temperature", 5.0)).tolist()]
    info["report"] = report_files(args.run)
    info["report_stale"] = stale_reports(args.run)
    if args.json:
        print(json.dumps(info, default=str))
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
            value = value if len(value) < 200 else value[:197] + "..."
        print(f"{key:<{width}}  {value}")


def cmd_verify(args) -> None:
    """Check every file of a run; with --repair, recompute the units that fail. Exits 1 while
    any unit fails."""
    from fadrm_ray.report import stale_reports
    from fadrm_ray.store.verify import describe_check, verify_run

    if args.repair:
        from fadrm_ray.fileio import check_output_dir
        from fadrm_ray.repair import repair_run
        from fadrm_ray.runtime import torch_threads

        check_output_dir(args.run, "--run")
        _check_teachers(args.teacher or [])
        with torch_threads(args.threads):
            outcome = repair_run(args.run, dataset=args.dataset, teacher_copies=args.teacher, device=args.device,
                                 progress=not args.quiet)
        check, repaired = outcome["after"], outcome["repaired"]
    else:
        check, repaired = verify_run(args.run), None
    check["report_stale"] = stale_reports(args.run)
    ok = not check["bad_units"]
    lines = describe_check(check, repaired)
    _emit(args, {**check, "repaired": repaired, "ok": ok}, "\n".join(lines))
    if not ok:
        raise SystemExit(EXIT_FAILED)


def cmd_demo(args, ray_distill: "RayDistill | None" = None) -> None:
    """The main job on the embedded default: train a teacher on a real offline dataset, distill, export."""
    from fadrm_ray.pipeline import run_demo

    from fadrm_ray.fileio import check_output_dir

    check_output_dir(args.out, "--out")
    spec = execution_spec(args)
    ray = None if spec.local else _needs_ray(ray_distill)

    def on_ray(cfg, dataset_spec, teacher_paths, out_root):
        return ray(cfg, dataset_spec, teacher_paths, out_root, spec)

    summary = run_demo(out=args.out, dataset_name=args.dataset, ipc=args.ipc, iterations=args.iterations,
                       epochs=args.epochs, progress=spec.progress, distill_fn=None if ray is None else on_ray)
    lines = [f"{k}: {v}" for k, v in summary.items() if not isinstance(v, dict)]
    _emit(args, summary, "\n".join(lines))


def _floats(text: str | None, flag: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise CLIError(f"{flag} takes comma-separated numbers like 0.485,0.456,0.406, got {text!r}") from None


def _model_args(items: Sequence[str]) -> dict:
    """`key=value` keywords of a model builder, values read as YAML (32, [1, 2], true)."""
    import yaml

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise CLIError(f"--model-arg {item!r} must look like key=value, e.g. width=32")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise CLIError(f"--model-arg {item!r}: cannot read the value {raw!r}") from None
    return out


def cmd_import_teacher(args) -> None:
    """Wrap a classifier's weights trained elsewhere into a teacher checkpoint for a dataset."""
    from fadrm_ray.teacher_import import ImportSettings, import_teacher

    settings = ImportSettings(model=args.model, weights=args.weights, dataset=args.dataset, out=args.out,
                              eval_images=args.eval_images, mean=_floats(args.mean, "--mean"),
                              std=_floats(args.std, "--std"), model_kwargs=_model_args(args.model_arg or []),
                              accept_chance=args.accept_chance, device=args.device, data_root=args.data_root)
    result = import_teacher(settings)
    if result.split_note is not None:
        _note(result.split_note)
    record = result.record
    trained = "" if record.trained_size is None else f"; the weights were trained at {record.trained_size} px"
    warn = ""
    if record.trained_size is not None and record.trained_size != result.image_size:
        warn = f"\nwarning: the dataset is {result.image_size} px, the weights were trained at {record.trained_size} px"
    names = "" if record.display_names is None else f"; class names: {', '.join(record.display_names[:3])}, ..."
    measured = "".join(f"\n  {c.name}: mean {list(c.mean)} std {list(c.std)}: test top-1 {c.top1:.2f}%"
                       for c in record.measured)
    warn += "".join(f"\nwarning: {line}" for line in result.warnings)
    _emit(args, result.model_dump(mode="json"),
          f"teacher {result.model} on {result.dataset}: test top-1 {result.top1:.2f}% on {record.eval_images} images "
          f"(chance {result.chance:.2f}%)\n"
          f"weights: {record.source}\n"
          f"normalization: mean {list(result.mean)} std {list(result.std)}, from {record.normalization}{measured}\n"
          f"input: {result.image_size} px (the dataset's){trained}{names}{warn}\n"
          f"written to {result.path}")


def cmd_train_student(args) -> None:
    """Students trained from downloaded files alone: the images, the teacher(s), the recipe."""
    import math

    from fadrm_ray.runtime import process_info, resolve_device
    from fadrm_ray.eval_job import EvalJob
    from fadrm_ray.student import read_recipe, train_from_files

    _check_teachers(args.teacher or [])
    if args.soft_labels is not None and not Path(args.soft_labels).is_file():
        raise CLIError(f"soft-label file {args.soft_labels} does not exist")
    recipe = read_recipe(args.recipe)
    if args.seed is not None and args.seeds is not None:
        raise CLIError("--seed trains one student with that seed, --seeds N the recipe's first N: give one of them")
    if args.seeds is not None and args.seeds < 1:
        raise CLIError(f"--seeds must be at least 1, got {args.seeds}")
    # One student unless more are asked for: the recipe's seeds first (those its report averaged),
    # then the next integers.
    if args.seed is not None:
        seeds = [args.seed]
    else:
        more = itertools.count(max(recipe.seed_list) + 1)
        seeds = list(itertools.islice(itertools.chain(recipe.seed_list, more), args.seeds or 1))
    recipe = recipe.model_copy(update={"seeds": seeds})
    job = EvalJob(config=recipe, teachers=args.teacher or [], dataset=args.test, device=resolve_device(args.device),
                  threads=args.threads, progress=not args.quiet)
    result = train_from_files(args.data, job, soft_labels=args.soft_labels, data_root=args.data_root)
    tested = not math.isnan(result.top1_mean)
    payload = {"top1": result.top1_mean if tested else None, "top1_per_seed": result.top1_per_seed if tested else None,
               "seeds": result.seeds, "images": result.images, "classes": result.classes,
               "test_size": result.test_size if tested else 0, "evaluation": result.model_dump(mode="json"),
               "process": process_info()}
    per_seed = ", ".join(f"{v:.2f}" for v in result.top1_per_seed)
    where = "" if result.classes is None else f" of its {len(result.classes)} classes"
    human = (f"student {result.student} on {result.images} images, {result.epochs} epochs, seeds {result.seeds}: "
             + (f"test top-1 {result.top1_mean:.2f}% ({per_seed}) on {result.test_size} test images{where}"
                if tested else "trained (no --test dataset, so no test top-1)"))
    _emit(args, payload, human)


# --------------------------------------------------------------------------- parser
STUDENT_DEVICE_HELP = ("where the students train and the teachers label: cpu, cuda or cuda:N (default: cuda when "
                       "torch sees a GPU); on CUDA in mixed precision, channels-last")


def build_parser(ray_distill: "RayDistill | None" = None,
                 commands: Sequence[Command] = ()) -> argparse.ArgumentParser:
    from fadrm_ray.config import PRESETS

    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    common.add_argument("--quiet", action="store_true", help="no progress bars")

    execution = _Parser(add_help=False)
    execution.add_argument("--local", action="store_true", help="run in this process, without Ray")
    execution.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    execution.add_argument("--threads", type=int, default=None, help="torch threads per process")
    execution.add_argument("--address", default=None, help="Ray cluster address (default: an embedded local Ray)")
    execution.add_argument("--workers", type=int, default=None,
                           help="distill actors (default: one per GPU, else one per --cpus-per-worker CPUs)")
    execution.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs each distill actor holds")
    execution.add_argument("--gpus-per-worker", type=float, default=None, help="GPU share per actor (fractions allowed)")

    parser = _Parser(prog="fadrm", description="FADRM dataset distillation.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ipc_help = "read the run at this IPC: IPC indices 0..N-1 of every class (default: every image it holds)"

    p = sub.add_parser("squeeze", parents=[common], help="train a teacher on a dataset")
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--model", default=None,
                   help="convnet-bn (the default), resnet18-cifar, or a timm/torchvision name")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default 15)")
    p.add_argument("--seed", type=int, default=None, help="(default 0)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one SqueezeConfig value, e.g. model_kwargs={width: 64} (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--data-root", default=None, help="where downloadable datasets live")
    p.add_argument("--out", required=True, help="directory for teacher.pt")
    p.set_defaults(func=cmd_squeeze)

    p = sub.add_parser("import-teacher", parents=[common],
                       help="make a teacher checkpoint from a classifier's weights (torchvision, timm, a state dict)")
    p.add_argument("--model", required=True,
                   help="torchvision:NAME, timm:NAME, convnet-bn or resnet18-cifar (the architecture of the weights)")
    p.add_argument("--weights", required=True,
                   help="a weights file (.pth, .bin, .safetensors), a torchvision weights name such as IMAGENET1K_V1 "
                        "(torch hub's cache), or `pretrained` for timm's Hugging Face cache")
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--out", required=True, help="the teacher checkpoint to write (a new file, e.g. r18.pt)")
    p.add_argument("--eval-images", type=int, default=None,
                   help="measure top-1 on this many test images spread over the classes (default: all of them)")
    p.add_argument("--mean", default=None, help="normalization mean per channel, e.g. 0.485,0.456,0.406 "
                                                "(default: the weights' metadata, else measured: ImageNet's or "
                                                "the dataset's, whichever scores better)")
    p.add_argument("--std", default=None, help="normalization std per channel (with --mean)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="a keyword of the model's builder, e.g. width=32 for convnet-bn (repeatable)")
    p.add_argument("--accept-chance", action="store_true",
                   help="write the teacher even when its top-1 is no better than chance")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--data-root", default=None, help="where downloadable datasets live")
    p.set_defaults(func=cmd_import_teacher)

    p = sub.add_parser("train-student", parents=[common],
                       help="train a student from a downloaded distilled set, its teacher and its recipe")
    p.add_argument("--data", required=True, help="the distilled Parquet file (a job's dataset download)")
    p.add_argument("--teacher", action="append", default=None,
                   help="the teacher checkpoint that gives the soft labels (repeat for a committee)")
    p.add_argument("--soft-labels", default=None,
                   help="stored soft labels instead of a teacher (`fadrm export --soft-labels`, GET .../soft-labels)")
    p.add_argument("--recipe", default=None, help="the student recipe, an EvalConfig as JSON (default: the defaults)")
    p.add_argument("--test", default=None, help=f"score on this dataset's test images of the file's classes: {DATASET_HELP}")
    p.add_argument("--seed", type=int, default=None, help="train one student with this seed")
    p.add_argument("--seeds", type=int, default=None,
                   help="train N students, the recipe's first N seeds (default 1: the recipe's first seed; the "
                        "report's figure is the mean over the recipe's seeds)")
    p.add_argument("--device", default=None, help=STUDENT_DEVICE_HELP)
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--data-root", default=None, help="where downloadable datasets live")
    p.set_defaults(func=cmd_train_student)

    p = sub.add_parser("distill", parents=[common, execution], help="distill a dataset into a store run")
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--teacher", action="append", required=True, help="teacher checkpoint (repeat for fadrm+)")
    p.add_argument("--preset", default="fadrm", choices=list(PRESETS), metavar="PRESET",
                   help=f"the method, one of {', '.join(PRESETS)} (docs/method.md section 7)")
    p.add_argument("--ipc", type=int, default=None, help="images per class (default 10)")
    p.add_argument("--classes", default=None, help="comma-separated class indices, e.g. 0,3,7 (default: all)")
    p.add_argument("--seed", type=int, default=None, help="the run's seed: the same seed, settings and data give "
                                                               "the same images (default 0)")
    p.add_argument("--config", default=None, help="YAML file of config values")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one DistillConfig value, e.g. alpha=0.6 (repeatable); every key is listed in "
                        "docs/architecture.md#configuration, and a wrong key's error lists them all")
    p.add_argument("--pilot-set", action="append", metavar="KEY=VALUE",
                   help="one setting of the pilot that picks `auto`'s recipe on colour data no one measured, "
                        "e.g. seeds=5 (repeatable; settings.PilotConfig, docs/method.md section 7b)")
    p.add_argument("--out", required=True, help="store root; the run goes to OUT/<run_id>")
    p.add_argument("--data-root", default=None, help="where downloadable datasets (cifar10, cifar100) live")
    p.set_defaults(func=functools.partial(cmd_distill, ray_distill=ray_distill))

    p = sub.add_parser("export", parents=[common], help="export a run as an ImageFolder, a Parquet or a tensor file")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--format", choices=["imagefolder", "parquet", "pt"], default="imagefolder",
                   help="parquet: one file, as the REST service serves it and `fadrm train-student --data` reads it")
    p.add_argument("--classes", default=None)
    p.add_argument("--ipc", type=int, default=None, help=ipc_help)
    p.add_argument("--out", required=True, help="a new path (an empty folder for imagefolder); never replaced")
    p.add_argument("--incomplete", action="store_true", help="allow a run that was not finished")
    p.add_argument("--with-teacher", action="store_true",
                   help="also write the run's teacher checkpoint(s) and the student recipe (recipe.json) its "
                        "reported top-1 needs: inside the folder, or beside the file")
    p.add_argument("--soft-labels", action="store_true",
                   help="also write the soft labels of the recipe's students, stored (soft-labels.parquet), for "
                        "`fadrm train-student --soft-labels` without the teacher")
    p.add_argument("--topk", type=int, default=None,
                   help="keep the K largest logits of each view (default: all)")
    p.add_argument("--label-epochs", type=int, default=None,
                   help="keep the labels of this many epochs, read in turn (default: every epoch of the recipe)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("evaluate", parents=[common], help="train students on a run's images, report test top-1")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--ipc", type=int, default=None, help=ipc_help)
    p.add_argument("--student", default=None, help="student model name (default convnet-bn)")
    p.add_argument("--epochs", type=int, default=None, help="student epochs (default: by the protocol)")
    p.add_argument("--seeds", type=int, default=None, help="students trained, seeds 0..N-1 (default 3)")
    p.add_argument("--soft-labels", default=None, choices=["online", "stored"],
                   help="teacher soft labels computed on the fly (the default), or precomputed into the run")
    p.add_argument("--protocol", default=None, choices=["short", "published"],
                   help="student schedule: short (about 600 steps, the default) or published (300 epochs, "
                        "1000 at IPC 1, stretched cosine)")
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="skip the baselines (random real images, the run's starting patches) and DD-Ranking's scores")
    p.add_argument("--no-ranking", dest="ranking", action="store_false",
                   help="skip DD-Ranking's HLR and LRS (hard-label students on the run and, once per dataset, "
                        "on its whole training split)")
    p.add_argument("--ars", action="store_true",
                   help="add DD-Ranking's ARS: the run and random real images evaluated again without augmentation")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one EvalConfig value, e.g. cosine_stretch=2 (repeatable)")
    p.add_argument("--dataset", default=None,
                   help="where the run's data is now, if not where the run records it (checked by fingerprint)")
    p.add_argument("--teacher", action="append", default=None,
                   help="where one of the run's teachers is now, if not where the run records it (checked by "
                        "sha256; repeatable)")
    p.add_argument("--device", default=None, help=STUDENT_DEVICE_HELP)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--incomplete", action="store_true", help="allow a run that was not finished")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("info", parents=[common], help="describe a run: config, classes, rows, timings")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--ipc", type=int, default=None, help=ipc_help)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("verify", parents=[common], help="check every file of a run; --repair recomputes what fails")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--repair", action="store_true", help="recompute the units that fail, and finish the run")
    p.add_argument("--teacher", action="append", default=None,
                   help="where one of the run's teachers is now, if not where the run records it, for --repair "
                        "(checked by sha256; repeatable)")
    p.add_argument("--dataset", default=None,
                   help="where the run's data is now, if not where the run records it, for --repair (checked by "
                        "fingerprint)")
    p.add_argument("--device", default=None, help="cpu or cuda, for --repair")
    p.add_argument("--threads", type=int, default=None, help="torch threads, for --repair")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("demo", parents=[common, execution], help="the whole pipeline on an offline dataset (main job)")
    p.add_argument("--out", default="fadrm-demo", help="output directory")
    p.add_argument("--dataset", default="digits", help="digits or mnist-sample")
    p.add_argument("--ipc", type=int, default=10)
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.set_defaults(func=functools.partial(cmd_demo, ray_distill=ray_distill))

    for command in commands:
        p = sub.add_parser(command.name, parents=[common], help=command.help)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None, *, ray_distill: "RayDistill | None" = None,
         commands: Sequence[Command] = ()) -> int:
    """Run one `fadrm` subcommand; `ray_distill` runs distillations without --local, and
    `commands` are the subcommands of the layers above."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights never come from a hub here
    parser = build_parser(ray_distill, commands)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's one-line error (_Parser)
        return int(exc.code or 0)
    try:
        # --threads is the torch thread count of the whole command (every phase it runs).
        heavy = args.command in HEAVY_COMMANDS or any(c.heavy and c.name == args.command for c in commands)
        with torch_threads(getattr(args, "threads", None) if heavy else None):
            args.func(args)
    except USER_ERRORS as exc:
        if os.environ.get("FADRM_DEBUG"):
            raise
        print(f"fadrm {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # the storage failed during the work: full, read-only, gone
        if os.environ.get("FADRM_DEBUG"):
            raise
        print(f"fadrm {args.command}: error: {_one_line(exc)}", file=sys.stderr)
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


if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in HEAVY_COMMANDS:
        ensure_process_env()  # before torch loads (may re-execute this command once)
    sys.exit(main())
