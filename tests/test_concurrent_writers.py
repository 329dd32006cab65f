"""Two identical commands on one store: the second waits for the first (its run's writer lock)
and then finds every unit done, instead of computing them all again."""
import json
import os
import subprocess
import sys

from fadrm_ray.layout import RunLayout


def test_two_identical_commands_compute_every_unit_once(digits_teacher, tmp_path):
    command = [sys.executable, "-m", "actors.cli", "distill", "--local", "--dataset", "digits", "--teacher",
               str(digits_teacher[0]), "--ipc", "2", "--set", "iterations=48", "--set", "ipc_per_unit=1",
               "--out", str(tmp_path), "--quiet", "--json", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        results.append(json.loads(out))
    # One command did the work; the other waited for it (or came after it) and found it done.
    assert sorted(len(r["units_run"]) for r in results) == [0, 2], results
    assert results[0]["run_id"] == results[1]["run_id"]
    assert not RunLayout(results[0]["run_dir"]).lock.exists()
