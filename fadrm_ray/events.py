"""Event logs: one JSON object per line, appended, read back by whoever follows the work.

A Ray run's ledger (`RunLayout.ledger`: what ran where, written by the coordinator, read by the
service's progress reports, the fault benchmark and tests) and a sweep's `events.jsonl` use the
same two functions. `LedgerEvent` names the ledger's events, so the writer and every reader use
one spelling.
"""
from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Any, Iterator


class LedgerEvent(str, Enum):
    run_started = "run_started"          # units, todo, stages_done, ipc, resumed, stages, plan
    worker_started = "worker_started"    # worker, pid, host, device, threads, ...
    worker_lost = "worker_lost"
    patches_scored = "patches_scored"    # label, pid, seconds
    patches_failed = "patches_failed"
    stage_done = "stage_done"            # unit, stage, pid, seconds, patches_scored
    stage_failed = "stage_failed"        # unit, stage, attempt, worker, error, message
    unit_done = "unit_done"              # unit, rows, pid
    run_finished = "run_finished"        # seconds

    def __str__(self) -> str:
        return self.value


def append_event(path: str | Path, event: str, **fields: Any) -> None:
    """Append one event (with its time `t`) as a line of JSON."""
    line = json.dumps({"t": time.time(), "event": str(event), **fields}, default=str)
    with open(path, "a") as f:
        f.write(line + "\n")


def read_events(path: str | Path, event: str | None = None) -> Iterator[dict]:
    """The events of a log in order (only those named `event`, if given); a line still being
    written, or not an object, is skipped; a missing log has none."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and (event is None or item.get("event") == str(event)):
            yield item
