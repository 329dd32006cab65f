"""Small-scale checks of the paper's two claims about ARC (docs/method.md sections 4 and 6).

(a) Information vanishing: without ARC, a longer optimization *lowers* student accuracy; with
    ARC it keeps rising. `information_vanishing` distills the same data with the same teacher
    at several total iteration budgets, with ARC (preset fadrm) and without (preset sre2l++:
    alpha = 1, k = 0, run at the same precision as fadrm so that ARC is the only difference),
    and evaluates every run with the same student protocol (evaluate.py).
(b) What a merge does: `arc_merge_effect` runs recover stage by stage and, around every ARC
    merge x <- alpha * resize(x) + (1 - alpha) * resize(P), compares the images just before the
    merge with those just after: the cosine similarity of the teacher's penultimate features,
    the teacher's top-1 on them, and how close each is (in feature space) to the real patch P.

The pre-merge images are not recomputed by a second run: the merge is affine in x with a known
patch term, so resize(x) = (x_merged - (1 - alpha) * resize(P)) / alpha exactly (up to float
rounding); tests check this against a rerun of the stage with alpha = 1.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fadrm_ray.config import make_config
from fadrm_ray.data import get_dataset
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.runs.stages import load_teachers, unit_states
from fadrm_ray.runs.units import plan_units
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.models import load_teacher, match_channels
from fadrm_ray.recover import resize, run_stage
from fadrm_ray.evaluation.report import pyplot, save_figure
from fadrm_ray.runtime import torch_threads
from fadrm_ray.fileio import atomic_write_text
from fadrm_ray.store import to_plain


def _dataset(dataset: ImageDataset | str) -> ImageDataset:
    return get_dataset(dataset) if isinstance(dataset, str) else dataset


# --------------------------------------------------------------------------- (a)
def information_vanishing(dataset: ImageDataset | str, teacher_path: str | Path, job: EvalJob,
                          spec: EvalSpec | None = None, *, budgets: Sequence[int] = (100, 300, 1000, 3000),
                          ipc: int = 10, out_dir: str | Path = "diagnostics", overrides: dict | None = None) -> dict:
    """Student top-1 against the total recover budget, with ARC and without.

    Every run goes through the library's door (`execute.run`) into `out_dir/store` (finished runs are reused) and
    is evaluated under `job.config` with the teacher, its students running as `spec` says (None: `EvalSpec()`;
    `spec.threads` torch threads; `spec.progress` prints a line per run). Writes
    `out_dir/information_vanishing.{json,png}`.
    """
    dataset = _dataset(dataset)
    spec = spec or EvalSpec()
    evaluation, progress = job.config, spec.progress
    run_job = job.model_copy(update={"teacher_paths": (str(teacher_path),)})
    run_spec = spec.model_copy(update={"progress": False})
    out = Path(out_dir)
    store_root = out / "store"
    # One unit holding every IPC batch, packed into one forward: the same math (recover.py's
    # groups are independent), fewer Python round trips on a CPU.
    common = {"ipc": ipc, "ipc_per_unit": ipc, "pack": ipc, **dict(overrides or {})}
    variants = {"arc": ("fadrm", {}), "no_arc": ("sre2l++", {"precision": "auto"})}
    rows: dict[str, list[dict]] = {k: [] for k in variants}
    execution = ExecutionSpec(local=True, progress=False)
    started = time.perf_counter()
    with torch_threads(spec.threads):
        for budget in budgets:
            for key, (preset, extra) in variants.items():
                cfg = make_config(preset, overrides={**common, **extra, "iterations": int(budget)})
                distill_job, parts = prepare_job(cfg, dataset, dataset.name, [teacher_path], store_root,
                                                 device_type=execute.device_type(execution))
                run = execute.run(distill_job, execution, parts)
                ev = evaluate_store_run(run.run_dir, run_job.model_copy(update={"ipc": run.ipc}), run_spec,
                                        parts=EvalParts(dataset=dataset)).evaluation
                rows[key].append({"budget": int(budget), "top1_mean": ev.top1_mean, "top1_std": ev.top1_std,
                                  "top1_per_seed": ev.top1_per_seed, "run_id": run.run_id,
                                  "distill_seconds": round(run.seconds, 2)})
                if progress:
                    print(f"information vanishing: {dataset.name} ipc {ipc} budget {budget} {key}: "
                          f"{ev.top1_mean:.2f} ± {ev.top1_std:.2f}", flush=True)
    result = {"dataset": dataset.name, "ipc": ipc, "teacher": str(teacher_path), "student": evaluation.student,
              "seeds": len(evaluation.seed_list), "evaluation": evaluation.model_dump(mode="json"),
              "budgets": [int(b) for b in budgets], **rows,
              "seconds": round(time.perf_counter() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    png = out / "information_vanishing.png"
    _plot_vanishing(result, png)
    result["png"] = str(png)
    atomic_write_text(out / "information_vanishing.json", json.dumps(to_plain(result), indent=2))
    result["json"] = str(out / "information_vanishing.json")
    return result


def _plot_vanishing(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=120)
    for key, label, color in (("arc", "with ARC (fadrm)", "tab:blue"), ("no_arc", "without ARC (sre2l++)", "tab:gray")):
        rows = result[key]
        ax.errorbar([r["budget"] for r in rows], [r["top1_mean"] for r in rows], yerr=[r["top1_std"] for r in rows],
                    marker="o", capsize=3, label=label, color=color)
    positive = [b for b in result["budgets"] if b > 0]
    ax.set_xscale("symlog", linthresh=min(positive) if positive else 1, linscale=0.5)
    ax.set_xlabel("total recover iterations")
    ax.set_ylabel("student test top-1 (%)")
    ax.set_title(f"information vanishing: {result['dataset']}, IPC {result['ipc']}, {result['seeds']} seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


# --------------------------------------------------------------------------- (b)
def penultimate_features(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, logits): the input of the model's last Linear layer (its penultimate
    features) and the model's output, for a batch."""
    linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linear:
        raise ValueError(f"{type(model).__name__} has no Linear layer to take penultimate features from")
    captured = []
    handle = linear[-1].register_forward_pre_hook(lambda m, inputs: captured.append(inputs[0].detach()))
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        handle.remove()
    return captured[-1].flatten(1), logits


