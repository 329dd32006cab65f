"""fadrm_ray/estimate.py: a run's time is its steps at the shapes it runs them, added up as its
workers take its units (checked here with fixed step times: the arithmetic, not this machine)."""
from __future__ import annotations

import pytest

from fadrm_ray.config import make_config
from fadrm_ray.estimate import RAY_WORKER_START, RunShape, StepTimer, run_seconds
from fadrm_ray.runs.job import ExecutionSpec


class FixedSteps(StepTimer):
    """A step of n images takes n centiseconds, a crop's scoring a millisecond; each shape asked is kept."""

    def __init__(self, dataset):
        super().__init__([], dataset, "cpu")
        self.asked = []

    def recover_step(self, cfg, classes, groups, resolution, threads):
        self.asked.append((classes * groups, resolution, threads))
        return classes * groups / 100

    def scoring_crop(self, cfg, threads):
        return 1 / 1000


def _resolved(digits, **overrides):
    cfg = make_config("fadrm", overrides={"iterations": 10, "precision": "fp32", **overrides})
    return cfg.resolve(digits.image_size, digits.num_classes, digits.hflip, "cpu", channels=digits.channels)


def test_a_run_is_its_units_steps_at_their_pack_spread_over_its_workers(digits):
    timer = FixedSteps(digits)
    cfg = _resolved(digits, ipc=4, patch_selection="whole")  # no patch scoring
    # One process: one unit of the 4 IPC groups of 10 classes, one pack of 40 images, 10 steps.
    assert run_seconds(cfg, digits, timer, RunShape(1, 2, False)) == pytest.approx(10 * 0.40)
    assert timer.asked[-1] == (40, 8, 2)
    # Two Ray workers of one thread: two units of 2 groups (20 images) side by side, after a start.
    assert run_seconds(cfg, digits, timer, RunShape(2, 1, True)) == pytest.approx(RAY_WORKER_START + 10 * 0.20)
    assert timer.asked[-1] == (20, 8, 1)
    # Three workers: the 4 groups are cut into blocks of ceil(4 / 3) = 2, two units, one worker each.
    assert run_seconds(cfg, digits, timer, RunShape(3, 1, False)) == pytest.approx(10 * 0.20)


def test_scoring_counts_every_crop_of_every_candidate_where_the_recipe_scores_patches(digits):
    timer = FixedSteps(digits)
    plain = run_seconds(_resolved(digits, ipc=1, patch_selection="whole"), digits, timer, RunShape(1, 1, False))
    scored = _resolved(digits, ipc=1, patch_selection="easy", patch_crops=3)
    crops = 3 * len(digits.train)  # every class's candidates, three crops each, one worker
    assert run_seconds(scored, digits, timer, RunShape(1, 1, False)) == pytest.approx(plain + crops / 1000)
    # Spread over two workers as the pool hands them out: class by class, each to the first one free.
    per_class = [3 * int((digits.train.labels == c).sum()) / 1000 for c in range(10)]
    two = [0.0, 0.0]
    for seconds in per_class:
        two[two.index(min(two))] += seconds
    assert run_seconds(scored, digits, timer, RunShape(2, 1, False)) == pytest.approx(max(two) + 10 * 0.10)


def test_the_shape_of_a_spec_is_its_workers_and_their_threads():
    assert RunShape.of_spec(ExecutionSpec(local=True, threads=3)) == RunShape(1, 3, False)
    assert RunShape.of_spec(ExecutionSpec(workers=4, cpus_per_worker=2)) == RunShape(4, 2, True)
    default = RunShape.of_spec(ExecutionSpec())
    assert default.threads == 1 and default.ray and default.workers >= 1
