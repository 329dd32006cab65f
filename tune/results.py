"""What a sweep leaves a person: results.csv, results.md, best.yaml and PNG plots, and one line
per finished trial while it runs.

One row per trial: its swept values, the students' test top-1 (mean ± std over the student
seeds; for a trial ASHA stopped, the last intermediate top-1 and how far its students got),
distill and student seconds, state (done, stopped, error), the node it ran on and its run in
the store. `best.yaml` is the best finished trial's whole config (`DistillConfig.to_dict` of
the config the trial built with `make_config`), which `fadrm distill --config best.yaml` runs
as it is. Plots: top-1 against each swept key, and a heat map of two swept keys (alpha x k when
both are swept) averaged over the others.
"""
from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml
from ray.tune import Callback

from tune.space import Param, _show, trial_config
from tune.trainable import TIME_ATTR

COLUMNS = ("top1", "top1_std", "top1_per_seed", TIME_ATTR, "distill_seconds", "student_seconds", "trial_seconds", "state",
           "node_id",
           "host", "run_id", "units_run", "patches_scored", "error")


def _values(config: dict, swept: dict[str, Param]) -> str:
    return " ".join(f"{k}={_show(config.get(k))}" for k in swept)


class ProgressLine(Callback):
    """One line on stderr per finished, stopped or failed trial."""

    def __init__(self, swept: dict[str, Param], enabled: bool = True):
        self.swept, self.enabled, self.finished = swept, enabled, 0

    def _say(self, trials, trial, text: str) -> None:
        self.finished += 1
        if self.enabled:
            print(f"fadrm tune: {self.finished}/{len(trials)} trial {trial.trial_id} "
                  f"{_values(trial.config, self.swept)}: {text}",
                  file=sys.stderr, flush=True)

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        if r.get("final"):
            text = (f"top-1 {r['top1']:.2f} ± {r.get('top1_std', 0):.2f} (distill {r.get('distill_seconds', 0):.0f} s, "
                    f"student {r.get('student_seconds', 0):.0f} s) on {r.get('host')}")
        else:
            text = f"stopped at {r.get(TIME_ATTR, 0):.0f}% of the student schedule (top-1 {r.get('top1', float('nan')):.2f})"
        self._say(trials, trial, text)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._say(trials, trial, "error (see results.csv)")


def collect_rows(grid, swept: dict[str, Param]) -> list[dict]:
    """One dict per trial of a Tune ResultGrid, in trial order."""
    rows = []
    for result in grid:
        m = result.metrics or {}
        trial = m.get("trial_id") or Path(result.path).name.removeprefix("trial_")
        state = "error" if result.error else "done" if m.get("final") else "stopped"
        row = {"trial": trial, **{k: result.config.get(k) for k in swept}}
        for col in COLUMNS:
            row[col] = m.get(col)
        row["state"] = state
        row["error"] = " ".join(str(result.error).split())[:300] if result.error else None
        if row["top1_per_seed"]:
            row["top1_per_seed"] = json.loads(row["top1_per_seed"])
        rows.append(row)
    return sorted(rows, key=lambda r: r["trial"])


def best_row(rows: list[dict]) -> dict | None:
    done = [r for r in rows if r["state"] == "done" and r["top1"] is not None]
    return max(done, key=lambda r: r["top1"]) if done else None


def write_results(p, rows: list[dict]) -> tuple[dict, dict | None]:
    """Write every file of the sweep's results into OUT; returns ({name: path}, the best trial)."""
    out, swept = p.out, p.swept
    files = {"results_csv": str(_write_csv(out / "results.csv", rows, swept)),
             "results_md": str(_write_md(out / "results.md", rows, swept, p))}
    best = best_row(rows)
    if best is not None:
        cfg = trial_config(p.base, {k: best[k] for k in swept})
        text = (f"# best trial {best['trial']} of the sweep in {out}: test top-1 {best['top1']:.2f} ± "
                f"{best['top1_std'] or 0:.2f}\n# fadrm distill --config best.yaml --dataset {p.request.dataset} "
                f"--teacher TEACHER --out STORE\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        (out / "best.yaml").write_text(text)
        files["best_yaml"] = str(out / "best.yaml")
        best = {**best, "config": cfg.to_dict()}
    files.update(plot_results(out, rows, swept))
    return files, best


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if not math.isnan(value) else "nan"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _write_csv(path: Path, rows: list[dict], swept: dict) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["trial", *swept, *COLUMNS])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in row.items()})
    return path


