"""The Ray layer on a real embedded local Ray: determinism across executors and fault tolerance."""
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

from actors import coordinator  # noqa: E402
from fadrm_ray.config import make_config  # noqa: E402
from fadrm_ray.runs import execute  # noqa: E402
from fadrm_ray.runs.job import ExecutionSpec  # noqa: E402
from fadrm_ray.store import open_run  # noqa: E402
from fadrm_ray.layout import RunLayout  # noqa: E402
from tests.ray_helpers import distill, events, ray_or_tune_lines, wait_for  # noqa: E402

LOCAL = ExecutionSpec(local=True, device="cpu", progress=False)

CFG = {"ipc": 2, "iterations": 16, "precision": "fp32", "classes_per_batch": 5}


def read(run_dir):
    images, labels, ipc = open_run(run_dir).read()
    return images, labels, ipc


def test_same_seed_same_images_on_1_and_2_workers_and_local(local_ray, digits, digits_teacher, tmp_path):
    teacher = digits_teacher[0]
    torch.set_num_threads(1)
    local = distill(execute, make_config("fadrm", overrides=CFG), [teacher], tmp_path / "local", LOCAL, digits)
    one = distill(coordinator, make_config("fadrm", overrides=CFG), [teacher], tmp_path / "one",
                  ExecutionSpec(workers=1, progress=False))
    two = distill(coordinator, make_config("fadrm", overrides=CFG), [teacher], tmp_path / "two",
                  ExecutionSpec(workers=2, progress=False))
    assert local.run_id == one.run_id == two.run_id  # same config, data and teacher
    a, b, c = read(local.run_dir), read(one.run_dir), read(two.run_dir)
    assert a[0].shape == (20, 1, 8, 8)
    for x, y in ((a, b), (a, c)):
        assert torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
        assert torch.equal(x[0], y[0])  # bit-identical uint8 images
    pids = {e["pid"] for e in events(two.run_dir, "stage_done")}
    assert len(pids) == 2  # both workers did work


def test_killed_worker_mid_stage_the_run_completes_exactly_once(local_ray, digits_teacher, tmp_path, capsys):
    cfg = make_config("fadrm", overrides={**CFG, "ipc": 4, "iterations": 240, "ipc_per_unit": 1})
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=distill(
        coordinator, cfg, [digits_teacher[0]], tmp_path, ExecutionSpec(workers=2, progress=True))))
    thread.start()
    run_dir = wait_for(lambda: next(iter([d for d in tmp_path.iterdir() if d.is_dir()]), None))
    wait_for(lambda: events(run_dir, "stage_done"))
    victim = events(run_dir, "worker_started")[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive() and "r" in result

    failed = events(run_dir, "stage_failed")
    assert failed, "the kill should have cost a stage"
    # Said once, in one line, with the unit that runs again; the bar counted the worker out.
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "a distill worker was lost" in line]
    assert len(said) == 1 and f"unit {failed[0]['unit']} stage {failed[0]['stage']} runs again" in said[0], err
    assert "(2 of 2 workers left)" not in said[0] and "(1 of 2 workers left)" in said[0]
    assert "(1 worker)" in err and "(2 workers)" in err
    done = [e["unit"] for e in events(run_dir, "unit_done")]
    assert sorted(done) == sorted(set(done)) and len(done) == 8   # 2 shards x 4 IPC, none recomputed
    stage_pairs = [(e["unit"], e["stage"]) for e in events(run_dir, "stage_done")]
    assert len(stage_pairs) == len(set(stage_pairs)) == 8 * 4     # each stage completed exactly once
    _, labels, ipc = read(run_dir)
    pairs = sorted(zip(labels.tolist(), ipc.tolist()))
    assert pairs == [(c, i) for c in range(10) for i in range(4)]  # every (class, ipc) exactly once


