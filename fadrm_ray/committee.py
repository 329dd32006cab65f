"""CV-DD's committee vote (docs/method.md section 7c): every teacher scores every step, and
the step's loss is the vote-weighted sum of the teachers' CE + BN losses.

The weights are a softmax of each teacher's prior performance (its test accuracy in percent,
recorded in its checkpoint) at a temperature: a better teacher gets a larger say, and the
temperature decides how much larger. A committee of equal teachers votes equally.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from fadrm_ray.errors import InputError


def committee_weights(priors: Sequence[float | None], temperature: float) -> torch.Tensor:
    """softmax(prior / temperature) over the teachers, float32 (n,)."""
    if not priors:
        raise InputError("a committee needs at least one teacher")
    bad = [i for i, p in enumerate(priors) if p is None or not math.isfinite(p)]
    if bad:
        raise InputError(f"committee voting needs each teacher's prior (its test accuracy in the checkpoint); "
                         f"teachers {bad} have none")
    if not (math.isfinite(temperature) and temperature > 0):
        raise InputError(f"committee temperature must be finite and > 0, got {temperature}")
    scores = torch.tensor([float(p) for p in priors], dtype=torch.float64) / temperature
    return torch.softmax(scores, dim=0).float()

