"""Small helpers shared by the Ray tests."""
import json
import re
import time
from pathlib import Path

from fadrm_ray.layout import RunLayout


def ledger(run_dir) -> list[dict]:
    path = RunLayout(run_dir).ledger
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(run_dir, name) -> list[dict]:
    return [e for e in ledger(run_dir) if e["event"] == name]


def wait_for(predicate, timeout=120.0, interval=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")


def only_run_dir(root) -> Path:
    dirs = [d for d in Path(root).iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def distill(door, cfg, teachers, store, spec, dataset="digits"):
    """`cfg` on `dataset` (its spec, or the dataset loaded) built into one job for `door` and run
    through it, as every caller does: `door.run(job, spec, parts)` (`door`: the Ray door
    `actors.coordinator`, or the library's `fadrm_ray.runs.execute`)."""
    from fadrm_ray.data import get_dataset
    from fadrm_ray.runs.job import prepare_job

    data = get_dataset(dataset) if isinstance(dataset, str) else dataset
    job, parts = prepare_job(cfg, data, data.name, teachers, store, device_type=door.device_type(spec))
    return door.run(job, spec, parts)


# What Ray and Tune write to a driver's terminal when left to themselves (actors.ray_output): their
# loggers' lines ("2026-01-01 10:00:00,123\tINFO worker.py:2038 -- ..."), Tune's boxed configuration
# table and hints, its resume advice, and colour codes.
_RAY_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+[A-Z]+ \S+:\d+ -- ")
_RAY_AND_TUNE = ("Started a local Ray instance", "Connecting to existing Ray cluster", "Connected to Ray cluster",
                 "Configuration for experiment", "View detailed results here", "tensorboard --logdir",
                 "Tuner.restore(", "Failed to fetch metrics", "\x1b[")


def ray_or_tune_lines(text: str) -> list[str]:
    """The lines of `text` that Ray or Tune wrote."""
    return [line for line in text.splitlines()
            if _RAY_LOG_LINE.match(line) or any(mark in line for mark in _RAY_AND_TUNE) or line.startswith("╭")]
