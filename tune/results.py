"""A sweep's trials as rows, and one line per ended trial while it runs.

One row per trial of the whole sweep: its swept values, the students' test top-1 (mean ± std
over the student seeds; for a trial that did not finish, its last intermediate top-1 and how far
its students got), distill and student seconds, state, the node it ran on and its run in the
store; for a trial that failed, what it raised in one line (`error_line`: the exception's type
and message, no traceback, no colour codes) and the file that keeps its traceback. The states are
kept apart: `done` (ran to the end), `stopped` (ASHA ended it at a rung), `error`, `interrupted`
(started, and not ended when the sweep was interrupted) and `pending` (not started). The rows
are read from Tune's results after a fit (`collect_rows`), or from the experiment Tune saved,
without a fit, when the sweep is interrupted before one ends (`saved_rows`). A trial counts as started when
Tune saw it running, when it reported, or when it said so in the sweep's events.jsonl
(`TrialStarted`, in this run of the sweep or an earlier one): a trial that started and did not
end is `interrupted`, even where Tune's saved state still calls it pending. tune.outputs writes
the rows; tune.progress prints a line per trial as it ends.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from tune.settings import EVENTS, EXPERIMENT, TIME_ATTR, TrialReport, TrialStarted, restored_progress
from tune.space import Param

if TYPE_CHECKING:
    from tune.prepare import Prepared

COLUMNS = ("top1", "top1_std", "top1_per_seed", TIME_ATTR, "distill_seconds", "student_seconds", "trial_seconds", "state",
           "node_id", "host", "run_id", "units_run", "patches_scored", "error", "log", "vs_random", "below_random")
STATES = ("done", "stopped", "error", "interrupted", "pending")
State = Literal[STATES]
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_RAISED = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure|Warning)\b.*)$")


class TrialRow(BaseModel):
    """One trial of the whole sweep, as results.csv, results.md, the plots and summary.json show it
    (`flat()`): its swept values, what its last TrialReport said, its state, why it failed, and the
    comparison with random real images (`vs_random` and `below_random`, set by `mark_random`)."""

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
    error: str | None = None            # what the trial raised, in one line
    log: str | None = None              # the file with its traceback
    vs_random: str | None = None        # baselines.gain_text of the paired gain over random real images
    below_random: bool | None = None    # clearly below them (more than two standard errors)

    @classmethod
    def of(cls, trial: str, values: dict[str, Any], state: State, report: TrialReport | None,
           error: str | None = None, log: str | None = None) -> "TrialRow":
        reported = report.model_dump(include=set(cls.model_fields)) if report is not None else {}
        return cls(trial=trial, values=values, state=state, error=error, log=log, **reported)

    def flat(self) -> dict[str, Any]:
        """The row as the tables show it: trial, each swept key, then COLUMNS."""
        return {"trial": self.trial, **self.values, **{col: getattr(self, col) for col in COLUMNS}}


assert set(COLUMNS) <= set(TrialRow.model_fields)


def error_line(error: Any) -> str | None:
    """What a trial raised, in one line: `ModelError: unknown model 'x'` from Tune's error of the
    trial (the exception Ray carried back, whose cause is what the trial raised, or the text of
    its traceback), without the traceback and without terminal colour codes."""
    if error is None:
        return None
    for _ in range(8):  # a RayTaskError (or a chain of them) carries what the trial raised as its cause
        cause = getattr(error, "cause", None)
        if not isinstance(cause, BaseException) or cause is error:
            break
        error = cause
    text = _ANSI.sub("", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(error, BaseException) and "Traceback (most recent call last)" not in text and len(lines) <= 3:
        line = f"{type(error).__name__}: {' '.join(lines)}" if lines else type(error).__name__
    else:  # the text of a traceback: its last line that names what was raised
        raised = [m.group(1) for line in lines if (m := _RAISED.match(line))]
        line = raised[-1] if raised else (lines[-1] if lines else type(error).__name__)
    line = " ".join(line.split())
    return line if len(line) <= 400 else line[:397] + "..."


# The name a SweepProgress pickled as in the experiments of versions that kept it in this module.
_restored_progress = restored_progress


def trial_error(trial) -> str | None:
    """What a Tune trial that failed raised, in one line (`error_line`); None where Tune kept none."""
    try:
        return error_line(trial.get_pickled_error() or trial.get_error())
    except Exception:  # noqa: BLE001 - a missing or unreadable error file: the row says "error" alone
        return None


def _state(error, report: TrialReport | None, status: str | None, started: bool) -> State:
    """A trial's state from what it raised, its last report, the status Tune last gave it and
    whether it said it started."""
    if error:
        return "error"
    if status in ("RUNNING", "PAUSED") or (status == "PENDING" and report is not None):
        return "interrupted"
    if status == "PENDING" or report is None:
        return "interrupted" if started else "pending"
    return "done" if report.final else "stopped"


def _log(folder: str | None) -> str | None:
    if not folder:
        return None
    path = Path(folder) / "error.txt"
    return str(path) if path.is_file() else None


def started_trials(events: str | Path) -> dict[str, dict[str, Any]]:
    """{trial id: its swept values} of every trial that started, in this run of the sweep or an
    earlier one, from the sweep's events.jsonl (a line still being written, or another event's,
    is skipped; a missing file has none)."""
    try:
        lines = Path(events).read_text().splitlines()
    except OSError:
        return {}
    started = {}
    for line in lines:
        try:
            entry = TrialStarted.model_validate_json(line)
        except ValidationError:
            continue
        started[entry.trial] = entry.values
    return started


def collect_rows(grid, p: "Prepared", progress) -> list[TrialRow]:
    """One row per trial of the whole sweep, in trial order: the trials of a Tune ResultGrid
    (each one's last TrialReport), labelled by their statuses and with their configs as the
    controller last saw them (`progress`), then a `pending` row for each trial Tune had not made
    yet (an interrupted sweep). A trial that never reported has no config in its result: it is
    taken from the controller (`progress`, a tune.progress.SweepProgress) or from the line the
    trial wrote as it started, or the trial counts as not made."""
    rows = []
    started = started_trials(p.out / EVENTS)
    for result in grid:
        metrics = result.metrics or {}
        report = TrialReport.from_metrics(metrics)
        trial = metrics.get("trial_id") or Path(result.path).name.removeprefix("trial_")  # Tune's own key
        config = result.config or progress.configs.get(trial) or started.get(trial)
        if config is None and not result.error:
            continue
        rows.append(TrialRow.of(trial, {k: (config or {}).get(k) for k in p.swept},
                                _state(result.error, report, progress.statuses.get(trial), trial in started), report,
                                error_line(result.error), _log(result.path) if result.error else None))
    rows.sort(key=lambda r: r.trial)
    return rows + not_made(rows, p.swept, p.request.search, p.request.sample_count)


def saved_rows(p: "Prepared") -> list[TrialRow]:
    """The rows of the experiment Tune saved in OUT/experiment, read without Ray or a fit (a
    sweep interrupted before its fit ended; a resumed one keeps what it had done); every trial
    pending where none is saved or it cannot be read, unless it said it started."""
    rows: list[TrialRow] = []
    started = started_trials(p.out / EVENTS)
    folder = p.out / EXPERIMENT
    if (folder / "tuner.pkl").is_file() or any(folder.glob("experiment_state*.json")):
        try:
            from ray.tune import ExperimentAnalysis

            for trial in ExperimentAnalysis(str(folder)).trials:
                report = TrialReport.from_metrics(trial.last_result)
                error = trial_error(trial) if trial.status == "ERROR" else None
                status = trial.status if trial.status != "TERMINATED" or report is not None else "PENDING"
                config = trial.config or started.get(trial.trial_id)
                if config is None and error is None:
                    continue
                rows.append(TrialRow.of(trial.trial_id, {k: config.get(k) for k in p.swept} if config else
                                        {k: None for k in p.swept},
                                        _state(error, report, status, trial.trial_id in started), report, error,
                                        _log(trial.path) if error else None))
        except Exception:  # noqa: BLE001 - an experiment Tune had not finished saving: every trial is pending
            rows = []
    rows.sort(key=lambda r: r.trial)
    return rows + not_made(rows, p.swept, p.request.search, p.request.sample_count)


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


def mark_random(rows: list[TrialRow], seeds: list[int], random_top1: dict[str, list[float]]) -> int:
    """Each finished row's gain over random real images on the trials' `seeds`, seed by seed
    (`vs_random`, a `baselines.gain_text`), and `below_random` where it is clearly below them
    (more than two standard errors). `random_top1` holds random real images' top-1 on those seeds
    for every trial ("": the same for all) or for some. Returns how many are clearly below."""
    below = 0
    for row in rows:
        random = random_top1.get(row.trial, random_top1.get(""))
        if row.state != "done" or not row.top1_per_seed or random is None or len(row.top1_per_seed) != len(seeds):
            continue
        from fadrm_ray.evaluation.baselines import gain_text, paired_gain

        gain = paired_gain(row.top1_per_seed, random)
        row.vs_random = gain_text(gain)
        row.below_random = gain.clearly_below
        below += row.below_random
    return below
