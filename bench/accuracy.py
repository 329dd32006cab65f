"""Accuracy of every method under one evaluation protocol, on the offline datasets.

    python -m bench.accuracy [--quick] [--out DIR] [--json]

For each dataset (digits and mnist-sample; --quick: digits only) and IPC in {1, 10}, every method
of docs/method.md sections 7 and 7c (random-real, rded, sre2l, sre2l++, fadrm, fadrm+, fadrm-paper,
g-vbsm, edc, cv-dd) produces its images through the library's door (`fadrm_ray.runs.execute.run`)
into one store, and every run is evaluated by `evaluate_store_run` with the same student, protocol
and seeds (docs/method.md section 6). Teachers are trained once with
`squeeze` (`ensure_teacher`) and cached in the output folder, retrained when their squeeze
settings change:

- t1: convnet-bn, width 64, depth 3 (the teacher of every single-teacher method and the student
  architecture);
- t2: convnet-bn, width 96, depth 3; t3: convnet-bn, width 32, depth 4. FADRM+ recovers with
  t1, t2, t3 in round robin and relabels with their averaged logits (section 5). Small ConvNets
  stand in for the paper's ResNet-18 / DenseNet / ShuffleNet / MobileNet pool, which is too slow
  on a 2-core CPU. G-VBSM, EDC and CV-DD use the same three teachers (SEVERAL_TEACHERS), and
  CV-DD's students are relabelled with batch statistics (METHOD_EVALUATION). Optional control
  rows (--control): "fadrm+ (t1 labels)" evaluates the FADRM+ images with t1's labels only, to
  separate better images from better soft labels, and, where the grid has several teachers,
  "random-real (t1-t3 labels)" evaluates the random real images with the three teachers'
  averaged labels, the baseline of every row that relabels with them.

Budgets keep the published ratios (docs/method.md section 7: FADRM 2000, SRe2L++, G-VBSM and
CV-DD 4000, SRe2L and EDC 1000), scaled down to T for FADRM/FADRM+, 2T for SRe2L++, G-VBSM and
CV-DD and T/2 for SRe2L and EDC.
Distillation uses seed 0; the --seeds seeds (3 by default) are the students' (initial weights and
augmentation stream).

Cells run in parallel, `--jobs` processes of `--threads` torch threads each (default: one
single-threaded process per CPU); every cell is deterministic, so the table does not depend on
the job count. `--set KEY=VALUE` overrides the recover config of every distilled method (for
example `--set crop_scale_min=0.5 --set lr=0.05` for the small-image settings examined in
docs/benchmarks/accuracy.md); such runs get their own run ids and cache entries.

`--datasets` also takes any dataset spec: `fashion-mnist` (the full 60,000/10,000 images, from
the Debian package dataset-fashion-mnist or FADRM_DATA/fashion-mnist), or the `parquet:PATH` of
a Fashion-MNIST sample that `python -m fadrm_ray.data.fashion_sample` writes (grey clothing
photos: harder than the digits); datasets without BUDGETS of their own take mnist-sample's
budgets and teacher epochs (`--teacher-epochs` overrides). The Fashion-MNIST grid of
docs/benchmarks/accuracy.md is

    python -m bench.accuracy --datasets fashion-mnist --ipc 1,10,50 --protocol published --seeds 5 \
        --methods random-real,patches,rded,sre2l++,fadrm,fadrm+,fadrm-paper

Writes DIR/accuracy.json, DIR/accuracy.md and DIR/accuracy.png; prints the Markdown table and,
below it, fadrm minus every other row seed by seed and every row minus random real images seed
by seed, with each seed's top-1 (or, with --json, one JSON object). Teachers,
distilled runs (the store) and evaluations (inside each run, student by student) are cached, so a
rerun only computes what changed, and a rerun with more --seeds trains only the new students.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from fadrm_ray.evaluation.baselines import baseline_configs, gain_text, paired_gain
from fadrm_ray.config import ConfigError, DistillConfig, make_config, parse_overrides
from fadrm_ray.data import get_dataset
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.evaluation.training import epochs_for_steps
from fadrm_ray.evaluation.report import pyplot, save_figure
from fadrm_ray.config import EvalConfig, SqueezeConfig
from fadrm_ray.squeeze import ensure_teacher

# Rows of the table. "patches" is the fadrm row's own starting patches (its config at zero
# recover iterations, baselines.py); "fadrm-paper" is fadrm at the published settings.
METHODS = ["random-real", "patches", "rded", "sre2l", "sre2l++", "fadrm", "fadrm+", "fadrm-paper",
           "g-vbsm", "edc", "cv-dd"]
CONTROL = "fadrm+ (t1 labels)"
RANDOM_CONTROL = "random-real (t1-t3 labels)"
# The control row of a cell's method, and the teachers it is relabelled with.
CONTROLS = {"fadrm+": (CONTROL, ("t1",)), "random-real": (RANDOM_CONTROL, ("t1", "t2", "t3"))}
# Presets that recover (and relabel) with every teacher, t1-t3; the others use t1 alone.
SEVERAL_TEACHERS = ("fadrm+", "g-vbsm", "edc", "cv-dd")
# Evaluation settings that are part of a method: CV-DD relabels with the teachers' BatchNorm
# layers on the student batch's own statistics (docs/method.md section 7c).
METHOD_EVALUATION = {"cv-dd": {"teacher_bn": "batch"}}
TEACHERS = {  # name -> (model, kwargs)
    "t1": ("convnet-bn", {"width": 64, "depth": 3}),
    # Not depth 2: two blocks see too little of a 28-px digit before global pooling (59 % on
    # mnist-sample), and averaging such a teacher into FADRM+'s labels only measures its weakness.
    "t2": ("convnet-bn", {"width": 96, "depth": 3}),
    "t3": ("convnet-bn", {"width": 32, "depth": 4}),
}
# Budget T of fadrm per dataset; sre2l++ gets 2T and sre2l T/2 (the published ratios).
# fashion-mnist is 28 px like mnist-sample and takes its budget; its teachers see twelve times
# the training images per epoch, so fewer epochs give them more steps.
BUDGETS = {"full": {"digits": 1000, "mnist-sample": 500, "fashion-mnist": 500},
           "quick": {"digits": 200, "mnist-sample": 100, "fashion-mnist": 100}}
TEACHER_EPOCHS = {"full": {"digits": 15, "mnist-sample": 8, "fashion-mnist": 4},
                  "quick": {"digits": 10, "mnist-sample": 3, "fashion-mnist": 1}}


def per_dataset(table: dict, mode: str, dataset: str) -> int:
    """A BUDGETS or TEACHER_EPOCHS entry; any other dataset (a `parquet:PATH` such as
    fadrm_ray.data.fashion_sample's) takes mnist-sample's."""
    return table[mode].get(dataset, table[mode]["mnist-sample"])


# Student optimizer steps per evaluation. The library default (about 600) keeps `fadrm evaluate`
# under a minute; the full grid trains longer because synthesized images need it: on
# mnist-sample IPC 10 (FADRM images, full cosine) 600 steps gave 73.3 +- 4.5 over 3 seeds and
# 2100 steps 85.1 +- 1.7, while RDED images went from 80.7 +- 0.4 to 86.9 +- 0.3.
STUDENT_STEPS = {"full": 1000, "quick": 300}


def budget_of(method: str, t: int) -> int:
    """A method's budget for fadrm's T, in the published ratios (FADRM 2000 iterations; SRe2L++,
    G-VBSM and CV-DD 4000; SRe2L and EDC 1000)."""
    return {"sre2l++": 2 * t, "g-vbsm": 2 * t, "cv-dd": 2 * t, "sre2l": t // 2, "edc": t // 2,
            "rded": 0, "random-real": 0, "patches": 0}.get(method, t)


def method_config(method: str, ipc: int, t: int, recover_overrides: dict, variants: dict) -> DistillConfig:
    """The distill config of one row: a preset (or a --variant) at this IPC and budget."""
    common = {"ipc": ipc, "ipc_per_unit": ipc, "pack": ipc}
    if method == "patches":
        fadrm = method_config("fadrm", ipc, t, recover_overrides, variants)
        return baseline_configs(fadrm)["starting_patches"].model_copy(update=common)
    preset, overrides = variants.get(method, (method, {}))
    values = {"iterations": budget_of(preset, t), **common, **recover_overrides, **overrides}
    return make_config(preset, overrides=values)


def parse_variant(text: str) -> tuple[str, tuple[str, dict]]:
    """'NAME: PRESET key=value ...' -> (NAME, (PRESET, {key: value})); values are read as YAML."""
    name, sep, rest = text.partition(":")
    words = rest.split()
    if not sep or not name.strip() or not words:
        raise ConfigError(f"--variant must look like 'NAME: PRESET key=value ...', got {text!r}")
    overrides = parse_overrides(words[1:])
    make_config(words[0], overrides=overrides)  # a bad preset, key or value fails before any work
    return name.strip(), (words[0], overrides)


def bench_teacher(dataset, out: Path, name: str, epochs: int, log, model: str | None = None) -> tuple[Path, float]:
    """Teacher `name` of TEACHERS on `dataset` (or a `model` by name with its default settings),
    trained once into out/teachers/<dataset>-<size>px/<name>/."""
    folder = out / "teachers" / (dataset.name if dataset.info.get("native_size") in (None, dataset.image_size)
                                 else f"{dataset.name}-{dataset.image_size}px") / (f"{name}-{model}" if model else name)
    model, kwargs = (model, {}) if model else TEACHERS[name]
    cfg = SqueezeConfig(model=model, model_kwargs=dict(kwargs), epochs=epochs, seed=0)
    started = time.perf_counter()
    teacher = ensure_teacher(dataset, cfg, folder, progress=False)
    if not teacher.reused:
        log(f"  teacher {name} ({model} {kwargs}) on {dataset.name}: test top-1 {teacher.info.test_accuracy:.2f}% "
            f"in {time.perf_counter() - started:.0f} s")
    return teacher.path, float(teacher.info.test_accuracy)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=None)
def bench_dataset(name: str, image_size: int | None = None):
    """A dataset of the accuracy bench, read once per process (the experiments share it)."""
    return get_dataset(name, image_size=image_size)


def _start_job(threads: int) -> None:
    torch.set_num_threads(threads)


def _teacher_job(out: Path, dataset_name: str, image_size: int | None, tname: str, epochs: int,
                 model: str | None = None) -> tuple[str, str, Path, float]:
    path, acc = bench_teacher(bench_dataset(dataset_name, image_size), out, tname, epochs, log, model)
    return dataset_name, tname, path, acc


def _cell_job(cell: dict) -> list[dict]:
    """Distill one (dataset, IPC, method) and evaluate it; FADRM+ and random real images also get
    their control row here (CONTROLS), so that the one run it shares is never distilled by two
    processes at once."""
    dataset, paths = bench_dataset(cell["dataset"], cell["image_size"]), cell["teachers"]
    ipc = cell["ipc"]
    cfg = method_config(cell["method"], ipc, cell["t"], cell["recover_overrides"], cell["variants"])
    teacher_paths = [paths["t1"]] + ([paths["t2"], paths["t3"]] if cfg.preset in SEVERAL_TEACHERS else [])
    started = time.perf_counter()
    spec = ExecutionSpec(local=True, progress=False)
    distill_job, parts = prepare_job(cfg, dataset, dataset.name, teacher_paths, cell["store"],
                                     device_type=execute.device_type(spec))
    run = execute.run(distill_job, spec, parts)
    distill_s = time.perf_counter() - started
    rows = []
    control, control_teachers = CONTROLS.get(cell["method"], (None, ()))
    for method in [cell["method"]] + ([control] if cell["control"] else []):
        eval_teachers = [paths[t] for t in control_teachers] if method == control else teacher_paths
        # evaluate_run caches every evaluation inside its run: a rerun of the grid reads them back.
        # At this IPC: the run may hold more (its IPCs share one run, written one command at a time).
        evaluation = cell["evaluation"].model_copy(update=METHOD_EVALUATION.get(cfg.preset, {}))
        job = EvalJob(config=evaluation, teacher_paths=eval_teachers, ipc=run.ipc)
        ev = evaluate_store_run(run.run_dir, job, EvalSpec(progress=False), parts=EvalParts(dataset=dataset)).evaluation
        rows.append({"dataset": cell["dataset"], "dataset_name": dataset.name, "ipc": ipc, "method": method,
                     "iterations": cfg.iterations, "run_id": run.run_id, "distill_seconds": round(distill_s, 1),
                     "distill_skipped": bool(run.units_skipped and not run.units_run),
                     "eval_seconds": ev.seconds, "top1_mean": ev.top1_mean, "top1_std": ev.top1_std,
                     "top1_per_seed": ev.top1_per_seed, "best_top1_mean": ev.best_top1_mean,
                     "student_epochs": ev.epochs, "student_steps": ev.steps_per_seed,
                     "teachers": [Path(p).parent.name for p in eval_teachers]})
        log(f"  {dataset.name} ipc {ipc} {method:<20} T={cfg.iterations:<5} top-1 {ev.top1_mean:6.2f} ± "
            f"{ev.top1_std:.2f}  (distill {distill_s:.0f} s, eval {ev.seconds:.0f} s)")
    return rows


class Grid(BaseModel):
    """One accuracy grid: its datasets, IPCs and rows, the students' recipe, the teachers and the
    processes that run it (`run_grid`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    datasets: list[str]
    ipcs: list[int]
    methods: list[str]
    evaluation: EvalConfig
    mode: Literal["quick", "full"] = "full"
    control: bool = False                 # add the CONTROLS rows beside fadrm+ and random-real
    jobs: int = 1                         # processes at a time
    threads: int = 1                      # torch threads of each
    recover_overrides: dict[str, Any] = {}
    variants: dict[str, Any] = {}         # {row name: (preset, overrides)}
    image_size: int | None = None
    teacher: str | None = None            # a checkpoint replacing t1 (trained on the same data)
    teacher_model: str | None = None      # t1 trained as this model instead of TEACHERS' convnet-bn
    teacher_epochs: int | None = None


def run_grid(out: Path, grid: Grid) -> dict:
    """Teachers first, then every cell, `grid.jobs` processes at a time (each with `grid.threads`
    torch threads)."""
    datasets, ipcs, methods, mode, evaluation = grid.datasets, grid.ipcs, grid.methods, grid.mode, grid.evaluation
    image_size, teacher, teacher_model = grid.image_size, grid.teacher, grid.teacher_model
    store = out / "store"
    variants = dict(grid.variants)
    several = any((variants.get(m, (m, {}))[0] in SEVERAL_TEACHERS) for m in methods)
    tnames = list(TEACHERS) if several else ["t1"]
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that already runs torch threads
    with ProcessPoolExecutor(max_workers=grid.jobs, mp_context=ctx, initializer=_start_job,
                             initargs=(grid.threads,)) as pool:
        teacher_jobs = [pool.submit(_teacher_job, out, d, image_size, t,
                                    grid.teacher_epochs or per_dataset(TEACHER_EPOCHS, mode, d),
                                    teacher_model if t == "t1" else None)
                        for d in datasets for t in tnames if not (teacher and t == "t1")]
        paths: dict = {d: ({"t1": Path(teacher)} if teacher else {}) for d in datasets}
        teachers_info: dict = {d: ({"t1": {"path": teacher}} if teacher else {}) for d in datasets}
        for job in teacher_jobs:
            d, tname, path, acc = job.result()
            paths[d][tname] = path
            model, kwargs = (teacher_model, {}) if (teacher_model and tname == "t1") else TEACHERS[tname]
            teachers_info[d][tname] = {"path": str(path), "model": model, "kwargs": kwargs, "test_top1": round(acc, 2)}
        cells = []
        for d in datasets:
            num_classes = bench_dataset(d, image_size).num_classes
            for ipc in ipcs:
                cell_eval = evaluation
                if evaluation.protocol == "short" and evaluation.epochs is None:
                    cell_eval = evaluation.model_copy(
                        update={"epochs": epochs_for_steps(num_classes * ipc, STUDENT_STEPS[mode])})
                for method in methods:
                    cells.append({"dataset": d, "image_size": image_size, "ipc": ipc, "method": method,
                                  "t": per_dataset(BUDGETS, mode, d), "teachers": paths[d], "store": store, "out": out,
                                  "evaluation": cell_eval,
                                  "control": grid.control and (method == "fadrm+" or (method == "random-real" and several)),
                                  "recover_overrides": dict(grid.recover_overrides), "variants": variants})
        # Longest first, so the last cells to finish are short ones and the processes stay busy.
        order = sorted(range(len(cells)), key=lambda i: -_cost(cells[i]))
        futures = {i: pool.submit(_cell_job, cells[i]) for i in order}
        results = [row for i in range(len(cells)) for row in futures[i].result()]
    return {"results": results, "teachers": teachers_info}


def _cost(cell: dict) -> float:
    """A rough relative cost of a cell: recover image-updates times teachers, plus evaluation."""
    pixels = bench_dataset(cell["dataset"], cell["image_size"]).image_size ** 2
    preset, overrides = cell["variants"].get(cell["method"], (cell["method"], {}))
    teachers = 3 if preset in SEVERAL_TEACHERS else 1
    iterations = overrides.get("iterations")
    if not isinstance(iterations, int):  # unset, or "auto": the budget stands in for the recipe's
        iterations = budget_of(preset, cell["t"])
    recover = iterations * cell["ipc"] * teachers * pixels
    return recover + 2e4 * pixels * len(cell["evaluation"].seed_list) * (2 if cell["control"] else 1)


def _columns(results: list[dict], methods: list[str]) -> list[str]:
    return [m for m in methods if any(r["method"] == m for r in results)] + \
        [c for c, _ in CONTROLS.values() if any(r["method"] == c for r in results)]


def _cells(results: list[dict]) -> list[tuple[int, str, dict[str, dict]]]:
    """(IPC, the dataset's name, {method: row}) per cell of the table, by dataset spec and IPC."""
    out = []
    for ds, ipc in sorted({(r["dataset"], r["ipc"]) for r in results}):
        rows = {r["method"]: r for r in results if r["dataset"] == ds and r["ipc"] == ipc}
        out.append((ipc, next(iter(rows.values())).get("dataset_name", ds), rows))
    return out


def markdown(results: list[dict], methods: list[str]) -> str:
    cols = _columns(results, methods)
    lines = ["| dataset | IPC | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for ipc, name, rows in _cells(results):
        cells = ["-" if m not in rows else f"{rows[m]['top1_mean']:.2f} ± {rows[m]['top1_std']:.2f}" for m in cols]
        lines.append(f"| {name} | {ipc} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_markdown(results: list[dict], methods: list[str], against: str = "fadrm") -> str:
    """`against` minus every other row, seed by seed (baselines.paired_gain: the students of one
    seed share their initial weights and augmentation stream, which cancels most of the spread
    between seeds); empty when `against` is not in the table."""
    cols = [m for m in _columns(results, methods) if m != against]
    cells = [c for c in _cells(results) if against in c[2]]
    if not cols or not cells:
        return ""
    lines = [f"{against} minus each row, seed by seed: mean ± standard error (seeds on which {against} is higher)",
             "", "| dataset | IPC | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for ipc, name, rows in cells:
        texts = []
        for m in cols:
            if m not in rows:
                texts.append("-")
                continue
            gain = paired_gain(rows[against]["top1_per_seed"], rows[m]["top1_per_seed"])
            texts.append(f"{gain_text(gain, seeds=False)} ({gain.higher}/{gain.seeds})")
        lines.append(f"| {name} | {ipc} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def versus_markdown(results: list[dict], methods: list[str], baseline: str = "random-real") -> str:
    """Every row minus `baseline` relabelled by the same teachers, seed by seed (mean ± standard
    error, seeds on which the row is higher), one line per row with its top-1 and each seed's:
    the table that says which sets beat random real images of the same size. A row relabelled by
    several teachers is set against the RANDOM_CONTROL row where the grid has it (--control).
    Empty where `baseline` is not in the table."""
    cells = [c for c in _cells(results) if baseline in c[2]]
    if not cells:
        return ""
    lines = [f"each row minus {baseline} (relabelled by the same teachers), seed by seed: mean ± standard error "
             "(seeds on which the row is higher)", "",
             f"| dataset | IPC | row | top-1 | top-1 per seed | − {baseline} |", "|---|---|---|---|---|---|"]
    for ipc, name, rows in cells:
        for m in _columns(results, methods):
            if m not in rows:
                continue
            row = rows[m]
            seeds = " / ".join(f"{v:.2f}" for v in row["top1_per_seed"])
            against = RANDOM_CONTROL if len(row.get("teachers", ())) > 1 and RANDOM_CONTROL in rows else baseline
            gain = ""
            if m != against:
                g = paired_gain(row["top1_per_seed"], rows[against]["top1_per_seed"])
                gain = f"{gain_text(g, seeds=False)} ({g.higher}/{g.seeds})" + \
                    (f" against {against}" if against != baseline else "")
            lines.append(f"| {name} | {ipc} | {m} | {row['top1_mean']:.2f} ± {row['top1_std']:.2f} | {seeds} | {gain} |")
    return "\n".join(lines)


def bar_chart(results: list[dict], path: Path) -> None:
    plt = pyplot()
    cells = _cells(results)
    methods = list(dict.fromkeys(r["method"] for r in results))
    fig, axes = plt.subplots(1, len(cells), figsize=(max(5.0, 3.6 * len(cells)), 3.8), dpi=120, squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, (ipc, name, by_method) in zip(axes[0], cells):
        rows = [by_method.get(m) for m in methods]
        xs = [i for i, r in enumerate(rows) if r is not None]
        ax.bar(xs, [rows[i]["top1_mean"] for i in xs], yerr=[rows[i]["top1_std"] for i in xs], capsize=3,
               color=[colors(i % 10) for i in xs])
        low = min(rows[i]["top1_mean"] - rows[i]["top1_std"] for i in xs)
        ax.set_ylim(max(0.0, low - 5), 100)
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{name}, IPC {ipc}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("student test top-1 (%)")
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="digits only, smaller budgets (about 3 minutes)")
    parser.add_argument("--out", default="bench-results/accuracy")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--datasets", default=None, help="comma-separated dataset specs (default: digits,mnist-sample; quick: digits)")
    parser.add_argument("--image-size", type=int, default=None, help="resize the datasets to this size (default: native)")
    parser.add_argument("--ipc", default="1,10", help="comma-separated IPC values")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated rows among {', '.join(METHODS)} and the --variant names")
    parser.add_argument("--variant", action="append", default=[], metavar="'NAME: PRESET key=value ...'",
                        help="an extra row: a preset with its own overrides (repeatable)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="student seeds 0..N-1 per row; students a run already has are read back, so "
                             "raising N later trains only the new seeds")
    parser.add_argument("--protocol", choices=["short", "published"], default="short",
                        help="student schedule: short (--student-steps steps, full cosine) or published "
                             "(300 epochs, 1000 at IPC 1, stretched cosine)")
    parser.add_argument("--control", action="store_true",
                        help=f"add the '{CONTROL}' row (FADRM+ images, single-teacher labels) and, with several "
                             f"teachers, the '{RANDOM_CONTROL}' row (random real images, the teachers' averaged labels)")
    parser.add_argument("--cosine-stretch", type=float, default=None,
                        help="student schedule stretch (default: the protocol's)")
    parser.add_argument("--student-steps", type=int, default=None,
                        help="student optimizer steps per evaluation under the short protocol (default: 1000, quick: 300)")
    parser.add_argument("--teacher", default=None, help="a checkpoint to use as t1 instead of training one")
    parser.add_argument("--teacher-model", default=None, help="train t1 as this model (e.g. resnet18-cifar)")
    parser.add_argument("--teacher-epochs", type=int, default=None, help="epochs of every teacher trained here")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per job (1 by default: on a shared 2-core machine more threads spin-wait)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="cells run at once, each in its own process (default: CPU count / threads)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a recover config override for every distilled method (e.g. crop_scale_min=0.5); "
                             "such runs are cached apart from the default ones")
    args = parser.parse_args(argv)

    mode = "quick" if args.quick else "full"
    if args.student_steps is not None:
        if args.student_steps < 1:
            parser.error("--student-steps must be >= 1")
        STUDENT_STEPS[mode] = args.student_steps
    datasets = args.datasets.split(",") if args.datasets else (["digits"] if args.quick else ["digits", "mnist-sample"])
    try:
        variants = dict(parse_variant(v) for v in args.variant)
        recover_overrides = parse_overrides(args.overrides)
        make_config("fadrm", overrides=recover_overrides)  # reject a bad key or value before any work
        evaluation = EvalConfig(seeds=args.seeds, protocol=args.protocol, cosine_stretch=args.cosine_stretch)
    except ConfigError as exc:
        parser.error(str(exc))
    methods = [m for m in args.methods.split(",") if m] + [v for v in variants if v not in args.methods.split(",")]
    unknown = sorted(set(methods) - set(METHODS) - set(variants))
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)} or define a --variant")
    ipcs = [int(v) for v in args.ipc.split(",") if v]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = args.jobs or max(1, (os.cpu_count() or 1) // args.threads)

    started = time.perf_counter()
    schedule = f"{STUDENT_STEPS[mode]} student steps" if args.protocol == "short" else "the published student schedule"
    log(f"bench.accuracy ({mode}): datasets {datasets}, IPC {ipcs}, {args.seeds} seeds, {schedule}, "
        f"{jobs} job(s) x {args.threads} thread(s)" + (f", recover overrides {recover_overrides}" if recover_overrides else ""))
    grid = run_grid(out, Grid(datasets=datasets, ipcs=ipcs, methods=methods, mode=mode, control=args.control,
                              evaluation=evaluation, jobs=jobs, threads=args.threads,
                              recover_overrides=recover_overrides, variants=variants, image_size=args.image_size,
                              teacher=args.teacher, teacher_model=args.teacher_model,
                              teacher_epochs=args.teacher_epochs))
    table = markdown(grid["results"], methods)
    for extra in (paired_markdown(grid["results"], methods), versus_markdown(grid["results"], methods)):
        table += f"\n\n{extra}" if extra else ""
    report = {"mode": mode, "datasets": datasets, "image_size": args.image_size, "ipc": ipcs, "methods": methods,
              "variants": variants, "seeds": args.seeds, "threads": args.threads, "jobs": jobs,
              "recover_overrides": recover_overrides, "budgets": {d: per_dataset(BUDGETS, mode, d) for d in datasets},
              "budget_rule": "fadrm/fadrm+ T, sre2l++/g-vbsm/cv-dd 2T, sre2l/edc T/2, rded/random-real/patches 0",
              "student": evaluation.student, "protocol": args.protocol,
              "student_steps": STUDENT_STEPS[mode] if args.protocol == "short" else None,
              **grid, "table": table, "seconds": round(time.perf_counter() - started, 1)}
    (out / "accuracy.json").write_text(json.dumps(report, indent=2))
    (out / "accuracy.md").write_text(table + "\n")
    bar_chart(grid["results"], out / "accuracy.png")
    report["png"] = str(out / "accuracy.png")
    if args.json:
        print(json.dumps(report))
    else:
        print(table)
        print(f"\n{len(grid['results'])} runs in {report['seconds']:.0f} s; details in {out / 'accuracy.json'}")
    return report


if __name__ == "__main__":
    main()