def arc_merge_effect(dataset: ImageDataset | str, teacher_paths: str | Path | Sequence[str | Path],
                     ipc: int = 2, iterations: int = 400, overrides: dict | None = None, out_dir: str | Path | None = None,
                     device: str = "cpu") -> dict:
    """Before/after statistics of every ARC merge of a fadrm recover (first teacher's view).

    Returns {"merges": [{"stage", "after_iteration", "cosine_mean", "cosine_min", "acc_before",
    "acc_after", "patch_cosine_before", "patch_cosine_after", "images"}], ...}; with `out_dir`,
    also writes arc_merges.json and arc_merges.png there.
    """
    dataset = _dataset(dataset)
    if isinstance(teacher_paths, (str, Path)):
        teacher_paths = [teacher_paths]
    cfg = make_config("fadrm", overrides={"ipc": ipc, "iterations": iterations, "ipc_per_unit": ipc, "pack": ipc,
                                          **dict(overrides or {})})
    cfg = cfg.resolve(dataset.image_size, dataset.num_classes, dataset.hflip, torch.device(device).type,
                      channels=dataset.channels)
    if not cfg.uses_arc:
        raise ValueError("this config has no ARC merge (k = 0 or alpha = 1)")
    teachers, infos = load_teachers(list(teacher_paths), dataset, cfg, device)
    # A separate copy of the first teacher, without recover's BN-loss hooks, measures the merges.
    probe, probe_info = load_teacher(teacher_paths[0], device=device)
    sums: dict[int, dict] = {}
    for unit in plan_units(cfg, dataset.num_classes):
        for state in unit_states(unit, cfg, dataset, teachers, device):
            while not state.done:
                stage = state.stage
                run_stage(state, teachers, cfg, device)
                if not state.history[-1]["merged_after"]:
                    continue
                after = state.x
                before, patch = pre_merge_images(state, cfg.alpha)
                stats = _compare(probe, probe_info.in_chans, before, after, patch, state.labels, device)
                agg = sums.setdefault(stage, {"stage": stage, "after_iteration": state.iteration, "images": 0,
                                              "cos": [], "acc_before": 0, "acc_after": 0, "pc_before": [],
                                              "pc_after": []})
                agg["images"] += after.shape[0]
                agg["cos"].append(stats["cos"])
                agg["pc_before"].append(stats["patch_cos_before"])
                agg["pc_after"].append(stats["patch_cos_after"])
                agg["acc_before"] += stats["correct_before"]
                agg["acc_after"] += stats["correct_after"]
    merges = []
    for stage in sorted(sums):
        a = sums[stage]
        cos = torch.cat(a["cos"])
        merges.append({"stage": stage, "after_iteration": a["after_iteration"], "images": a["images"],
                       "cosine_mean": round(float(cos.mean()), 4), "cosine_min": round(float(cos.min()), 4),
                       "acc_before": round(100.0 * a["acc_before"] / a["images"], 2),
                       "acc_after": round(100.0 * a["acc_after"] / a["images"], 2),
                       "patch_cosine_before": round(float(torch.cat(a["pc_before"]).mean()), 4),
                       "patch_cosine_after": round(float(torch.cat(a["pc_after"]).mean()), 4)})
    result = {"dataset": dataset.name, "ipc": ipc, "iterations": iterations, "alpha": cfg.alpha, "k": cfg.k,
              "teacher": str(infos[0].path), "merges": merges}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "arc_merges.json", json.dumps(to_plain(result), indent=2))
        _plot_merges(result, out / "arc_merges.png")
        result["json"], result["png"] = str(out / "arc_merges.json"), str(out / "arc_merges.png")
    return result


