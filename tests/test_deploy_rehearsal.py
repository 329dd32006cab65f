"""The deploy/README.md commands rehearsed on one machine: a real Ray head and a real Ray worker,
started as separate processes on 127.0.0.1 with `ray start` (a temp dir for each node, a private
HOME, their own ports, token authentication on), then

- a distillation submitted with the README's `ray job submit` command,
- a 2-trial sweep submitted the same way, under the default scheduler (ASHA), with trials on both
  raylets,
- `fadrm serve` started as the README says, pointed at that head, serving a class-subset request
  made with the README's `curl` commands,

each read back from the store. The README's commands are taken from its `rehearsal` blocks and
run as they are, except that the site-specific values are swapped for a tiny budget (the digits
dataset, a small teacher, 20 recover iterations, /shared paths under a temp dir, free ports) and
that the rehearsal's head takes work (1 CPU, so that trials land on both raylets).

Everything this module starts carries a marker in its environment; at the end every such process
is stopped by its id (the process groups of `ray start`, then what is left, by pid), never with
Ray's own stop command (it would end every Ray process on the machine), and the module fails if any is left.
"""
from __future__ import annotations

import csv
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bench.rehearsal.deploy import (Rehearsal, after_double_dash, free_port, readme_blocks, readme_command,
                                    replace_flags, swap)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, digits_teacher):
    rehearsal = Rehearsal(tmp_path_factory.mktemp("rehearsal"))
    try:
        rehearsal.start()
        rehearsal.teacher = digits_teacher[0]
        yield rehearsal
    finally:
        left = rehearsal.close()
        assert not left, f"processes left behind: {left}"


def json_result(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


# --------------------------------------------------------------------------- the rehearsal
def test_readme_distillation_runs_on_the_two_node_cluster(cluster, tmp_path):
    from fadrm_ray.store import open_run

    words = readme_command("distill", "ray")
    store = tmp_path / "fadrm-store"
    job = after_double_dash(words)
    tiny = replace_flags(job, {"--dataset": "digits", "--teacher": str(cluster.teacher), "--ipc": "2",
                               "--workers": "2", "--gpus-per-worker": None, "--out": str(store)},
                         ["--set", "iterations=20"])
    submit = [w.replace("$RAY_ADDRESS", cluster.env["RAY_ADDRESS"]) for w in words[:words.index("--") + 1]] + tiny
    assert submit[:3] == ["ray", "job", "submit"] and "deploy/runtime_env.yaml" in submit
    done = cluster.run(submit, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json_result(done.stdout)
    run_dir = Path(result["run_dir"])
    assert result["images"] == 20 and (run_dir / "manifest.json").is_file()
    images, labels, ipc = open_run(run_dir).read()
    assert sorted(zip(labels.tolist(), ipc.tolist())) == [(c, i) for c in range(10) for i in range(2)]
    assert len(images) == 20
    # the two DistillWorker actors ran one on each raylet
    workers = cluster.actors("DistillWorker")
    assert len({a["node_id"] for a in workers}) == 2, workers


def test_readme_sweep_puts_trials_on_both_raylets(cluster, tmp_path):
    words = readme_command("sweep", "ray")
    out = tmp_path / "sweeps" / "digits-alpha"
    job = after_double_dash(words)
    tiny = replace_flags(job, {"--dataset": "digits", "--teacher": str(cluster.teacher), "--ipc": "1",
                               "--param": ["alpha=0.3,0.7"], "--cpus-per-trial": "1", "--gpus-per-trial": None,
                               "--out": str(out)},
                         ["--param", "iterations=20", "--seeds", "1", "--max-concurrent", "2"])
    assert "--scheduler" not in tiny  # the default scheduler, ASHA, as the README's sweep runs it
    submit = [w.replace("$RAY_ADDRESS", cluster.env["RAY_ADDRESS"]) for w in words[:words.index("--") + 1]] + tiny
    done = cluster.run(submit, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((out / "sweep.json").read_text())["identity"]["scheduler"] == "asha"
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    # ASHA lets the first trial at its rung go on; the other finishes or is stopped there
    assert {r["state"] for r in rows} <= {"done", "stopped"} and "done" in {r["state"] for r in rows}, rows
    node_column = next(c for c in rows[0] if "node" in c.lower())
    assert len({r[node_column] for r in rows}) == 2, rows
    assert (out / "best.yaml").is_file()


def test_readme_service_serves_a_class_subset(cluster, tmp_path):
    import pyarrow.parquet as pq

    store, teachers = tmp_path / "fadrm-store", tmp_path / "teachers"
    teachers.mkdir()
    shutil.copy(cluster.teacher, teachers / "digits-tiny.pt")
    port = free_port()
    serve = swap(readme_blocks()["serve"], {"/shared/fadrm-store": str(store), "/shared/teachers": str(teachers),
                                            "FADRM_RAY_ADDRESS=auto": f"FADRM_RAY_ADDRESS={cluster.gcs}",
                                            "--port 8000": f"--port {port}"})
    started = cluster.bash(serve)
    assert started.returncode == 0, started.stderr
    url = f"http://127.0.0.1:{port}"
    token = (cluster.home / ".fadrm" / "api_token").read_text().strip()
    deadline = time.time() + 120
    while time.time() < deadline:
        if subprocess.run(["curl", "-sf", f"{url}/healthz"], capture_output=True).returncode == 0:
            break
        time.sleep(1)
    else:
        raise AssertionError((cluster.home / "fadrm-serve.log").read_text()[-3000:])

    # README step 8, its curl commands with the tiny request
    curls = [c for c in readme_command_list("curl") if c[0] == "curl"]
    post, status, download = curls
    def expand(words, **extra):
        return [w.replace("$FADRM_URL", url).replace("$FADRM_API_TOKEN", token)
                .replace("$ID", extra.get("job_id", "$ID")) for w in words]
    body = json.loads(post[post.index("-d") + 1])
    body.update(dataset="digits", teacher="digits-tiny", classes=[3, 7], ipc=2, overrides={"iterations": 20})
    post = expand(post)
    post[post.index("-d") + 1] = json.dumps(body)
    created = subprocess.run(post, capture_output=True, text=True, timeout=60)
    assert created.returncode == 0, created.stderr
    job = json.loads(created.stdout)
    deadline = time.time() + 600
    while time.time() < deadline:
        state = json.loads(subprocess.run(expand(status, job_id=job["id"]), capture_output=True, text=True).stdout)
        if state["state"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(2)
    assert state["state"] == "succeeded", state
    download = expand(download, job_id=job["id"])
    download[download.index("-o") + 1] = str(tmp_path / "subset.parquet")
    fetched = subprocess.run(download, capture_output=True, text=True, timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    table = pq.read_table(tmp_path / "subset.parquet")
    labels = table.column("label").to_pylist()
    assert sorted(labels) == [3, 3, 7, 7]
    assert b"huggingface" in (table.schema.metadata or {})


def readme_command_list(name: str) -> list[list[str]]:
    from bench.rehearsal.deploy import shell_commands

    return shell_commands(readme_blocks()[name])
