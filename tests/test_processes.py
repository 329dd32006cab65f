"""Every heavy process starts with the passive OpenMP wait policy and a thread count that fits its
CPUs (fadrm_ray/runtime.py): the `fadrm` commands here; the Ray workers in test_ray.py.

The processes are inspected, not timed: /proc/<pid>/environ holds the environment a process
started with (what libgomp read when torch loaded), and each command reports its torch threads.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from fadrm_ray.runtime import available_cpus, heavy_process_env

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")


def clean_env() -> dict:
    """This environment without any OpenMP or allocator setting: the command must add them."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OMP_", "MALLOC_")) and k not in ("FADRM_DEFAULT_OMP", "FADRM_DEFAULT_MALLOC")}


def start_environ(pid: int) -> dict:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def fadrm(*argv, watch: bool = False) -> tuple[dict, dict]:
    """Run `fadrm ARGV --json --quiet` in a fresh process; its JSON, and (watch) the environment the
    process had once it was running (it re-executes itself once, keeping its pid)."""
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", *argv, "--json", "--quiet"], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict = {}
    while watch and proc.poll() is None and "OMP_WAIT_POLICY" not in seen:
        seen = start_environ(proc.pid)
        time.sleep(0.01)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), seen


def test_squeeze_distill_and_evaluate_start_with_passive_openmp_and_their_threads(tmp_path):
    cpus = str(available_cpus())
    squeezed, _ = fadrm("squeeze", "--dataset", "digits", "--epochs", "1", "--set", "model_kwargs={width: 8}",
                        "--threads", "1", "--out", str(tmp_path / "teacher"))
    distilled, environ = fadrm("distill", "--local", "--dataset", "digits", "--teacher", squeezed["teacher"],
                               "--ipc", "1", "--set", "iterations=4", "--out", str(tmp_path / "store"), watch=True)
    evaluated, _ = fadrm("evaluate", "--run", distilled["run_dir"], "--epochs", "1", "--seeds", "1",
                         "--no-baselines", "--threads", "1")
    assert environ["OMP_WAIT_POLICY"] == "PASSIVE" and environ["OMP_NUM_THREADS"] == cpus
    assert "MALLOC_TOP_PAD_" in environ  # the allocator settings come with them
    for result, threads in ((squeezed, 1), (distilled, int(cpus)), (evaluated, 1)):
        process = result["process"]
        assert process["omp_wait_policy"] == "PASSIVE" and process["omp_num_threads"] == cpus
        assert process["torch_threads"] == threads  # --threads, else the CPUs this process may use


def test_what_a_heavy_process_gets_and_what_is_left_alone(monkeypatch):
    monkeypatch.delenv("FADRM_DEFAULT_OMP", raising=False)
    monkeypatch.delenv("FADRM_DEFAULT_MALLOC", raising=False)
    env = heavy_process_env(3)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == "3" and "MALLOC_TOP_PAD_" in env
    kept = heavy_process_env(3, {"OMP_WAIT_POLICY": "ACTIVE", "MALLOC_TOP_PAD_": "0"})
    assert "OMP_WAIT_POLICY" not in kept and not any(k.startswith("MALLOC_") for k in kept)  # the user's choice stays
    monkeypatch.setenv("FADRM_DEFAULT_OMP", "1")
    assert not any(k.startswith("OMP_") for k in heavy_process_env(3))
