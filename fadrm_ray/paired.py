"""Paired gains: a set's final top-1 minus another's, seed by seed, and how it is written.

Two sets evaluated with the same seeds pair up: the two students of one seed start from the
same weights and see the same augmentation stream, so the difference of their top-1 cancels
most of the spread between seeds. The evaluation's baselines (evaluation/baselines.py) and the
pilot (pilot.py, pilot_record.py) report their gains this way; this module sits below both.
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

from pydantic import BaseModel, ConfigDict


class PairedGain(BaseModel):
    """A run's final top-1 minus a baseline's, seed by seed (`paired_gain`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    mean: float
    stderr: float | None        # None with one seed
    higher: int                 # seeds on which the run came out above
    seeds: int

    @property
    def clearly_above(self) -> bool:
        """Above zero by more than two standard errors (never with one seed)."""
        return self.stderr is not None and self.mean > 2 * self.stderr

    @property
    def clearly_below(self) -> bool:
        """Below zero by more than two standard errors (never with one seed)."""
        return self.stderr is not None and self.mean < -2 * self.stderr


def paired_gain(run_top1: Sequence[float], base_top1: Sequence[float]) -> PairedGain:
    """The run's final top-1 minus a baseline's, seed by seed (the seeds paired in order):
    `mean` (equal to the gain of the means), `stderr` (its standard error; None with one seed)
    and `higher` (seeds on which the run came out above)."""
    if len(run_top1) != len(base_top1) or not run_top1:
        raise ValueError(f"paired seeds must match: {len(run_top1)} against {len(base_top1)}")
    diffs = [a - b for a, b in zip(run_top1, base_top1)]
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return PairedGain(mean=round(statistics.fmean(diffs), 3), stderr=None if stderr is None else round(stderr, 3),
                      higher=sum(d > 0 for d in diffs), seeds=len(diffs))


def gain_text(paired: PairedGain, seeds: bool = True) -> str:
    """'+0.54 ± 0.29 s.e., higher on 4 of 5 seeds' for a `paired_gain` (without the count when
    `seeds` is False; without the error with one seed)."""
    text = f"{paired.mean:+.2f}"
    if paired.stderr is not None:
        text += f" ± {paired.stderr:.2f}" + (" s.e." if seeds else "")
    if seeds:
        text += f", higher on {paired.higher} of {paired.seeds} seed{'s' if paired.seeds != 1 else ''}"
    return text
