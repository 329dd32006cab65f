"""Figures written the moment they are measured: one JSON line each, appended to a file.

A benchmark step of bench/gpu_check.sh runs under a time budget; what it prints at its end is lost
when the budget kills it. Each step is given `--record FILE` and appends every figure as soon as
it has it (a contender's round, a schedule, a profile's summary, a precision path, a student
epoch), so a step killed half-way keeps everything it measured; the script folds the lines into
the step's JSON (`measured`).

`FADRM_RECORD_KILL_AFTER=N` kills the process (SIGKILL) right after its N-th line, as a budget's
kill would land: the test that a killed step keeps what it measured (bench/gpu_check.sh sets it
for the step named in FADRM_GPU_CHECK_KILL=STEP:N).
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path


class Record:
    """`record(kind, **fields)` appends `{"kind": kind, **fields}` as one line to `path` (nothing
    where `path` is None), flushed before it returns."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.lines = 0
        self.kill_after = int(os.environ.get("FADRM_RECORD_KILL_AFTER") or 0)

    def __call__(self, kind: str, **fields) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")
        self.lines += 1
        if self.lines == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def read_records(path: str | Path) -> list[dict]:
    """The lines `Record` appended to `path` (a last line cut short by a kill is skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