def test_stopped_driver_resumes_only_unfinished_stages(digits_teacher, tmp_path):
    """Ctrl-C the `fadrm distill` driver mid-run, run the same command again: it resumes."""
    command = [sys.executable, "-m", "actors.cli", "distill", "--dataset", "digits", "--teacher", digits_teacher[0],
               "--ipc", "3", "--set", "iterations=200", "--set", "precision=fp32", "--set", "ipc_per_unit=1",
               "--workers", "1",
               "--out", str(tmp_path), "--quiet", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = wait_for(lambda: next(iter([d for d in tmp_path.iterdir() if d.is_dir()]), None), timeout=120)
        # Two stages of the first unit: mid-way through a unit, nine stages from the end. Generous
        # time, since a loaded machine starts Ray and its worker slowly (minutes beside benchmarks).
        wait_for(lambda: len(events(run_dir, "stage_done")) >= 2, timeout=600)
    finally:
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    assert first.returncode != 0 and not (run_dir / "manifest.json").exists(), f"rc {first.returncode}: {err}"
    before = {(e["unit"], e["stage"]) for e in events(run_dir, "stage_done")}

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert ray_or_tune_lines(second.stdout + second.stderr) == []  # the embedded Ray's lines: in the run's ray.log
    assert "Started a local Ray instance" in RunLayout(run_dir).ray_log.read_text()
    starts = events(run_dir, "run_started")
    # the ledger rebuilt from the store knows every finished stage (a stage may have finished on the
    # worker after the driver stopped logging: its checkpoint counts too)
    assert len(starts) == 2 and starts[1]["stages_done"] >= len(before) > 0
    runs_after = [(e["unit"], e["stage"]) for e in events(run_dir, "stage_done")][len(before):]
    assert not set(runs_after) & before                           # nothing finished was recomputed
    assert len(runs_after) == 3 * 4 - starts[1]["stages_done"]    # only the missing stages ran
    for unit, stage in starts[1]["resumed"].items():              # partial units restart mid-way
        assert min(s for u, s in runs_after if u == unit) == stage
    _, labels, ipc = read(run_dir)
    assert sorted(zip(labels.tolist(), ipc.tolist())) == [(c, i) for c in range(10) for i in range(3)]


def test_patches_are_scored_once_per_class_per_run_with_2_workers(local_ray, digits_teacher, tmp_path):
    teacher = digits_teacher[0]
    cfg = make_config("fadrm", overrides={**CFG, "classes_per_batch": 0, "ipc": 4})  # one shard of 10 classes
    result = distill(coordinator, cfg, [teacher], tmp_path, ExecutionSpec(workers=2, progress=False))
    run_dir = result.run_dir
    scored = events(run_dir, "patches_scored")
    assert sorted(e["label"] for e in scored) == list(range(10))     # each class once, not once per worker
    assert len({e["pid"] for e in scored}) == 2                      # the scoring is spread over the workers
    stages = events(run_dir, "stage_done")
    assert len({e["pid"] for e in stages}) == 2 and sum(e["patches_scored"] for e in stages) == 0
    assert sorted(events(run_dir, "unit_done")[i]["unit"] for i in range(2)) == [
        "shard0000-ipc00000-00002", "shard0000-ipc00002-00004"]     # IPC 4 on 2 workers: two units of 2

    grown = distill(coordinator, make_config("fadrm", overrides={**CFG, "classes_per_batch": 0, "ipc": 6}),
                    [teacher], tmp_path, ExecutionSpec(workers=2, progress=False))
    assert grown.run_id == result.run_id and len(events(run_dir, "patches_scored")) == 10  # kept in the run
    assert sum(e["patches_scored"] for e in events(run_dir, "stage_done")) == 0
    assert sorted(grown.units_run) == ["shard0000-ipc00004-00005", "shard0000-ipc00005-00006"]
    local = distill(execute, make_config("fadrm", overrides={**CFG, "classes_per_batch": 0, "ipc": 6}), [teacher],
                    tmp_path / "local", LOCAL)
    assert all(torch.equal(a, b) for a, b in zip(read(local.run_dir), read(run_dir)))


def test_every_worker_starts_with_passive_openmp_and_its_thread_count(local_ray, digits_teacher, tmp_path):
    from actors.pool import WorkerPool

    coordinator = WorkerPool(workers=2, cpus_per_worker=1, progress=False)
    try:
        infos = ray.get([w.ping.remote() for w in coordinator.workers])
        environs = [dict(item.split("=", 1) for item in open(f"/proc/{i.pid}/environ").read().split("\0") if "=" in item)
                    for i in infos]
    finally:
        coordinator.close()
    assert len({i.pid for i in infos}) == 2
    for info, environ in zip(infos, environs):
        assert environ["OMP_WAIT_POLICY"] == "PASSIVE" and environ["OMP_NUM_THREADS"] == "1"
        assert info.torch_threads == 1 and info.omp_wait_policy == "PASSIVE"
