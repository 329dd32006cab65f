"""A sweep's plots: top-1 against each swept key (top1_vs_KEY.png) and a heat map of two swept
keys (alpha x k when both are swept).

Every trial that reported is drawn at its last top-1: finished trials as dots with error bars of
the std over their student seeds (where there are several), stopped and interrupted trials with
their own markers. The bar to beat is drawn across: random real images of the same classes and
IPC, on the trials' seeds (their mean, and a band of their std). A grid of numbers gets ticks at
its values; another key whose values are integers, ticks at integers only. The y axis spans at least `MIN_Y_SPAN` points of top-1 (more where
the seeds' spread is larger), and the heat map's colour scale at least `MIN_COLOUR_SPAN`, so that
differences inside the students' seed-to-seed noise do not fill the picture.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from tune.space import Param, shown_value

# The y axis of top1_vs_KEY.png spans at least this many points of top-1, and at least
# SPREADS_SHOWN times the median std over the seeds of a finished trial.
MIN_Y_SPAN, SPREADS_SHOWN = 10.0, 6.0
# The colour scale of the heat map spans at least this many points of top-1.
MIN_COLOUR_SPAN = 5.0
# How each state is drawn: (marker, colour, legend label). Errored and pending trials have no top-1.
_LOOK = {"stopped": ("x", "C3", "stopped by the scheduler (last top-1)"),
         "interrupted": ("+", "C7", "interrupted (last top-1)")}


def _numeric(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _integers(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _axis(values: list) -> tuple[list, list[str]]:
    """Sorted distinct values and their labels (a categorical axis for non-numbers)."""
    distinct = []
    for v in values:
        if v not in distinct:
            distinct.append(v)
    if _numeric(distinct):
        distinct.sort()
    return distinct, [shown_value(v) for v in distinct]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def span_range(values: list[float], min_span: float) -> tuple[float, float]:
    """The values' range, widened about its middle to at least `min_span` points and kept inside
    [0, 100]."""
    low, high = min(values), max(values)
    middle, half = (low + high) / 2, max(high - low, min_span) / 2
    low, high = middle - half, middle + half
    if low < 0:
        low, high = 0.0, high - low
    if high > 100:
        low, high = low - (high - 100), 100.0
    return max(0.0, low), high


def colour_range(values: list[float]) -> tuple[float, float]:
    """The heat map's colour scale: at least MIN_COLOUR_SPAN points wide, inside [0, 100]."""
    return span_range(values, MIN_COLOUR_SPAN)


def top1_range(shown: list[dict], random_real: list[float] | None = None) -> tuple[float, float]:
    """The y range of top1_vs_KEY.png: every value drawn (with its error bar, and the random real
    images' band), widened to at least MIN_Y_SPAN points and SPREADS_SHOWN median seed spreads."""
    values, spreads = [], []
    for r in shown:
        std = (r.get("top1_std") or 0.0) if r["state"] == "done" else 0.0
        values += [r["top1"] - std, r["top1"] + std]
        if r["state"] == "done" and r.get("top1_std"):
            spreads.append(r["top1_std"])
    if random_real:
        mean, std = statistics.fmean(random_real), statistics.stdev(random_real) if len(random_real) > 1 else 0.0
        values += [mean - std, mean + std]
    min_span = max(MIN_Y_SPAN, SPREADS_SHOWN * statistics.median(spreads) if spreads else 0.0)
    low, high = span_range(values, min_span)
    pad = 0.05 * (high - low)
    return max(0.0, low - pad), min(100.0, high + pad)


def plot_results(out: Path, rows: list[dict], swept: dict[str, Param], seeds: int = 1,
                 random_real: list[float] | None = None) -> dict[str, str]:
    """top1_vs_KEY.png for each swept key and a heat map (module docstring); `random_real`: the
    random real images' top-1 on the trials' seeds, drawn across."""
    from fadrm_ray.evaluation.report import pyplot, save_figure

    plt = pyplot()
    shown = [r for r in rows if r["state"] in ("done", "stopped", "interrupted") and r["top1"] is not None]
    files: dict[str, str] = {}
    if not shown:
        return files
    for key in swept:
        fig = key_figure(plt, key, swept[key], shown, seeds, random_real)
        files[f"plot_{key}"] = str(save_figure(fig, out / f"top1_vs_{key}.png"))
    keys = [k for k in swept if swept[k].kind in ("grid", "choice", "randint")]
    pair = ("alpha", "k") if {"alpha", "k"} <= set(keys) else tuple(keys[:2])
    if len(pair) == 2:
        files["heatmap"] = str(_heatmap(plt, save_figure, out, shown, *pair))
    return files


def key_figure(plt, key: str, param: Param, shown: list[dict], seeds: int, random_real: list[float] | None = None):
    """top-1 against one swept key: finished trials as dots with the mean over them, stopped and
    interrupted trials at their last top-1 with their own markers, random real images across."""
    from matplotlib.ticker import MaxNLocator

    levels, labels = _axis([r[key] for r in shown])
    numeric = _numeric(levels) and param.kind != "choice"
    pos = (lambda v: v) if numeric else (lambda v: levels.index(v))
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    if random_real:
        mean = statistics.fmean(random_real)
        std = statistics.stdev(random_real) if len(random_real) > 1 else 0.0
        label = (f"random real images, same classes and IPC ({mean:.1f}"
                 + (f" ± {std:.1f} std over {len(random_real)} seeds)" if len(random_real) > 1 else ", 1 seed)"))
        ax.axhline(mean, color="C2", linestyle="--", linewidth=1.2, label=label)
        if std:
            ax.axhspan(mean - std, mean + std, color="C2", alpha=0.12, linewidth=0)
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
    elif param.kind in ("grid", "choice") and len(levels) <= 12:  # ticks at the values swept, no others
        ax.set_xticks(levels, labels)
    elif _integers(levels):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(*top1_range(shown, random_real))
    ax.set_xlabel(key)
    ax.set_ylabel("student test top-1 (%)")
    ax.legend(fontsize=7)
    return fig


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
    xlabels, ylabels = [shown_value(x) for x in xs], [shown_value(y) for y in ys]
    values = [v for row in grid for v in row if not math.isnan(v)]
    low, high = colour_range(values)
    fig, ax = plt.subplots(figsize=(1.3 * len(xs) + 2.8, 0.9 * len(ys) + 2))
    image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto", vmin=low, vmax=high)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if not math.isnan(value):  # dark text on the light (high) end of viridis
                light = (value - low) / (high - low) > 0.6
                ax.text(j, i, f"{value:.1f}" + (f"\n{marks[i][j]}" if marks[i][j] else ""), ha="center",
                        va="center", color="k" if light else "w", fontsize=8)
    ax.set_xticks(range(len(xs)), xlabels)
    ax.set_yticks(range(len(ys)), ylabels)
    ax.set_xlabel(xkey)
    ax.set_ylabel(ykey)
    ax.set_title("student test top-1 (%): finished trials' mean;\n"
                 "cells marked stopped/interrupted: their last top-1", fontsize=8)
    bar = fig.colorbar(image, ax=ax)
    bar.set_label(f"top-1 (%), scale at least {MIN_COLOUR_SPAN:g} points wide", fontsize=8)
    return save_figure(fig, out / f"heatmap_{xkey}_x_{ykey}.png")
