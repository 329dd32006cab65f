"""One line on stderr per trial of a sweep as it ends, and what Tune's controller last saw of
each trial (its status and config), for tune.results to label the rows by.
"""
from __future__ import annotations

import sys

from ray.tune import Callback

from tune.results import trial_error
from tune.settings import TrialReport, activate_progress, restored_progress
from tune.space import Param, shown_values

# The name a SweepProgress pickled as in the experiments of versions before tune.settings held it.
_restored_progress = restored_progress


class SweepProgress(Callback):
    """One line on stderr per trial that ends, counted against every trial of the sweep (a failed
    one with its error in one line); and each trial's Tune status and config at the end of the
    controller's last step. That is the status to trust: when a fit is interrupted, Tune's
    clean-up then marks the running trials TERMINATED, the status of the trials that finished
    or that ASHA stopped."""

    def __init__(self, swept: dict[str, Param], total: int, enabled: bool = True):
        self.swept, self.total, self.enabled = swept, total, enabled
        self.ended: int | None = None
        self.statuses: dict[str, str] = {}
        self.configs: dict[str, dict] = {}

    def activate(self) -> "SweepProgress":
        activate_progress(self)
        return self

    def __reduce__(self):
        # Tune pickles the RunConfig (and so its callbacks) with the experiment, and Tuner.restore
        # unpickles it: the restored Tuner then calls the callback this driver activated, with
        # this run's total and progress setting, and the driver can read its statuses.
        return restored_progress, ()

    def on_step_end(self, iteration, trials, **info):
        if self.ended is None:  # trials a resumed sweep had already ended count as ended
            self.ended = sum(t.status in ("TERMINATED", "ERROR") for t in trials)
        self.statuses = {t.trial_id: t.status for t in trials}
        self.configs = {t.trial_id: dict(t.config or {}) for t in trials}

    def _say(self, trial, text: str) -> None:
        self.ended = (self.ended or 0) + 1
        if self.enabled:
            print(f"fadrm tune: {self.ended}/{self.total} trial {trial.trial_id} "
                  f"{shown_values(trial.config, self.swept)}: {text}",
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
        self._say(trial, f"error: {trial_error(trial) or 'see its error.txt'}")