def _write_md(path: Path, rows: list[dict], swept: dict, p) -> Path:
    head = ["trial", *swept, "top-1 (%)", "distill s", "student s", "state", "node"]
    lines = [f"Sweep of {', '.join(swept) or 'nothing'} on {p.request.dataset}, preset {p.request.preset}, "
             f"IPC {p.base['ipc'] or 'default'}; student {p.eval_cfg.student}, seeds {p.eval_cfg.seed_list}, "
             f"protocol {p.eval_cfg.protocol}.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["state"] == "done":
            top1 = f"{r['top1']:.2f} ± {r['top1_std'] or 0:.2f}"
        elif r["top1"] is not None:
            top1 = f"({r['top1']:.2f} at {r[TIME_ATTR]:.0f}%)"
        else:
            top1 = ""
        node = f"{r['host']} {str(r['node_id'] or '')[:8]}".strip()
        lines.append("| " + " | ".join([r["trial"], *(_show(r[k]) for k in swept), top1,
                                        _cell(r["distill_seconds"]), _cell(r["student_seconds"]), r["state"],
                                        node]) + " |")
    best = best_row(rows)
    if best is not None:
        lines += ["", f"Best: trial {best['trial']} ({_values(best, swept)}), top-1 {best['top1']:.2f} ± "
                      f"{best['top1_std'] or 0:.2f}; its config is best.yaml."]
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------- plots
def _numeric(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _axis(values: list) -> tuple[list, list[str]]:
    """Sorted distinct values and their labels (a categorical axis for non-numbers)."""
    distinct = []
    for v in values:
        if v not in distinct:
            distinct.append(v)
    if _numeric(distinct):
        distinct.sort()
    return distinct, [_show(v) for v in distinct]


def plot_results(out: Path, rows: list[dict], swept: dict[str, Param]) -> dict[str, str]:
    from fadrm_ray.report import pyplot, save_figure

    plt = pyplot()
    done = [r for r in rows if r["state"] == "done" and r["top1"] is not None]
    files: dict[str, str] = {}
    if not done:
        return files
    for key in swept:
        xs = [r[key] for r in done]
        fig, ax = plt.subplots(figsize=(5, 3.6))
        if _numeric(xs) and swept[key].kind != "choice":
            ax.errorbar(xs, [r["top1"] for r in done], yerr=[r["top1_std"] or 0 for r in done], fmt="o", alpha=0.7,
                        capsize=3, label="trial (± std over student seeds)")
            levels, _ = _axis(xs)
            ax.plot(levels, [_mean([r["top1"] for r in done if r[key] == v]) for v in levels], "-", color="C1",
                    label="mean over trials")
            if swept[key].kind == "loguniform":
                ax.set_xscale("log")
        else:
            levels, labels = _axis(xs)
            pos = {json.dumps(v): i for i, v in enumerate(levels)}
            ax.scatter([pos[json.dumps(r[key])] for r in done], [r["top1"] for r in done], alpha=0.7, label="trial")
            ax.plot(range(len(levels)), [_mean([r["top1"] for r in done if r[key] == v]) for v in levels], "-",
                    color="C1", label="mean over trials")
            ax.set_xticks(range(len(levels)), labels)
        ax.set_xlabel(key)
        ax.set_ylabel("student test top-1 (%)")
        ax.legend(fontsize=7)
        files[f"plot_{key}"] = str(save_figure(fig, out / f"top1_vs_{key}.png"))
    keys = [k for k in swept if swept[k].kind in ("grid", "choice", "randint")]
    pair = ("alpha", "k") if {"alpha", "k"} <= set(keys) else tuple(keys[:2])
    if len(pair) == 2:
        files["heatmap"] = str(_heatmap(plt, save_figure, out, done, *pair))
    return files


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _heatmap(plt, save_figure, out: Path, done: list[dict], xkey: str, ykey: str) -> Path:
    xs, xlabels = _axis([r[xkey] for r in done])
    ys, ylabels = _axis([r[ykey] for r in done])
    grid = [[_mean([r["top1"] for r in done if r[xkey] == x and r[ykey] == y]) for x in xs] for y in ys]
    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2.5, 0.9 * len(ys) + 2))
    image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
    low, high = image.get_clim()
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if not math.isnan(value):  # dark text on the light (high) end of viridis
                light = high > low and (value - low) / (high - low) > 0.6
                ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="k" if light else "w", fontsize=9)
    ax.set_xticks(range(len(xs)), xlabels)
    ax.set_yticks(range(len(ys)), ylabels)
    ax.set_xlabel(xkey)
    ax.set_ylabel(ykey)
    ax.set_title("student test top-1 (%)")
    fig.colorbar(image, ax=ax)
    return save_figure(fig, out / f"heatmap_{xkey}_x_{ykey}.png")
