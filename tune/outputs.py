"""What a sweep leaves a person in OUT: results.csv, results.md, best.yaml, the plots
(tune.plots) and summary.json (`SweepSummary`).

results.md has one row per trial (tune.results), then each failed trial's error in one line
and the file with its traceback, then the confirmation of the best trials (tune.confirm):
whether the best is above the runner-up and above random real images by more than two
standard errors, or level with them. `best.yaml` is the best trial's whole config
(`DistillConfig.to_dict` of the config the trial built with `make_config`), which `fadrm
distill --config best.yaml` runs as it is. An interrupted sweep (a SIGINT at any moment: before
Ray is up, before any trial started, mid-trial, during the confirmation, while these files are
written) gets results.md marked so on its first line and a summary.json with `interrupted`, and
no best.yaml (one an earlier run of the sweep wrote is removed: it is not this state's best);
the same command resumes it.
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict

from fadrm_ray.fileio import atomic_write_text

from tune.confirm import Confirmation
from tune.plots import plot_results
from tune.results import COLUMNS, STATES, TrialRow
from tune.settings import TIME_ATTR
from tune.space import shown_value, shown_values, trial_config

if TYPE_CHECKING:
    from tune.prepare import Prepared

BEST = "best.yaml"


class FailedTrial(BaseModel):
    """A trial that failed: its values, what it raised in one line, and where its traceback is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trial: str
    values: dict[str, Any]
    error: str
    log: str | None = None


class SweepSummary(BaseModel):
    """summary.json, and what `fadrm tune --json` prints."""

    model_config = ConfigDict(extra="forbid")

    out: str
    experiment: str
    store: str
    ray_session: str | None = None      # OUT/ray, where the sweep's own Ray kept its session and logs
    ray_log: str | None = None          # OUT/ray.log: Ray's and Tune's own lines (None: on the terminal, --verbose)
    resumed: bool = False
    interrupted: bool = False
    interrupted_during: str | None = None
    trials: int
    trials_total: int
    states: dict[str, int]
    configs_checked: int = 0
    swept: dict[str, str]
    patches: dict[str, float] = {}
    random_real: str = ""
    confirm_seeds: int = 0
    confirmation: Confirmation | None = None
    wall_seconds: float
    best: dict[str, Any] | None = None
    best_so_far: dict[str, Any] | None = None
    failed: list[FailedTrial] = []
    files: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    pilot: dict[str, Any] | None = None
    resume: str | None = None

    @property
    def finished(self) -> int:
        return self.states.get("done", 0)


def failures(rows: list[TrialRow]) -> list[FailedTrial]:
    return [FailedTrial(trial=r.trial, values=r.values, error=r.error or "failed (no error was kept)", log=r.log)
            for r in rows if r.state == "error"]


def _best(rows: list[dict], confirmation: Confirmation | None) -> dict | None:
    done = [r for r in rows if r["state"] == "done" and r["top1"] is not None]
    if confirmation is not None:
        chosen = [r for r in done if r["trial"] == confirmation.best]
        if chosen:
            return chosen[0]
    return max(done, key=lambda r: r["top1"]) if done else None


def write_results(p: "Prepared", trial_rows: list[TrialRow], interrupted: bool = False,
                  confirmation: Confirmation | None = None, random_real: list[float] | None = None,
                  during: str | None = None) -> tuple[dict, dict | None]:
    """Write every file of the sweep's results into OUT; returns ({name: path}, the best trial:
    the confirmation's, else the best finished one). An interrupted sweep gets no best.yaml: its
    best so far is not the sweep's best."""
    out, swept = p.out, p.swept
    out.mkdir(parents=True, exist_ok=True)
    if interrupted:
        (out / BEST).unlink(missing_ok=True)
    rows = [r.flat() for r in trial_rows]
    seeds = len(p.eval_cfg.seed_list)
    best = _best(rows, confirmation)
    files = {"results_csv": str(_write_csv(out / "results.csv", rows, swept)),
             "results_md": str(_write_md(out / "results.md", trial_rows, p, interrupted, confirmation, best, during))}
    if best is not None:
        cfg = trial_config(p.base, {k: best[k] for k in swept})
        if not interrupted:
            atomic_write_text(out / BEST, _best_yaml(p, best, confirmation) + yaml.safe_dump(cfg.to_dict(),
                                                                                             sort_keys=False))
            files["best_yaml"] = str(out / BEST)
        best = {**best, "config": cfg.to_dict()}
    files.update(plot_results(out, rows, swept, seeds, random_real))
    return files, best


