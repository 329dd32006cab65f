"""Event logs: one JSON object per line, appended, read back by whoever follows the work.

A Ray run's ledger (`RunLayout.ledger`: what ran where, written by the run's schedule on the worker pool, read by the
service's progress reports, the benchmarks and tests) is typed: each `LedgerEvent` has a pydantic
model with its fields (`RunStarted` ... `RunFinished`, the union `LedgerEntry` discriminated on
`event`); `append_entry` writes one model as a line, `read_ledger` yields the lines as validated
models. A line is `{"t": <unix time>, "event": <name>, <the model's fields>}`.

A sweep's `events.jsonl` is not typed yet: `append_event` writes plain objects with the same line
layout.
"""
from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from fadrm_ray.runs.messages import WorkerInfo


class LedgerEvent(str, Enum):
    run_started = "run_started"          # RunStarted: units, todo, stages_done, ipc, resumed, stages, plan
    worker_started = "worker_started"    # WorkerStarted: worker and its WorkerInfo (pid, host, device, threads, ...)
    worker_lost = "worker_lost"          # WorkerLost: worker, message
    patches_scored = "patches_scored"    # PatchesScored: label, pid, seconds
    patches_failed = "patches_failed"    # PatchesFailed: label, attempt, worker, error, message
    stage_done = "stage_done"            # StageDone: unit, stage, pid, seconds, patches_scored
    stage_failed = "stage_failed"        # StageFailed: unit, stage, attempt, worker, error, message
    unit_done = "unit_done"              # UnitDone: unit, rows, pid
    run_finished = "run_finished"        # RunFinished: seconds

    def __str__(self) -> str:
        return self.value


class _Entry(BaseModel):
    """A line of the ledger: when it was written, then (in each model) its name and fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    t: float = Field(default_factory=time.time)


class RunStarted(_Entry):
    """A request's run starts (after the ledger was rebuilt from the store)."""

    event: Literal["run_started"] = "run_started"
    units: int                # units of this request
    todo: int                 # of them, those with stages left
    stages_done: int          # stages the store already holds, over all units
    ipc: int
    resumed: dict[str, int]   # unit id -> stage it restarts at, for units with a checkpoint
    stages: int               # stages per unit (k + 1)
    plan: dict[str, int]      # every unit of the request -> stages it already has


class WorkerStarted(_Entry, WorkerInfo):
    """A worker actor answered its first ping: where it runs (the `WorkerInfo` fields)."""

    event: Literal["worker_started"] = "worker_started"
    worker: str               # the actor id


class WorkerLost(_Entry):
    event: Literal["worker_lost"] = "worker_lost"
    worker: str
    message: str


class PatchesScored(_Entry):
    event: Literal["patches_scored"] = "patches_scored"
    label: int
    pid: int
    seconds: float


class _Failed(_Entry):
    attempt: int              # attempts so far, this one included
    worker: str
    error: str                # the exception's type
    message: str


class PatchesFailed(_Failed):
    event: Literal["patches_failed"] = "patches_failed"
    label: int


class StageDone(_Entry):
    event: Literal["stage_done"] = "stage_done"
    unit: str
    stage: int
    pid: int
    seconds: float
    patches_scored: int       # classes the worker had to score itself


class StageFailed(_Failed):
    event: Literal["stage_failed"] = "stage_failed"
    unit: str
    stage: int


class UnitDone(_Entry):
    event: Literal["unit_done"] = "unit_done"
    unit: str
    rows: int
    pid: int


class RunFinished(_Entry):
    event: Literal["run_finished"] = "run_finished"
    seconds: float


LedgerEntry = Annotated[Union[RunStarted, WorkerStarted, WorkerLost, PatchesScored, PatchesFailed, StageDone,
                              StageFailed, UnitDone, RunFinished], Field(discriminator="event")]
_ENTRY = TypeAdapter(LedgerEntry)
E = TypeVar("E", bound=_Entry)


def _append(path: str | Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def _lines(path: str | Path) -> list[str]:
    """The lines of a log; none for a missing one."""
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def append_entry(path: str | Path, entry: LedgerEntry) -> None:
    """Append one ledger entry as a line of JSON."""
    _append(path, entry.model_dump_json())


def read_ledger(path: str | Path, kind: type[E] | None = None) -> Iterator[E]:
    """The entries of a ledger in order (only those of model `kind`, if given). A line still being
    written, or one that is no entry of this version (an unknown event, missing fields), is
    skipped; a missing ledger has none."""
    for line in _lines(path):
        try:
            entry = _ENTRY.validate_json(line)
        except ValidationError:
            continue
        if kind is None or isinstance(entry, kind):
            yield entry


def append_event(path: str | Path, event: str, **fields: Any) -> None:
    """Append one event (with its time `t`) as a line of JSON."""
    _append(path, json.dumps({"t": time.time(), "event": str(event), **fields}, default=str))
