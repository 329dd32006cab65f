"""Small helpers shared by the Ray tests."""
import json
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
