"""The automatic cut of a run into units and packs (fadrm_ray/packing.py, runs.units.plan_units)."""
import pytest

from fadrm_ray.config import DistillConfig, make_config
from fadrm_ray.runs.units import Unit, plan_units
from fadrm_ray.packing import block_size, cpu_pack_limit, cuda_pack_limit, pack_limit, split_evenly


def resolved(**overrides) -> DistillConfig:
    return make_config("fadrm", overrides=overrides).resolve(32, 10, channels=1)


def ranges(units):
    return [(u.shard, u.ipc_start, u.ipc_end) for u in units]


def test_every_worker_gets_a_unit():
    cfg = resolved(ipc=10)
    assert ranges(plan_units(cfg, 10, image_size=32, workers=2)) == [(0, 0, 5), (0, 5, 10)]  # not one unit of 10
    assert ranges(plan_units(cfg, 10, image_size=32, workers=1)) == [(0, 0, 10)]
    assert ranges(plan_units(cfg, 10, image_size=32, workers=3)) == [(0, 0, 4), (0, 4, 7), (0, 7, 10)]
    # two shards already give two workers a unit each
    two = resolved(ipc=10, classes_per_batch=5)
    assert ranges(plan_units(two, 10, image_size=32, workers=2)) == [(0, 0, 10), (1, 0, 10)]
    # explicit values win
    assert ranges(plan_units(resolved(ipc=4, ipc_per_unit=3), 10, image_size=32, workers=2)) == [(0, 0, 3), (0, 3, 4)]


def test_a_cpu_unit_is_no_larger_than_one_step():
    cfg = resolved(ipc=100)  # 10 classes at 32 px: a CPU step holds 25 groups
    assert cpu_pack_limit(10, cfg, 32) == 25
    assert block_size(cfg, 100, 1, 1, 10, 32, "cpu") == 25
    assert block_size(cfg, 100, 1, 1, 10, 32, "cuda") == 100  # CUDA packs by measured memory instead


def test_units_are_planned_around_the_ones_the_run_has():
    cfg = resolved(ipc=20)
    first = [Unit(0, tuple(range(10)), 0, 5).unit_id, Unit(0, tuple(range(10)), 5, 10).unit_id]
    grown = plan_units(cfg, 10, image_size=32, workers=2, finished=first)
    assert ranges(grown) == [(0, 0, 5), (0, 5, 10), (0, 10, 15), (0, 15, 20)]  # only 10-19 are new
    smaller = plan_units(resolved(ipc=3), 10, image_size=32, workers=2, finished=first)
    assert ranges(smaller) == [(0, 0, 5)]  # served by a finished unit that holds more
    # a checkpointed unit is resumed whole; one that overlaps a finished unit is left alone
    partial = [Unit(0, tuple(range(10)), 3, 8).unit_id, Unit(0, tuple(range(10)), 10, 12).unit_id]
    plan = plan_units(resolved(ipc=14), 10, image_size=32, workers=1, finished=first, partial=partial)
    assert ranges(plan) == [(0, 0, 5), (0, 5, 10), (0, 10, 12), (0, 12, 14)]
    assert Unit.parse_id("shard0002-ipc00010-00015") == (2, 10, 15) and Unit.parse_id("other") is None


def test_split_evenly_and_the_cuda_budget():
    assert split_evenly(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split_evenly([], 3) == [] and split_evenly([1, 2], 5) == [[1, 2]]
    gib = 1 << 30
    assert cuda_pack_limit(gib, free_bytes=40 * gib, total_bytes=80 * gib) == 24           # 0.6 of the free memory
    assert cuda_pack_limit(gib, free_bytes=40 * gib, total_bytes=80 * gib, gpu_share=0.25) == 12  # of its share
    assert cuda_pack_limit(100 * gib, free_bytes=gib, total_bytes=gib) == 1
    assert pack_limit(resolved(pack=3), 10, 32, 1, []) == 3
    assert pack_limit(resolved(), 10, 32, 1, []) == 25


@pytest.mark.parametrize("field, value", [("pack", 0), ("ipc_per_unit", "all")])
def test_speed_fields_take_a_count_or_auto(field, value):
    from fadrm_ray.settings import ConfigError

    with pytest.raises(ConfigError, match=f'{field} must be an integer >= 1 or "auto"'):
        DistillConfig(**{field: value})


def test_the_cuda_memory_probe_runs_the_recover_steps_own_loss():
    """`group_bytes` measures CUDA memory around `probe_step`; the step itself runs on the CPU too,
    so a change to the recover loss cannot break the CUDA path unseen."""
    import torch

    from fadrm_ray.models import create_model
    from fadrm_ray.packing import probe_step
    from fadrm_ray.frozen_teacher import FrozenTeacher

    torch.manual_seed(0)
    model = create_model("convnet-bn", num_classes=10, in_chans=3, image_size=16, width=8).eval()
    teacher = FrozenTeacher(model)
    try:
        grad = probe_step(resolved(), teacher, classes=10, channels=3, resolution=16, device=torch.device("cpu"))
    finally:
        teacher.remove_hooks()
    assert grad.shape == (10, 3, 16, 16) and torch.isfinite(grad).all() and grad.abs().sum() > 0
