"""Reports of a store run: the distilled images, the recover loss curves, the evaluation.

The last step of a run's life, after distill and evaluate: `report/` beside the run's images
(docs/architecture.md, "The store") holds

- `grid.png`: the distilled images, one row per class (with its name), one column per IPC index;
- `losses.png`: the teacher CE and BN-statistics losses of recover (docs/method.md section 3)
  over the global iteration count, stages concatenated, averaged over units, with a vertical
  line at every ARC merge (section 4), where the images jump back toward the real patch;
- `evaluation.json` (and `evaluation.png`, the student's test top-1 during training) when an
  evaluation result (evaluate.evaluate_run) is given.

A report describes the images the run held when it was written, so it is tied to them: the
evaluation records the run's content hash (`manifests.content_hash`), and `source.json` records
the one the figures were drawn from. When a unit is rewritten later (a rerun that repaired it),
the hash changes and `stale_reports` names the files that no longer describe the run. A file is
written only where its content would change: the figures and source.json where the images' hash
differs from the one source.json records (or a figure is missing), evaluation.json and its plot
where the result differs from the one kept (whether it was read from the cache aside), so that an
evaluation read whole from the caches leaves the report as it was.

Every function here takes the run already opened (a `RunReader`, or the `OpenedRun` of an
evaluation, whose images are then not read again).

Figures use matplotlib's Agg backend: reports are written on headless workers.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from pydantic import BaseModel

from fadrm_ray.fileio import atomic_write_text, read_model
from fadrm_ray.layout import RunLayout
from fadrm_ray.evaluation.eval_job import OpenedRun
from fadrm_ray.evaluation.fonts import drawable
from fadrm_ray.evaluation.scores import BaselineScore, Evaluation
from fadrm_ray.store.reader import RunReader
from fadrm_ray.store.manifests import content_hash
from fadrm_ray.store.records import utc_now


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write and close a figure (closing frees it: reports run inside long processes)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def report_files(run_dir: str | Path) -> dict[str, str]:
    """The report files that exist for a run (for `fadrm info`)."""
    return {k: str(p) for k, p in RunLayout(run_dir).report_files().items() if p.is_file()}


class ReportSource(BaseModel):
    """report/source.json: the images the figures were drawn from, and when."""

    content_hash: str | None = None
    written_at: str | None = None


def _recorded_hash(path: Path) -> str | None:
    """The content hash a report file records (source.json, or an evaluation.json)."""
    source = read_model(ReportSource, path)
    return None if source is None else source.content_hash


def stale_reports(run_dir: str | Path) -> dict[str, str]:
    """Report files that do not describe the run's images as they are now: name -> why."""
    layout = RunLayout(run_dir)
    files = layout.report_files()
    now = content_hash(layout)
    recorded = {"grid": _recorded_hash(layout.report_source), "losses": _recorded_hash(layout.report_source),
                "evaluation": _recorded_hash(files["evaluation"])}
    recorded["evaluation_plot"] = recorded["evaluation"]
    stale = {}
    for name, path in files.items():
        if not path.is_file() or recorded[name] == now:
            continue
        stale[name] = ("written before reports recorded the data they describe" if recorded[name] is None
                       else "the run's images changed since it was written")
    return stale


# --------------------------------------------------------------------------- image grid
def _reader(run: OpenedRun | RunReader) -> RunReader:
    return run.reader if isinstance(run, OpenedRun) else run


