"""fadrm's output is its own: Ray's lines go to the ray.log of the run (or sweep), and `--verbose`
brings them back to the terminal (actors.ray_output)."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from actors.ray_output import _kept as kept_records
from actors.ray_output import ray_output
from fadrm_ray.layout import RunLayout
from fadrm_ray.runs.job import ExecutionSpec
from tests.ray_helpers import ray_or_tune_lines

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ray_handler_on_stderr():
    """Ray's own handler on the `ray` logger writes to the stderr of the moment Ray was first
    imported (another test's, in a whole run): one bound to this test's stderr stands for it."""
    import ray  # noqa: F401 - Ray puts its handler on the logger as it is first imported

    logger = logging.getLogger("ray")
    saved = list(logger.handlers)
    logger.handlers[:] = [logging.StreamHandler(sys.stderr)]
    try:
        yield
    finally:
        logger.handlers[:] = saved


def test_ray_records_go_to_the_log_and_come_back_with_verbose(tmp_path, capsys, ray_handler_on_stderr):
    ray_logger = logging.getLogger("ray.tune.tune")
    log = tmp_path / "run" / "ray.log"
    owner = ExecutionSpec()
    with ray_output(None, owner=owner):  # no file yet: kept for the owner's next block
        logging.getLogger("ray").info("Connecting to existing Ray cluster at address: \x1b[1m10.0.0.1:6379\x1b[22m")
    with ray_output(log, stdout=True, owner=owner):
        ray_logger.warning("Resume experiment with: Tuner.restore(path=...)")
        print("View detailed results here: /x")
    assert capsys.readouterr() == ("", "")
    text = log.read_text()
    assert "Connecting to existing Ray cluster at address: 10.0.0.1:6379" in text and "\x1b" not in text
    assert "WARNING" in text and "Tuner.restore(path=...)" in text and "View detailed results here: /x" in text
    assert text.index("Connecting") < text.index("Tuner.restore")
    with ray_output(log, verbose=True, stdout=True):
        ray_logger.warning("Resume experiment with: Tuner.restore(path=...)")
        print("View detailed results here: /y")
    out, err = capsys.readouterr()
    assert out == "" and "Tuner.restore(path=...)" in err and "View detailed results here: /y" in err
    ray_logger.warning("after the block")  # Ray's own handler again
    assert "after the block" in capsys.readouterr().err and "after the block" not in log.read_text()


def test_records_kept_for_a_run_go_to_that_run_and_no_other(run_copy, digits, digits_teacher, tmp_path):
    """`fadrm distill --address` asks the cluster for its GPUs before it knows its run: Ray's
    records of that are kept for the spec that asked (by identity: an equal spec is another
    run's), and written to the ray.log of the run made with it, even one that needs no worker.
    Another run's log never gets them, and those of a spec that is gone are dropped."""
    from actors import coordinator
    from fadrm_ray.config import make_config
    from fadrm_ray.runs.job import prepare_job

    asked, other = ExecutionSpec(address="10.0.0.1:6379"), ExecutionSpec(address="10.0.0.1:6379")
    with ray_output(None, owner=asked):
        logging.getLogger("ray").info("Connecting to existing Ray cluster at address: 10.0.0.1:6379 (asked)")
    gone = ExecutionSpec(address="10.0.0.1:6379")
    with ray_output(None, owner=gone):
        logging.getLogger("ray").warning("a record of a run that never came")
    key = id(gone)
    del gone
    assert key not in kept_records  # dropped with the spec: a later object of the same id starts empty
    with ray_output(tmp_path / "other" / "ray.log", owner=other):
        pass
    assert not (tmp_path / "other" / "ray.log").exists()  # no record for it: no file either

    cfg = make_config("fadrm", overrides={"ipc": 3, "iterations": 8, "ipc_per_unit": 2, "precision": "fp32"})
    job, parts = prepare_job(cfg, digits, "digits", [digits_teacher[0]], run_copy.parent, device_type="cpu")
    assert job.run_dir == run_copy
    before = RunLayout(run_copy).ray_log.read_text() if RunLayout(run_copy).ray_log.exists() else ""
    result = coordinator.run(job, asked, parts)  # every unit is there: no Ray, no worker
    assert result.units_run == []
    text = RunLayout(run_copy).ray_log.read_text()
    assert text.startswith(before) and text.count("(asked)") == 1 and "never came" not in text
    with ray_output(tmp_path / "later" / "ray.log", owner=asked):  # taken once
        logging.getLogger("ray").info("a later block")
    assert "(asked)" not in (tmp_path / "later" / "ray.log").read_text()


@pytest.mark.ray
def test_distill_on_a_cluster_prints_no_ray_line_unless_verbose(digits_teacher, tmp_path):
    """`fadrm distill --address` on a local cluster the test starts: Ray's "Connecting to existing
    Ray cluster" lines (twice: the GPU count, then the run) are in the run's ray.log, not on the
    terminal; with --verbose they are on the terminal."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        def distill(seed: int, *flags: str) -> subprocess.CompletedProcess:
            command = [sys.executable, "-m", "actors.cli", "distill", "--dataset", "digits", "--teacher",
                       str(digits_teacher[0]), "--ipc", "1", "--set", "iterations=4", "--set", "precision=fp32",
                       "--seed", str(seed), "--workers", "1", "--address", cluster.address, "--out",
                       str(tmp_path / "store"), "--quiet", *flags]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            return done

        quiet = distill(0)
        assert ray_or_tune_lines(quiet.stdout + quiet.stderr) == [], quiet.stderr
        run_dir = Path(quiet.stdout.split("run: ")[1].split()[0])
        log = RunLayout(run_dir).ray_log.read_text()
        assert log.count("Connecting to existing Ray cluster") == 2 and "\x1b" not in log
        loud = distill(1, "--verbose")  # another run: this one starts workers again
        assert "Connected to Ray cluster" in loud.stderr
        assert not RunLayout(loud.stdout.split("run: ")[1].split()[0]).ray_log.exists()
    finally:
        cluster.shutdown()
