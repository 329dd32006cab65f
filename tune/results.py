"""What a sweep leaves a person: results.csv, results.md, best.yaml and PNG plots, and one line
per ended trial while it runs.

One row per trial of the whole sweep: its swept values, the students' test top-1 (mean ± std
over the student seeds; for a trial that did not finish, its last intermediate top-1 and how far
its students got), distill and student seconds, state, the node it ran on and its run in the
store. The states are kept apart: `done` (ran to the end), `stopped` (ASHA ended it at a rung),
`error`, `interrupted` (running when the sweep was interrupted) and `pending` (not started).
`best.yaml` is the best finished trial's whole config (`DistillConfig.to_dict` of the config the
trial built with `make_config`), which `fadrm distill --config best.yaml` runs as it is; an
interrupted sweep writes none. Plots: top-1 against each swept key and a heat map of two swept
keys (alpha x k when both are swept), every trial that reported drawn at its last top-1, with
stopped and interrupted trials marked apart.
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict
from ray.tune import Callback

from tune.settings import TIME_ATTR, TrialReport
from tune.space import Param, _show, trial_config

COLUMNS = ("top1", "top1_std", "top1_per_seed", TIME_ATTR, "distill_seconds", "student_seconds", "trial_seconds", "state",
           "node_id",
           "host", "run_id", "units_run", "patches_scored", "error", "vs_random", "below_random")
STATES = ("done", "stopped", "error", "interrupted", "pending")
State = Literal[STATES]


class TrialRow(BaseModel):
    """One trial of the whole sweep, as results.csv, results.md, the plots and summary.json show it
    (`flat()`): its swept values, what its last TrialReport said, its state, and the comparison
    with random real images (tune.sweep.mark_below_random sets `vs_random` and `below_random`)."""

    model_config = ConfigDict(extra="forbid")

    trial: str                          # Tune's trial id; "" for a trial Tune had not made yet
    values: dict[str, Any]              # swept key -> the trial's value (None: not drawn yet)
    state: State
    top1: float | None = None
    top1_std: float | None = None
    top1_per_seed: list[float] | None = None
    student_pct: float | None = None    # TIME_ATTR
    distill_seconds: float | None = None
    student_seconds: float | None = None
    trial_seconds: float | None = None
    node_id: str | None = None
    host: str | None = None
    run_id: str | None = None
    units_run: int | None = None
    patches_scored: int | None = None
    error: str | None = None
    vs_random: str | None = None        # baselines.gain_text of the paired gain over random real images
    below_random: bool | None = None    # clearly below them (more than two standard errors)

    @classmethod
    def of(cls, trial: str, values: dict[str, Any], state: State, report: TrialReport | None,
           error: str | None = None) -> "TrialRow":
        reported = report.model_dump(include=set(cls.model_fields)) if report is not None else {}
        return cls(trial=trial, values=values, state=state, error=error, **reported)

    def flat(self) -> dict[str, Any]:
        """The row as the tables show it: trial, each swept key, then COLUMNS."""
        return {"trial": self.trial, **self.values, **{col: getattr(self, col) for col in COLUMNS}}


assert set(COLUMNS) <= set(TrialRow.model_fields)
# The colour scale of the heat map spans at least this many points of top-1, so that a spread
# smaller than the students' seed-to-seed noise does not fill the whole scale.
MIN_COLOUR_SPAN = 5.0


def _values(config: dict, swept: dict[str, Param]) -> str:
    return " ".join(f"{k}={_show(config.get(k))}" for k in swept)


_active: list["SweepProgress"] = []


def _restored_progress() -> "SweepProgress":
    """What a pickled SweepProgress becomes (see SweepProgress.__reduce__)."""
    return _active[-1] if _active else SweepProgress({}, 0, enabled=False)


class SweepProgress(Callback):
    """One line on stderr per trial that ends, counted against every trial of the sweep; and each
    trial's Tune status at the end of the controller's last step. That is the status to trust:
    when a fit is interrupted, Tune's clean-up then marks the running trials TERMINATED, the
    status of the trials that finished or that ASHA stopped."""

    def __init__(self, swept: dict[str, Param], total: int, enabled: bool = True):
        self.swept, self.total, self.enabled = swept, total, enabled
        self.ended: int | None = None
        self.statuses: dict[str, str] = {}

    def activate(self) -> "SweepProgress":
        _active[:] = [self]
        return self

    def __reduce__(self):
        # Tune pickles the RunConfig (and so its callbacks) with the experiment, and Tuner.restore
        # unpickles it: the restored Tuner then calls the callback this driver activated, with
        # this run's total and progress setting, and the driver can read its statuses.
        return _restored_progress, ()

    def on_step_end(self, iteration, trials, **info):
        if self.ended is None:  # trials a resumed sweep had already ended count as ended
            self.ended = sum(t.status in ("TERMINATED", "ERROR") for t in trials)
        self.statuses = {t.trial_id: t.status for t in trials}

    def _say(self, trial, text: str) -> None:
        self.ended = (self.ended or 0) + 1
        if self.enabled:
            print(f"fadrm tune: {self.ended}/{self.total} trial {trial.trial_id} "
                  f"{_values(trial.config, self.swept)}: {text}",
                  file=sys.stderr, flush=True)

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = TrialReport.from_metrics(trial.last_result)
        if r is not None and r.final:
            text = (f"top-1 {r.top1:.2f} ± {r.top1_std or 0:.2f} (distill {r.distill_seconds:.0f} s, "
                    f"student {r.student_seconds or 0:.0f} s) on {r.host}")
        elif r is not None:
            text = f"stopped at {r.student_pct:.0f}% of the student schedule (top-1 {r.top1:.2f})"
        else:
            text = "ended without a report"
        self._say(trial, text)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._say(trial, "error (see results.csv)")


def _state(error, report: TrialReport | None, status: str | None) -> State:
    if error:
        return "error"
    if status in ("RUNNING", "PAUSED") or (status == "PENDING" and report is not None):
        return "interrupted"
    if status == "PENDING" or report is None:
        return "pending"
    return "done" if report.final else "stopped"


def collect_rows(grid, p, statuses: dict[str, str]) -> list[TrialRow]:
    """One row per trial of the whole sweep, in trial order: the trials of a Tune ResultGrid
    (each one's last TrialReport), labelled by their `statuses` (SweepProgress), then a `pending`
    row for each grid point Tune had not made a trial for yet (an interrupted sweep)."""
    swept = p.swept
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        report = TrialReport.from_metrics(metrics)
        trial = metrics.get("trial_id") or Path(result.path).name.removeprefix("trial_")  # Tune's own key
        error = " ".join(str(result.error).split())[:300] if result.error else None
        rows.append(TrialRow.of(trial, {k: result.config.get(k) for k in swept},
                                _state(result.error, report, statuses.get(trial)), report, error))
    rows.sort(key=lambda r: r.trial)
    return rows + not_made(rows, swept, p.request.search, p.request.sample_count)


def not_made(rows: list[TrialRow], swept: dict[str, Param], search: str, samples: int) -> list[TrialRow]:
    """A pending row for each trial of the sweep that has no Tune trial yet: the grid points
    (x samples) that no trial holds, or the random samples not drawn."""
    grid_keys = [k for k, q in swept.items() if q.kind == "grid"] if search == "grid" else []
    wanted = [dict(zip(grid_keys, combo)) for combo in itertools.product(*(swept[k].values for k in grid_keys))]
    missing = []
    for point in wanted:
        have = sum(all(r.values.get(k) == v for k, v in point.items()) for r in rows)
        missing += [point] * max(0, samples - have)
    return [TrialRow(trial="", values={**{k: None for k in swept}, **point}, state="pending") for point in missing]


def best_row(rows: list[dict]) -> dict | None:
    done = [r for r in rows if r["state"] == "done" and r["top1"] is not None]
    return max(done, key=lambda r: r["top1"]) if done else None


def write_results(p, trial_rows: list[TrialRow], interrupted: bool = False) -> tuple[dict, dict | None]:
    """Write every file of the sweep's results into OUT; returns ({name: path}, the best finished
    trial). An interrupted sweep gets no best.yaml: its best so far is not the sweep's best."""
    out, swept = p.out, p.swept
    rows = [r.flat() for r in trial_rows]
    seeds = len(p.eval_cfg.seed_list)
    files = {"results_csv": str(_write_csv(out / "results.csv", rows, swept)),
             "results_md": str(_write_md(out / "results.md", rows, swept, p, interrupted))}
    best = best_row(rows)
    if best is not None:
        cfg = trial_config(p.base, {k: best[k] for k in swept})
        if not interrupted:
            text = (f"# best trial {best['trial']} of the sweep in {out}: test top-1 {best['top1']:.2f} ± "
                    f"{best['top1_std'] or 0:.2f}\n# fadrm distill --config best.yaml --dataset {p.request.dataset} "
                    f"--teacher TEACHER --out STORE\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            (out / "best.yaml").write_text(text)
            files["best_yaml"] = str(out / "best.yaml")
        best = {**best, "config": cfg.to_dict()}
    files.update(plot_results(out, rows, swept, seeds))
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


def _top1_text(r: dict, seeds: int) -> str:
    if r["top1"] is None:
        return ""
    if r["state"] == "done":
        return f"{r['top1']:.2f} ± {r['top1_std'] or 0:.2f}" if seeds > 1 else f"{r['top1']:.2f}"
    return f"({r['top1']:.2f} at {r[TIME_ATTR] or 0:.0f}%)"


def _write_md(path: Path, rows: list[dict], swept: dict, p, interrupted: bool) -> Path:
    counts = {s: sum(r["state"] == s for r in rows) for s in STATES}
    seeds = len(p.eval_cfg.seed_list)
    lines = []
    if interrupted:
        lines += [f"**Interrupted**: {counts['done']} of {len(rows)} trials finished, {counts['stopped']} stopped by "
                  f"the scheduler, {counts['error']} errored, {counts['interrupted']} interrupted, {counts['pending']} "
                  f"not started; the same command resumes the sweep. No best.yaml is written from a partial sweep.", ""]
    head = ["trial", *swept, "top-1 (%)", "vs random real", "distill s", "student s", "state", "node"]
    lines += [f"Sweep of {', '.join(swept) or 'nothing'} on {p.request.dataset}, preset {p.request.preset}, "
              f"IPC {p.base.ipc or 'default'}; student {p.eval_cfg.student}, seeds {p.eval_cfg.seed_list}, "
              f"protocol {p.eval_cfg.protocol}.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        node = f"{r['host'] or ''} {str(r['node_id'] or '')[:8]}".strip()
        lines.append("| " + " | ".join([r["trial"] or "-", *(_show(r[k]) if r[k] is not None or r["state"] != "pending"
                                                               else "-" for k in swept), _top1_text(r, seeds),
                                        (r["vs_random"] or "") + (" **below**" if r["below_random"] else ""),
                                        _cell(r["distill_seconds"]), _cell(r["student_seconds"]), r["state"],
                                        node]) + " |")
    lines += ["", "top-1: the mean" + (" ± std over the student seeds" if seeds > 1 else " of one student seed")
              + " for a finished trial; (the last intermediate top-1 at N% of the students' schedule) for the others. "
              "States: done (ran to the end), stopped (the scheduler ended it at a rung), error, interrupted "
              "(running when the sweep was interrupted), pending (not started). vs random real: the trial's top-1 "
              "minus that of random real images of the same classes and IPC, seed by seed (mean ± s.e.); **below**: "
              "below them by more than two standard errors, a set worse than picking images at random."]
    best = best_row(rows)
    if best is not None:
        label = "Best so far" if interrupted else "Best"
        lines += ["", f"{label}: trial {best['trial']} ({_values(best, swept)}), top-1 {_top1_text(best, seeds)}"
                      + ("." if interrupted else "; its config is best.yaml.")]
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------- plots
# How each state is drawn: (marker, colour, legend label). Errored and pending trials have no top-1.
_LOOK = {"stopped": ("x", "C3", "stopped by the scheduler (last top-1)"),
         "interrupted": ("+", "C7", "interrupted (last top-1)")}


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


def plot_results(out: Path, rows: list[dict], swept: dict[str, Param], seeds: int = 1) -> dict[str, str]:
    """top1_vs_KEY.png for each swept key and a heat map: every trial that reported, at its last
    top-1; finished trials as dots (with their seeds' std when there are several), stopped and
    interrupted ones with their own markers."""
    from fadrm_ray.evaluation.report import pyplot, save_figure

    plt = pyplot()
    shown = [r for r in rows if r["state"] in ("done", "stopped", "interrupted") and r["top1"] is not None]
    files: dict[str, str] = {}
    if not shown:
        return files
    for key in swept:
        fig = key_figure(plt, key, swept[key], shown, seeds)
        files[f"plot_{key}"] = str(save_figure(fig, out / f"top1_vs_{key}.png"))
    keys = [k for k in swept if swept[k].kind in ("grid", "choice", "randint")]
    pair = ("alpha", "k") if {"alpha", "k"} <= set(keys) else tuple(keys[:2])
    if len(pair) == 2:
        files["heatmap"] = str(_heatmap(plt, save_figure, out, shown, *pair))
    return files


def key_figure(plt, key: str, param: Param, shown: list[dict], seeds: int):
    """top-1 against one swept key: finished trials as dots with the mean over them, stopped and
    interrupted trials at their last top-1 with their own markers."""
    levels, labels = _axis([r[key] for r in shown])
    numeric = _numeric(levels) and param.kind != "choice"
    pos = (lambda v: v) if numeric else (lambda v: levels.index(v))
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    done = [r for r in shown if r["state"] == "done"]
    if done:
        label = (f"finished trial (mean ± std over {seeds} student seeds)" if seeds > 1
                 else "finished trial (1 student seed)")
        ax.errorbar([pos(r[key]) for r in done], [r["top1"] for r in done],
                    yerr=[r["top1_std"] or 0 for r in done] if seeds > 1 else None, fmt="o", alpha=0.7,
                    capsize=3, label=label)
        means = [(pos(v), _mean([r["top1"] for r in done if r[key] == v])) for v in levels]
        means = [(x, y) for x, y in means if not math.isnan(y)]
        ax.plot([x for x, _ in means], [y for _, y in means], "-", color="C1", label="mean over finished trials")
    for state, (marker, colour, label) in _LOOK.items():
        some = [r for r in shown if r["state"] == state]
        if some:
            ax.scatter([pos(r[key]) for r in some], [r["top1"] for r in some], marker=marker, color=colour,
                       s=40, label=label)
    if numeric and param.kind == "loguniform":
        ax.set_xscale("log")
    if not numeric:
        ax.set_xticks(range(len(levels)), labels)
    ax.set_xlabel(key)
    ax.set_ylabel("student test top-1 (%)")
    ax.legend(fontsize=7)
    return fig


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def colour_range(values: list[float]) -> tuple[float, float]:
    """The heat map's colour scale: the values' range, widened about its middle to at least
    MIN_COLOUR_SPAN points and kept inside [0, 100]."""
    low, high = min(values), max(values)
    middle, half = (low + high) / 2, max(high - low, MIN_COLOUR_SPAN) / 2
    low, high = middle - half, middle + half
    if low < 0:
        low, high = 0.0, high - low
    if high > 100:
        low, high = low - (high - 100), 100.0
    return max(0.0, low), high


def heatmap_cells(shown: list[dict], xkey: str, ykey: str) -> tuple[list, list, list[list[float]], list[list[str]]]:
    """(x levels, y levels, top-1 per cell, mark per cell): a cell holds the mean top-1 of its
    finished trials, or, when none finished, the mean last top-1 of its stopped or interrupted
    ones, marked with their states; NaN where no trial reported."""
    xs, _ = _axis([r[xkey] for r in shown])
    ys, _ = _axis([r[ykey] for r in shown])
    grid, marks = [], []
    for y in ys:
        grid.append([])
        marks.append([])
        for x in xs:
            cell = [r for r in shown if r[xkey] == x and r[ykey] == y]
            done = [r["top1"] for r in cell if r["state"] == "done"]
            grid[-1].append(_mean(done or [r["top1"] for r in cell]))
            marks[-1].append("" if done or not cell else "/".join(sorted({r["state"] for r in cell})))
    return xs, ys, grid, marks


def _heatmap(plt, save_figure, out: Path, shown: list[dict], xkey: str, ykey: str) -> Path:
    xs, ys, grid, marks = heatmap_cells(shown, xkey, ykey)
    xlabels, ylabels = [_show(x) for x in xs], [_show(y) for y in ys]
    values = [v for row in grid for v in row if not math.isnan(v)]
    low, high = colour_range(values)
    fig, ax = plt.subplots(figsize=(1.3 * len(xs) + 2.8, 0.9 * len(ys) + 2))
    image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto", vmin=low, vmax=high)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if not math.isnan(value):  # dark text on the light (high) end of viridis
                light = (value - low) / (high - low) > 0.6
                ax.text(j, i, f"{value:.1f}" + (f"\n{marks[i][j]}" if marks[i][j] else ""), ha="center", va="center", color="k" if light else "w",
                        fontsize=8)
    ax.set_xticks(range(len(xs)), xlabels)
    ax.set_yticks(range(len(ys)), ylabels)
    ax.set_xlabel(xkey)
    ax.set_ylabel(ykey)
    ax.set_title("student test top-1 (%): finished trials' mean;\n"
                 "cells marked stopped/interrupted: their last top-1", fontsize=8)
    bar = fig.colorbar(image, ax=ax)
    bar.set_label(f"top-1 (%), scale at least {MIN_COLOUR_SPAN:g} points wide", fontsize=8)
    return save_figure(fig, out / f"heatmap_{xkey}_x_{ykey}.png")
