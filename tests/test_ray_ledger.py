"""The Ray run's ledger and the workers' replies as typed models, without starting Ray: the lines
keep the layout every reader knows, torn and unknown lines are skipped, and the service's
progress reads the entries."""
import json

import pytest

from api.jobs.job_outputs import _parse_ledger
from fadrm_ray.events import (LedgerEvent, PatchesFailed, PatchesScored, RunFinished, RunStarted, StageDone,
                              StageFailed, UnitDone, WorkerLost, WorkerStarted, append_entry, append_event,
                              read_ledger)
from fadrm_ray.runs.messages import ClassScored, StageRan, UnitWritten, WorkerInfo
from fadrm_ray.store.run_files import ClassSelection

INFO = WorkerInfo(pid=7, host="h", device="cpu", threads=1, torch_threads=1, cpus=2, omp_wait_policy="PASSIVE",
                  omp_num_threads="1")
ENTRIES = [
    RunStarted(units=2, todo=1, stages_done=3, ipc=2, resumed={"u1": 3}, stages=4, plan={"u0": 4, "u1": 3}),
    WorkerStarted(worker="abc", **INFO.model_dump()),
    WorkerLost(worker="abc", message="gone"),
    PatchesScored(label=3, pid=7, seconds=0.5),
    PatchesFailed(label=3, attempt=1, worker="abc", error="RayActorError", message="gone"),
    StageDone(unit="u1", stage=3, pid=7, seconds=1.5, patches_scored=0),
    StageFailed(unit="u1", stage=3, attempt=1, worker="abc", error="RayTaskError", message="boom"),
    UnitDone(unit="u1", rows=10, pid=7),
    RunFinished(seconds=9.0),
]
# the keys of each line as the coordinator wrote them before the ledger was typed
KEYS = {
    "run_started": {"units", "todo", "stages_done", "ipc", "resumed", "stages", "plan"},
    "worker_started": {"worker", "pid", "host", "device", "threads", "torch_threads", "cpus", "omp_wait_policy",
                       "omp_num_threads"},
    "worker_lost": {"worker", "message"},
    "patches_scored": {"label", "pid", "seconds"},
    "patches_failed": {"label", "attempt", "worker", "error", "message"},
    "stage_done": {"unit", "stage", "pid", "seconds", "patches_scored"},
    "stage_failed": {"unit", "stage", "attempt", "worker", "error", "message"},
    "unit_done": {"unit", "rows", "pid"},
    "run_finished": {"seconds"},
}


def test_every_event_has_a_model_whose_line_keeps_the_keys(tmp_path):
    path = tmp_path / "ledger.jsonl"
    for entry in ENTRIES:
        append_entry(path, entry)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == [e.value for e in LedgerEvent]  # one model per event
    for line in lines:
        assert set(line) == {"t", "event"} | KEYS[line["event"]]
    assert list(read_ledger(path)) == ENTRIES
    assert list(read_ledger(path, StageDone)) == [ENTRIES[5]]
    assert [e.event for e in read_ledger(path, UnitDone)] == [LedgerEvent.unit_done]


def test_torn_unknown_and_incomplete_lines_are_skipped(tmp_path):
    path = tmp_path / "ledger.jsonl"
    append_entry(path, RunFinished(seconds=1.0))
    with open(path, "a") as f:
        f.write('{"t": 1, "event": "something_new", "x": 1}\n')   # an event this version does not know
        f.write('{"t": 1, "event": "stage_done", "unit": "u"}\n')  # fields missing
        f.write('[1, 2]\n{"t": 2, "event": "run_fin')              # not an object; a line being written
    assert [type(e) for e in read_ledger(path)] == [RunFinished]
    assert list(read_ledger(tmp_path / "missing.jsonl")) == []


def test_a_sweep_log_keeps_its_untyped_events(tmp_path):
    path = tmp_path / "events.jsonl"
    append_event(path, "trial_started", trial="t1", values={"alpha": 0.5})
    (event,) = [json.loads(line) for line in path.read_text().splitlines()]  # the line layout of the ledger
    assert event["event"] == "trial_started" and event["values"] == {"alpha": 0.5} and "t" in event


def test_progress_reads_the_last_run_started_and_its_stages(tmp_path):
    path = tmp_path / "ledger.jsonl"
    append_entry(path, RunStarted(t=5.0, units=1, todo=1, stages_done=0, ipc=1, resumed={}, stages=2, plan={"a": 0}))
    append_entry(path, StageDone(t=6.0, unit="a", stage=0, pid=1, seconds=1.0, patches_scored=0))
    second = RunStarted(t=100.0, units=1, todo=1, stages_done=1, ipc=1, resumed={"a": 1}, stages=2, plan={"a": 1})
    append_entry(path, second)
    append_entry(path, StageDone(t=101.0, unit="a", stage=1, pid=1, seconds=1.0, patches_scored=0))
    started, done = _parse_ledger(path, since=100.0)
    assert started == second and [(e.unit, e.stage) for e in done] == [("a", 1)]
    assert _parse_ledger(path, since=200.0) == (None, [])


def test_worker_replies_are_models():
    selection = ClassSelection(label=2, ranked=(4, 1), boxes=((0, 0, 4), (1, 1, 5)))
    scored = ClassScored(label=2, selection=selection, pid=7, seconds=0.1)
    assert scored.selection == selection
    last = UnitWritten(unit_id="u", stage=3, pid=7, seconds=1.0, patches_scored=0, rows=10)
    assert isinstance(last, StageRan) and not isinstance(StageRan(**last.model_dump(exclude={"rows"})), UnitWritten)
    with pytest.raises(ValueError):
        StageRan(unit_id="u", stage=0, pid=7, seconds=1.0, patches_scored=0, rows=3)  # no stray fields