def write_grid(run: OpenedRun | RunReader, path: str | Path, max_classes: int = 20, max_ipc: int = 20) -> Path:
    """Rows = classes (at most `max_classes`, in class-index order), columns = IPC indices, of the
    opened run's images (an `OpenedRun`'s as it read them, a reader's read here)."""
    plt = pyplot()
    reader = _reader(run)
    if isinstance(run, OpenedRun):
        images, labels, ipcs = run.images, run.labels, run.ipc_index
    else:
        images, labels, ipcs = reader.read()
    path = Path(path)
    if labels.numel() == 0:
        return _message_png(path, "no images in this run yet")
    classes = sorted(set(labels.tolist()))[:max_classes]
    columns = sorted(set(ipcs.tolist()))[:max_ipc]
    c, h, w = images.shape[1:]
    pad = max(1, h // 16)
    mosaic = np.ones((len(classes) * (h + pad) + pad, len(columns) * (w + pad) + pad, 3), dtype=np.float32)
    col_of = {v: j for j, v in enumerate(columns)}
    row_of = {v: i for i, v in enumerate(classes)}
    for img, lab, ipc in zip(images, labels.tolist(), ipcs.tolist()):
        if lab not in row_of or ipc not in col_of:
            continue
        pixels = img.permute(1, 2, 0).numpy().astype(np.float32) / 255.0
        if c == 1:
            pixels = np.repeat(pixels, 3, axis=2)
        top, left = pad + row_of[lab] * (h + pad), pad + col_of[ipc] * (w + pad)
        mosaic[top:top + h, left:left + w] = pixels
    cell = 0.45 if h <= 32 else 0.9
    fig_w = max(4.0, 1.6 + cell * len(columns))
    fig_h = max(2.0, 0.9 + cell * len(classes))
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=120)
    ax.imshow(mosaic, interpolation="nearest")
    names = reader.class_names or [str(k) for k in range(max(classes) + 1)]
    ax.set_yticks([pad + i * (h + pad) + h / 2 - 0.5 for i in range(len(classes))])
    rows = drawable([f"{k}: {names[k]}" if k < len(names) else str(k) for k in classes])  # any script
    ax.set_yticklabels(rows.labels, fontsize=8, fontfamily=rows.family)
    ax.set_xticks([pad + j * (w + pad) + w / 2 - 0.5 for j in range(len(columns))])
    ax.set_xticklabels([str(v) for v in columns], fontsize=7)
    ax.set_xlabel("IPC index" + ("\n(\\uXXXX: a character of a class name\nthat no installed font has)"
                                 if rows.escaped else ""), fontsize=8 if rows.escaped else None)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    preset = reader.config.preset if reader.config is not None else ""
    shown = "" if len(set(labels.tolist())) <= max_classes and len(set(ipcs.tolist())) <= max_ipc else " (first rows/columns)"
    ax.set_title(f"{reader.run_id}  {preset}{shown}", fontsize=9)
    return save_figure(fig, path)


# --------------------------------------------------------------------------- loss curves
@dataclass(frozen=True)
class LossCurves:
    """CE and BN curves of recover over the global iteration (stages concatenated), averaged over
    every pack of every unit; the iterations after which an ARC merge happened; each stage as
    (start, end, resolution); the packs averaged."""

    ce: np.ndarray
    bn: np.ndarray
    merges: list[int]
    stages: list[tuple[int, int, int | None]]
    units: int


def loss_curves(reader: RunReader) -> LossCurves:
    """The opened run's `LossCurves`, from the loss history its unit manifests record."""
    ce_runs, bn_runs, merge_sets, stage_sets = [], [], [], []
    for manifest in reader.unit_manifests().values():
        for pack in manifest.stats.packs:
            ce, bn, merges, stages, t = [], [], [], [], 0
            for st in pack.stages:
                n = len(st.ce)
                ce.extend(st.ce)
                bn.extend(st.bn)
                stages.append((t, t + n, st.resolution))
                t += n
                if st.merged_after:
                    merges.append(t)
            if ce:
                ce_runs.append(ce)
                bn_runs.append(bn)
                merge_sets.append(tuple(merges))
                stage_sets.append(stages)
    if not ce_runs:
        return LossCurves(np.zeros(0), np.zeros(0), [], [], 0)
    length = max(len(c) for c in ce_runs)

    def mean(runs):
        a = np.full((len(runs), length), np.nan)
        for i, r in enumerate(runs):
            a[i, :len(r)] = r
        return np.nanmean(a, axis=0)

    merges = sorted({m for s in merge_sets for m in s})
    return LossCurves(mean(ce_runs), mean(bn_runs), merges, stage_sets[0], len(ce_runs))


