"""One evaluation of a store run, composed once for every door.

`fadrm evaluate`, the demo, the REST service's evaluation task, a sweep's trial and the pilot all
call `evaluate_store_run(run_dir, job, spec, scope, parts, hooks)`: the run is opened here, once
(`evaluate.open_for_evaluation`: its images read and checked once, its data and teachers loaded
once), and every step that `scope` asks for is handed the opened run: the run's students
(`evaluate_run`; its plan first, `plan.plan_evaluation`, where `hooks.on_plan` asks for it), the baselines beside it (`baselines.evaluate_with_baselines`), DD-Ranking's
scores (`ranking`), the report (`report.write_report`, which rewrites no file whose content it
would not change: an evaluation read whole from the caches writes nothing).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from fadrm_ray.evaluation.baselines import evaluate_with_baselines
from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalParts, EvalSpec, OpenedRun
from fadrm_ray.evaluation.ranking import hard_label_ranking
from fadrm_ray.evaluation.report import write_report
from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.evaluation.evaluate import evaluate_run, open_for_evaluation
from fadrm_ray.evaluation.plan import plan_evaluation


class EvalScope(BaseModel):
    """What an evaluation measures beyond the run's own students, and whether it writes the report."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    baselines: bool = False      # random real images and the starting patches, beside the run
    # DD-Ranking: "full" (HLR, IOR, LRS; needs the baselines), "hard-labels" (what the images
    # reach with their own classes alone), or "none"
    ranking: Literal["none", "hard-labels", "full"] = "none"
    ars: bool = False            # ARS too (two more evaluations without augmentation; with "full")
    report: bool = False         # write report/ beside the run's images


@dataclass(frozen=True)
class RunEvaluated:
    """What `evaluate_store_run` gives back: the result, the run as it was opened, the report files."""

    evaluation: Evaluation
    run: OpenedRun
    report: dict[str, str] = field(default_factory=dict)
    planned_seconds: float | None = None  # what the sets of its plan took (where `hooks.on_plan` heard one)


def evaluate_store_run(run_dir: str | Path, job: EvalJob, spec: EvalSpec | None = None, scope: EvalScope | None = None,
                       parts: EvalParts | None = None, hooks: EvalHooks | None = None) -> RunEvaluated:
    """Evaluate the run in `run_dir` under `job`, its students running as `spec` says (None:
    `EvalSpec()`), measuring what `scope` asks for (module docstring); `parts`: the data and
    teachers already loaded; `hooks`: what watches it (`on_open` sees the run as it is opened)."""
    spec, scope, hooks = spec or EvalSpec(), scope or EvalScope(), hooks or EvalHooks()
    run = open_for_evaluation(run_dir, job, spec, parts, hooks, own_teachers=scope.baselines)
    planned = None
    if hooks.on_plan is not None:  # what it will train, before it trains anything
        hooks.on_plan(plan_evaluation(run, job, spec, baselines=scope.baselines, ranking=scope.ranking, ars=scope.ars))
        planned = time.perf_counter()
    if scope.baselines:
        result = evaluate_with_baselines(run, job, spec, hooks, ranking=scope.ranking == "full", ars=scope.ars)
    else:
        result = evaluate_run(run, job, spec, hooks)
    if scope.ranking == "hard-labels":
        result = result.model_copy(update={"ranking": hard_label_ranking(run, result, job, spec)})
    planned = None if planned is None else time.perf_counter() - planned
    files = write_report(run, evaluation=result) if scope.report else {}
    return RunEvaluated(result, run, files, planned)
