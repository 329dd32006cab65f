"""The tables `bench.accuracy` prints, on hand-made rows (the grid itself is a benchmark, not a test)."""
from __future__ import annotations

from bench.accuracy import markdown, paired_markdown, versus_markdown


def _row(method: str, ipc: int, per_seed: list[float]) -> dict:
    mean = sum(per_seed) / len(per_seed)
    return {"dataset": "parquet:/data/fashion-sample-500.parquet", "dataset_name": "parquet:fashion-sample-500",
            "ipc": ipc, "method": method, "top1_mean": mean, "top1_std": 0.5, "top1_per_seed": per_seed}


def test_the_tables_name_the_dataset_and_pair_fadrm_with_every_row_seed_by_seed():
    rows = [_row("random-real", 10, [80.0, 82.0, 81.0]), _row("fadrm", 10, [81.0, 82.5, 80.5]),
            _row("patches", 10, [80.0, 81.0, 79.0]), _row("fadrm", 1, [70.0, 71.0, 72.0])]
    table = markdown(rows, ["random-real", "patches", "fadrm"])
    assert table.splitlines()[2] == "| parquet:fashion-sample-500 | 1 | - | - | 71.00 ± 0.50 |"
    paired = paired_markdown(rows, ["random-real", "patches", "fadrm"]).splitlines()
    # fadrm - random-real: 1, 0.5, -0.5 -> mean 0.33, s.e. 0.44, higher on 2 of 3; fadrm - patches: 1, 1.5, 1.5.
    assert paired[-1] == "| parquet:fashion-sample-500 | 10 | +0.33 ± 0.44 (2/3) | +1.33 ± 0.17 (3/3) |"
    assert paired[-2].startswith("| parquet:fashion-sample-500 | 1 | - | - |")
    assert paired_markdown(rows, ["random-real", "patches"], against="sre2l") == ""  # no such row: no table


def test_every_row_is_set_against_random_real_images_seed_by_seed_with_its_seeds():
    rows = [_row("random-real", 1, [40.0, 42.0, 41.0]), _row("mosaic", 1, [45.0, 44.0, 47.0]),
            _row("fadrm", 1, [39.0, 42.5, 40.0]), _row("fadrm", 10, [80.0, 81.0, 82.0])]
    lines = versus_markdown(rows, ["random-real", "fadrm", "mosaic"]).splitlines()
    # mosaic - random-real: 5, 2, 6 -> mean 4.33, s.e. 1.20, higher on 3 of 3; IPC 10 has no random-real row.
    assert lines[-1] == "| parquet:fashion-sample-500 | 1 | mosaic | 45.33 ± 0.50 | 45.00 / 44.00 / 47.00 | +4.33 ± 1.20 (3/3) |"
    assert lines[-2].endswith("| 39.00 / 42.50 / 40.00 | -0.50 ± 0.50 (1/3) |")
    assert lines[-3].endswith("| random-real | 41.00 ± 0.50 | 40.00 / 42.00 / 41.00 |  |")
    assert versus_markdown(rows, ["fadrm"], baseline="patches") == ""
    # A row relabelled by three teachers is set against random real images relabelled by them.
    several = [*rows, {**_row("fadrm+", 1, [46.0, 45.0, 47.0]), "teachers": ["t1", "t2", "t3"]},
               {**_row("random-real (t1-t3 labels)", 1, [44.0, 44.0, 44.0]), "teachers": ["t1", "t2", "t3"]}]
    lines = versus_markdown(several, ["random-real", "fadrm+"]).splitlines()
    assert lines[-2].endswith("| +2.00 ± 0.58 (3/3) against random-real (t1-t3 labels) |")
    assert lines[-1].endswith("| 44.00 / 44.00 / 44.00 |  |")
