"""Sweeps of DistillConfig values on Ray Tune (`fadrm tune`): the public face, each name loaded on
first use (`import tune` imports neither torch nor Ray).

- `SweepRequest`: what a sweep is asked (the flags of `fadrm tune`, checked as it is built);
- `run_sweep(request)`: run it, or resume it where its OUT already holds it;
- `SweepSummary`: what it returns, and writes as OUT/summary.json.

The modules, from the bottom: `settings` (the sweep's constants and the records its parts hand
each other), `request`, `space`; `prepare` (the checks before any trial), `results`, `plots`,
`session` (its Ray and Ctrl-C), `trainable` (one trial); `progress`, `confirm`, `outputs`; `sweep`
(the driver, on top); `sweep_command` (the `fadrm tune` command).
"""
from fadrm_ray.lazy import lazy_attributes

_EXPORTS = {
    "SweepRequest": "tune.request",
    "run_sweep": "tune.sweep",
    "SweepSummary": "tune.outputs",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)