def trend(y: np.ndarray, stages: list, fraction: float = 0.05) -> np.ndarray:
    """A moving mean of the per-step losses `y` over a window of about `fraction` of the run (at
    least 5 steps), taken within each stage (`stages`: (start, end, resolution), end exclusive)
    so that an ARC merge's jump stays a jump; the window shrinks at a stage's ends."""
    y = np.asarray(y, dtype=float)
    out = np.full_like(y, np.nan)
    half = max(2, int(len(y) * fraction) // 2)
    for start, end, _ in stages or [(0, len(y), None)]:
        seg = y[start:end]
        ok = np.isfinite(seg)
        sums = np.concatenate([[0.0], np.cumsum(np.where(ok, seg, 0.0))])
        counts = np.concatenate([[0], np.cumsum(ok)])
        lo = np.clip(np.arange(len(seg)) - half, 0, len(seg))
        hi = np.clip(np.arange(len(seg)) + half + 1, 0, len(seg))
        with np.errstate(invalid="ignore", divide="ignore"):
            out[start:end] = (sums[hi] - sums[lo]) / (counts[hi] - counts[lo])
    return out


def write_losses(reader: RunReader, path: str | Path) -> Path:
    """The recover losses of the opened run (`loss_curves`), drawn into `path`."""
    plt = pyplot()
    curves = loss_curves(reader)
    path = Path(path)
    if curves.units == 0:
        return _message_png(path, "no recover iterations in this run\n(selection-only method, or no unit finished)")
    fig, axes = plt.subplots(2, 1, figsize=(7, 5), dpi=120, sharex=True)
    x = np.arange(1, len(curves.ce) + 1)
    for ax, y, label, color in ((axes[0], curves.ce, "teacher cross-entropy", "tab:blue"),
                                (axes[1], curves.bn, "BN statistics loss", "tab:orange")):
        ax.plot(x, y, color=color, lw=0.6, alpha=0.3, label="each step")
        ax.plot(x, trend(y, curves.stages), color=color, lw=1.6, label="trend (moving mean, per stage)")
        if np.all(y[np.isfinite(y)] > 0):
            ax.set_yscale("log")
        ax.set_ylabel(label)
        for i, m in enumerate(curves.merges):
            ax.axvline(m + 0.5, color="tab:red", ls="--", lw=0.9, label="ARC merge" if i == 0 else None)
        ax.grid(alpha=0.3)
    for start, end, res in curves.stages:
        axes[0].annotate(f"{res}px", xy=((start + end) / 2 + 0.5, 1.0), xycoords=("data", "axes fraction"),
                         ha="center", va="bottom", fontsize=7)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[1].set_xlabel("iteration (stages concatenated)")
    fig.suptitle(f"recover losses, mean of {curves.units} batch(es): {reader.run_dir.name}", fontsize=9)
    return save_figure(fig, path)


# --------------------------------------------------------------------------- evaluation
def write_evaluation_plot(evaluation: Evaluation, path: str | Path) -> Path | None:
    """The student's test top-1 during training, one line per seed; beside it, when the
    evaluation has baselines (baselines.py), the run's final top-1 against theirs, with
    DD-Ranking's scores (ranking.py) under them."""
    if not any(evaluation.curves):
        return None
    plt = pyplot()
    baselines = {k: v for k, v in evaluation.baselines.items() if v.top1_mean is not None}
    fig, axes = plt.subplots(1, 2 if baselines else 1, figsize=(10 if baselines else 6, 3.6), dpi=120,
                             squeeze=False, gridspec_kw={"width_ratios": [3, 2]} if baselines else None)
    ax = axes[0][0]
    for seed, curve in zip(evaluation.seeds, evaluation.curves):
        if curve:
            e, acc = zip(*curve)
            ax.plot(e, acc, marker="o", ms=3, lw=1, label=f"seed {seed}")
    ax.set_xlabel("student epoch")
    ax.set_ylabel("test top-1 (%)" if evaluation.classes is None else
                  f"test top-1 on its {len(evaluation.classes)} classes (%)")
    ax.set_title(f"student {evaluation.student}: final top-1 {evaluation.top1_mean:.2f} ± {evaluation.top1_std:.2f}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if baselines:
        _baseline_bars(axes[0][1], evaluation, baselines)
    if evaluation.warnings:  # the set is clearly below random real images: said above the charts
        import textwrap

        text = "\n".join(textwrap.fill(line, 130) for line in evaluation.warnings)
        fig.suptitle(text, fontsize=8, color="tab:red", ha="left", x=0.01)
    return save_figure(fig, path)


def _baseline_bars(ax, evaluation: Evaluation, baselines: dict[str, BaselineScore]) -> None:
    """Final top-1 of the run and of each baseline: bars at the mean, dots per seed, gains above."""
    from fadrm_ray.evaluation.baselines import BASELINES
    from fadrm_ray.paired import gain_text

    # (gain, its label) per baseline; an evaluation.json written before paired gains were
    # recorded has the plain gain only.
    labels = {k: (g.mean, gain_text(g, seeds=False)) for k, g in evaluation.paired_gains.items()}
    labels.update({k: (g, f"{g:+.2f}") for k, g in evaluation.gains.items() if k not in labels})
    rows = [("this run", evaluation.brief(), None)]
    hard = evaluation.ranking.hard_top1_per_seed if evaluation.ranking is not None else []
    if hard:  # the same images without the teacher: what the soft labels add
        rows.append(("this run,\nhard labels", SimpleNamespace(
            top1_mean=statistics.fmean(hard), top1_std=statistics.stdev(hard) if len(hard) > 1 else 0.0,
            top1_per_seed=list(hard)), None))
    rows += [(BASELINES.get(k, k), v, k) for k, v in baselines.items()]
    colors = ["tab:blue", "tab:cyan", "tab:gray", "tab:olive"] if hard else ["tab:blue", "tab:gray", "tab:olive"]
    tops = [max([ev.top1_mean + (ev.top1_std or 0), *ev.top1_per_seed]) for _, ev, _ in rows]
    for i, (label, ev, key) in enumerate(rows):
        ax.bar(i, ev.top1_mean, yerr=ev.top1_std or 0, color=colors[i % len(colors)], capsize=3, alpha=0.8)
        ax.plot([i] * len(ev.top1_per_seed), ev.top1_per_seed, "k.", ms=4)
        if key in labels:  # above the error bar and the seeds' dots, so that neither hides it
            gain, text = labels[key]
            ax.annotate(text, (i, tops[i]), xytext=(0, 5), textcoords="offset points",
                        ha="center", fontsize=8, color="tab:green" if gain >= 0 else "tab:red")
    for i, (_, ev, _) in enumerate(rows):  # the value itself, inside its bar
        ax.annotate(f"{ev.top1_mean:.1f}", (i, ev.top1_mean / 2), ha="center", va="center", fontsize=8, color="white")
    # The axis starts at zero: a bar's height is its accuracy, so gaps look as large as they are.
    # Room above the highest error bar or seed for its gain's label.
    ax.set_ylim(0.0, min(108.0, max(tops) + max(6.0, 0.08 * max(tops))))
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0] for r in rows], fontsize=8, rotation=15)
    ax.set_title("final top-1 against the baselines\n(this run minus the baseline, seed by seed: mean ± s.e.)",
                 fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    if evaluation.ranking is not None:  # DD-Ranking's scores under the bars (ranking.py)
        from fadrm_ray.evaluation.ranking import ranking_text

        ax.set_xlabel("DD-Ranking: " + ranking_text(evaluation.ranking).replace(", IOR", ",\nIOR"), fontsize=8)


def _message_png(path: Path, message: str) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 2), dpi=120)
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=10)
    return save_figure(fig, path)


