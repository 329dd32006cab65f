"""The main job end to end on an offline dataset: squeeze -> distill -> evaluate -> report.

`run_demo` is what `fadrm demo` runs: it trains a teacher (or reuses the one it trained
before in the same output folder), distills the dataset with the `fadrm` preset, trains
students on the result and on its two baselines (random real images and its starting
patches, baselines.py) with DD-Ranking's scores (ranking.py), writes the report (image grid, loss curves, accuracy against the
baselines), exports an ImageFolder and returns a summary of where everything is.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from fadrm_ray.config import EvalConfig, SqueezeConfig, make_config
from fadrm_ray.data import get_dataset
from fadrm_ray.evaluation.baselines import gain_text
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.ranking import ranking_text
from fadrm_ray.evaluation.store_run import EvalScope, evaluate_store_run
from fadrm_ray.runs.execute import distill
from fadrm_ray.runs.job import ExecutionSpec
from fadrm_ray.squeeze import ensure_teacher
from fadrm_ray.store import export_imagefolder, open_run

if TYPE_CHECKING:
    from fadrm_ray.runs.execute import Door

# Budgets that finish in a few minutes on a 2-core CPU.
DEMO_ITERATIONS = {"digits": 1000, "mnist-sample": 1000}
# Where the gain over random real images is clear, for a demo on a dataset where it is not.
CLEAR_GAIN = ("the fadrm-ray repository's docs/benchmarks/accuracy.md shows a dataset where it is (the full "
              "Fashion-MNIST at IPC 10); with its data installed, from any directory: fadrm squeeze --dataset "
              "fashion-mnist --out fm-teacher, fadrm distill --dataset fashion-mnist --teacher "
              "fm-teacher/teacher.pt --ipc 10 --out fm-store, then fadrm evaluate --run fm-store/RUN_ID "
              "--protocol published")


def reading(evaluation) -> str:
    """One line on what the demo's chart says: the distilled set against random real images of
    the same size, seed by seed (a gain counts as clear above two standard errors)."""
    gain = evaluation.paired_gains.get("random_real")
    if gain is None:
        return "random real images could not be evaluated, so the chart has nothing to compare the set with"
    if gain.clearly_above:
        return f"the distilled set is above random real images of the same size: {gain_text(gain)}"
    return (f"the distilled set is not clearly above random real images ({gain_text(gain)}): on {evaluation.dataset} "
            f"real images already teach a student most of what the teacher knows, so there is little to gain; "
            + CLEAR_GAIN)


def run_demo(out: str | Path = "fadrm-demo", dataset_name: str = "digits", ipc: int = 10,
             iterations: int | None = None, epochs: int | None = None, seeds: int = 2,
             spec: ExecutionSpec | None = None, door: "Door | None" = None) -> dict:
    """Squeeze, distill and export. The distillation is one job, built for `door` and run
    through it with `spec` (`execute.distill`): the Ray door, or None for this process;
    `spec.progress` shows the progress bars of every phase."""
    spec = spec or ExecutionSpec(local=True)
    progress = spec.progress
    out = Path(out)
    dataset = get_dataset(dataset_name)
    squeeze_cfg = SqueezeConfig(**({} if epochs is None else {"epochs": epochs}))
    teacher, teacher_info, reused = ensure_teacher(dataset, squeeze_cfg, out / "teacher", progress=progress)
    cfg = make_config("fadrm", overrides={"ipc": ipc, "iterations": iterations or DEMO_ITERATIONS.get(dataset_name, 1000)})
    store_root = out / "store"
    result = distill(cfg, dataset, dataset_name, [str(teacher)], str(store_root), spec, door)
    job = EvalJob(config=EvalConfig(seeds=seeds), teacher_paths=[teacher], ipc=result.ipc)
    measured = evaluate_store_run(result.run_dir, job, EvalSpec(progress=progress),
                                  EvalScope(baselines=True, ranking="full", report=True), EvalParts(dataset=dataset))
    evaluation, report = measured.evaluation, measured.report
    export_dir = out / "imagefolder"
    if export_dir.exists():  # a rerun refreshes the export
        shutil.rmtree(export_dir)
    exported = export_imagefolder(result.run_dir, export_dir, ipc=result.ipc)
    info = open_run(result.run_dir, ipc=result.ipc).info()
    summary = {
        "dataset": dataset_name,
        "teacher": str(teacher),
        "teacher_test_accuracy": round(teacher_info.test_accuracy, 2),
        "teacher_reused": reused,
        "run": str(result.run_dir),
        "images": result.images,
        "distill_seconds": round(result.seconds, 1),
        "student_top1_mean": round(evaluation.top1_mean, 2),
        "student_top1_std": round(evaluation.top1_std, 2),
        **{f"{name}_top1_mean": round(b.top1_mean, 2) for name, b in evaluation.baselines.items()
           if b.top1_mean is not None},
        # DD-Ranking's scores (ranking.py): how much of the result is the images, not the labels.
        "dd_ranking": "not measured" if evaluation.ranking is None else ranking_text(evaluation.ranking),
        "reading": reading(evaluation),
        "ranking": None if evaluation.ranking is None else evaluation.ranking.model_dump(mode="json"),
        "report_evaluation": report.get("evaluation_plot"),
        "report_grid": report.get("grid"),
        "report_losses": report.get("losses"),
        "imagefolder": str(export_dir),
        "exported": exported,
        "info": info,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["summary"] = str(out / "summary.json")
    return summary