def _best_yaml(p: "Prepared", best: dict, confirmation: Confirmation | None) -> str:
    head = f"# best trial {best['trial']} of the sweep in {p.out}: test top-1 "
    chosen = confirmation.trials[0] if confirmation is not None else None
    if chosen is not None and confirmation.new_seeds:
        spread = f" ± {chosen.stderr:.2f} s.e." if chosen.stderr is not None else ""
        head += f"{chosen.mean:.2f}{spread} on student seeds {', '.join(map(str, confirmation.seeds))} (confirmed)\n"
    else:
        head += f"{best['top1']:.2f} ± {best['top1_std'] or 0:.2f}\n"
    return head + (f"# fadrm distill --config best.yaml --dataset {p.request.dataset} --teacher TEACHER "
                   f"--out STORE\n")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if not math.isnan(value) else "nan"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _write_csv(path: Path, rows: list[dict], swept: dict) -> Path:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=["trial", *swept, *COLUMNS])
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(v) for k, v in row.items()})
    return atomic_write_text(path, text.getvalue())


def _top1_text(r: dict, seeds: int) -> str:
    if r["top1"] is None:
        return ""
    if r["state"] == "done":
        return f"{r['top1']:.2f} ± {r['top1_std'] or 0:.2f}" if seeds > 1 else f"{r['top1']:.2f}"
    return f"({r['top1']:.2f} at {r[TIME_ATTR] or 0:.0f}%)"


def interrupted_line(counts: dict[str, int], total: int, during: str | None) -> str:
    when = f" {during}" if during else ""
    return (f"**Interrupted**{when}: {counts['done']} of {total} trials finished, {counts['stopped']} stopped by "
            f"the scheduler, {counts['error']} errored, {counts['interrupted']} interrupted, {counts['pending']} "
            f"not started; the same command resumes the sweep. No best.yaml is written from a partial sweep.")


def _write_md(path: Path, trial_rows: list[TrialRow], p: "Prepared", interrupted: bool,
              confirmation: Confirmation | None, best: dict | None, during: str | None) -> Path:
    rows = [r.flat() for r in trial_rows]
    swept = p.swept
    counts = {s: sum(r["state"] == s for r in rows) for s in STATES}
    seeds = len(p.eval_cfg.seed_list)
    lines = [interrupted_line(counts, len(rows), during), ""] if interrupted else []
    head = ["trial", *swept, "top-1 (%)", "vs random real", "distill s", "student s", "state", "node"]
    lines += [f"Sweep of {', '.join(swept) or 'nothing'} on {p.request.dataset}, preset {p.request.preset}, "
              f"IPC {p.base.ipc or 'default'}; student {p.eval_cfg.student}, seeds {p.eval_cfg.seed_list}, "
              f"protocol {p.eval_cfg.protocol}.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        node = f"{r['host'] or ''} {str(r['node_id'] or '')[:8]}".strip()
        values = (shown_value(r[k]) if r[k] is not None or r["state"] != "pending" else "-" for k in swept)
        lines.append("| " + " | ".join([r["trial"] or "-", *values, _top1_text(r, seeds),
                                        (r["vs_random"] or "") + (" **below**" if r["below_random"] else ""),
                                        _cell(r["distill_seconds"]), _cell(r["student_seconds"]), r["state"],
                                        node]) + " |")
    lines += ["", "top-1: the mean" + (" ± std over the student seeds" if seeds > 1 else " of one student seed")
              + " for a finished trial; (the last intermediate top-1 at N% of the students' schedule) for the others. "
              "States: done (ran to the end), stopped (the scheduler ended it at a rung), error, interrupted "
              "(started, and not ended when the sweep was interrupted), pending (not started). vs random real: "
              "the trial's top-1 "
              "minus that of random real images of the same classes and IPC, seed by seed (mean ± s.e.); **below**: "
              "below them by more than two standard errors, a set worse than picking images at random."]
    failed = failures(trial_rows)
    if failed:
        lines += ["", f"Failed trials ({len(failed)}; each one's traceback is in the file named):", ""]
        lines += [f"- trial {f.trial} ({shown_values(f.values, swept)}): {f.error}" + (f" ({f.log})" if f.log else "")
                  for f in failed]
    if confirmation is not None and not interrupted:
        lines += ["", *confirmation.lines]
    elif best is not None:
        label = "Best so far" if interrupted else "Best"
        lines += ["", f"{label}: trial {best['trial']} ({shown_values(best, swept)}), top-1 {_top1_text(best, seeds)}"
                      + ("." if interrupted else "; its config is best.yaml.")]
    elif not interrupted:
        lines += ["", "No trial finished: there is no best config and no best.yaml."]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