def write_report(run: OpenedRun | RunReader, evaluation: Evaluation | None = None, max_classes: int = 20,
                 max_ipc: int = 20) -> dict[str, str]:
    """Write the opened run's `report/` and return {name: path} of every report file there.

    `run`: the run's reader, or the run as an evaluation opened it (nothing is read twice). Only
    files whose content would change are written (module docstring). Without `evaluation`, an
    evaluation.json written before is kept (and listed; `stale_reports` says whether it still
    describes the run).
    """
    reader = _reader(run)
    layout = reader.layout
    files = layout.report_files()
    # Before drawing: a unit rewritten meanwhile makes the report stale. A run read whole for the
    # evaluation has its hash already (the same unit manifests give it).
    source = run.content_hash if isinstance(run, OpenedRun) and reader.ipc is None else content_hash(layout)
    figures = (files["grid"], files["losses"])
    if _recorded_hash(layout.report_source) != source or not all(f.is_file() for f in figures):
        layout.report_dir.mkdir(parents=True, exist_ok=True)
        # The report shows the whole run: a run evaluated at a smaller IPC is shown at every IPC it holds.
        whole = run if reader.ipc is None else RunReader(reader.layout, reader.config, reader.manifest)
        write_grid(whole, files["grid"], max_classes, max_ipc)
        write_losses(reader, files["losses"])
        written = ReportSource(content_hash=source, written_at=utc_now())
        atomic_write_text(layout.report_source, written.model_dump_json())
    if evaluation is not None and not _kept(evaluation, files["evaluation"], files["evaluation_plot"]):
        layout.report_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(files["evaluation"], evaluation.model_dump_json(indent=2))
        write_evaluation_plot(evaluation, files["evaluation_plot"])
    return report_files(layout.run_dir)


def _kept(evaluation: Evaluation, path: Path, plot: Path) -> bool:
    """Whether `path` holds `evaluation` already (whether either was read from the cache aside),
    with its plot beside it where it has one."""
    kept = read_model(Evaluation, path)
    if kept is None or kept.model_copy(update={"cached": evaluation.cached}) != evaluation:
        return False
    return plot.is_file() or not any(evaluation.curves)