def pre_merge_images(state, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(resize(x) just before the last merge, resize(P)) from a state just after it, by
    inverting x_merged = alpha * resize(x) + (1 - alpha) * resize(P) (docs/method.md section 4)."""
    mean = torch.tensor(state.mean).view(1, -1, 1, 1)
    std = torch.tensor(state.std).view(1, -1, 1, 1)
    patch = resize((state.patches.float() / 255.0 - mean) / std, state.x.shape[-1])
    return (state.x - (1 - alpha) * patch) / alpha, patch


def _compare(model: nn.Module, chans: int, before: torch.Tensor, after: torch.Tensor, patch: torch.Tensor,
             labels: torch.Tensor, device: str) -> dict:
    def run(x):
        return penultimate_features(model, match_channels(x.to(device), chans))

    f_before, l_before = run(before)
    f_after, l_after = run(after)
    f_patch, _ = run(patch)
    labels = labels.to(l_before.device)
    return {"cos": F.cosine_similarity(f_before, f_after, dim=1).cpu(),
            "patch_cos_before": F.cosine_similarity(f_before, f_patch, dim=1).cpu(),
            "patch_cos_after": F.cosine_similarity(f_after, f_patch, dim=1).cpu(),
            "correct_before": int((l_before.argmax(1) == labels).sum()),
            "correct_after": int((l_after.argmax(1) == labels).sum())}


def _plot_merges(result: dict, path: Path) -> None:
    plt = pyplot()
    merges = result["merges"]
    names = [f"merge after\nit. {m['after_iteration']}" for m in merges]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), dpi=120)
    x = range(len(merges))
    w = 0.38
    axes[0].bar([i - w / 2 for i in x], [m["acc_before"] for m in merges], w, label="before merge", color="tab:gray")
    axes[0].bar([i + w / 2 for i in x], [m["acc_after"] for m in merges], w, label="after merge", color="tab:blue")
    axes[0].set_ylabel("teacher top-1 on the images (%)")
    axes[1].plot(x, [m["cosine_mean"] for m in merges], marker="o", label="before vs after")
    axes[1].plot(x, [m["patch_cosine_before"] for m in merges], marker="s", label="before vs real patch")
    axes[1].plot(x, [m["patch_cosine_after"] for m in merges], marker="^", label="after vs real patch")
    axes[1].set_ylabel("cosine of penultimate features")
    axes[0].set_ylim(0, 119)
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center" if ax is axes[0] else "best", ncol=2 if ax is axes[0] else 1)
    fig.suptitle(f"ARC merges: {result['dataset']}, IPC {result['ipc']}, T = {result['iterations']}, "
                 f"alpha = {result['alpha']}", fontsize=9)
    save_figure(fig, path)
