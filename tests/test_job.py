"""`ray job submit` against a real Ray head started with token authentication (slow)."""
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_job_submit_runs_a_distillation(digits_teacher, tmp_path):
    home = tmp_path / "home"  # `ray get-auth-token --generate` writes HOME/.ray/auth_token
    home.mkdir()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "HOME": str(home)}
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    gcs, dash = free_port(), free_port()
    head = subprocess.Popen(["ray", "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
                             "--num-cpus=2", "--include-dashboard=true", "--disable-usage-stats", "--block"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 90
        while time.time() < deadline:
            probe = subprocess.run(["ray", "job", "list", "--address", address], env=env, capture_output=True)
            if probe.returncode == 0:
                break
            time.sleep(2)
        out = tmp_path / "store"
        submit = subprocess.run(
            ["ray", "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
             "python", "-m", "actors.job", "distill", "--dataset", "digits", "--teacher", str(digits_teacher[0]),
             "--ipc", "1", "--set", "iterations=20", "--out", str(out), "--json", "--quiet"],
            env=env, capture_output=True, text=True, timeout=300)
        assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
        result = json.loads(next(line for line in submit.stdout.splitlines() if line.startswith("{")))
        assert result["images"] == 10 and Path(result["run_dir"], "manifest.json").is_file()
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # only the head this test started
        head.wait(timeout=60)
