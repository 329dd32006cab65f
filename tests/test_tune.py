"""`fadrm tune`: the search space checked before any trial, and small sweeps on a local Ray."""
from __future__ import annotations

import json

import pytest
import yaml

from actors.cli import main
from tune.space import parse_space, split_space

# A trial small enough for a shared 2-core CPU: digits, IPC 1, 8 recover iterations, one student
# of 8 epochs.
TINY = ["--ipc", "1", "--param", "iterations=8", "--param", "precision=fp32", "--seeds", "1", "--epochs", "8"]


def sweep_args(teacher, out, *extra):
    return ["tune", "--dataset", "digits", "--teacher", str(teacher), *TINY, "--out", str(out), *extra]


def events(out, name):
    path = out / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name] if path.is_file() else []


# --------------------------------------------------------------------------- the space, no Ray
def test_specs_are_grids_distributions_or_fixed_values():
    space = parse_space(["alpha=0.3,0.5", "k=1", "lr=loguniform(0.01,0.3)", "stage_resolutions=[6,8],[8,8]",
                         "downsample_size=null,6", "r_bn=choice(0.01,0.05)", "iterations=randint(10,20)"])
    fixed, swept = split_space(space)
    assert fixed == {"k": 1}
    assert swept["alpha"].values == (0.3, 0.5) and swept["alpha"].kind == "grid"
    assert swept["lr"].kind == "loguniform" and swept["lr"].values == (0.01, 0.3)
    assert swept["stage_resolutions"].values == ([6, 8], [8, 8])
    assert swept["downsample_size"].values == (None, 6)
    assert swept["r_bn"].kind == "choice" and swept["iterations"].kind == "randint"


@pytest.mark.parametrize("param, key", [
    ("alpha=0.5,2", "alpha"),                 # out of (0, 1]
    ("alphaa=0.5", "alphaa"),                 # unknown key
    ("k=uniform(1,3)", "k"),                  # an integer key sampled as floats
    ("downsample_size=6,20", "downsample_size"),  # larger than digits' 8 px
    ("lr=loguniform(0,1)", "lr"),             # a log range must be positive
    ("patch_selection=easy,hardest", "patch_selection"),
])
def test_bad_param_exits_2_with_one_line_naming_the_key(param, key, tmp_path, capsys, digits_teacher):
    code = main(sweep_args(digits_teacher[0], tmp_path / "out", "--param", param))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and key in err[0] and err[0].startswith("fadrm tune: error:"), err
    assert not (tmp_path / "out").exists()  # nothing started


def test_optuna_search_needs_optuna(tmp_path, capsys, digits_teacher):
    pytest.importorskip("ray")
    try:
        import optuna  # noqa: F401
        pytest.skip("optuna is installed here")
    except ImportError:
        pass
    code = main(sweep_args(digits_teacher[0], tmp_path / "out", "--param", "alpha=0.3,0.5", "--search", "optuna"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install optuna" in err[0]


# --------------------------------------------------------------------------- sweeps on Ray
@pytest.fixture(scope="module")
def alpha_sweep(digits_teacher, tmp_path_factory):
    """A 4-trial sweep over alpha, then the same command again: (out, first summary, second summary)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("sweep") / "alpha"
    args = sweep_args(digits_teacher[0], out, "--param", "alpha=0.3,0.5,0.7,0.9", "--scheduler", "fifo",
                      "--max-concurrent", "2", "--json")
    summaries = []
    for _ in range(2):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(args) == 0
        summaries.append(json.loads(buf.getvalue()))
    return out, summaries[0], summaries[1]


@pytest.mark.ray
def test_a_four_trial_sweep_completes_and_writes_its_results(alpha_sweep):
    out, summary, _ = alpha_sweep
    rows = summary["rows"]
    assert summary["trials"] == 4 and not summary["resumed"]
    assert sorted(r["alpha"] for r in rows) == [0.3, 0.5, 0.7, 0.9]
    assert all(r["state"] == "done" and 0 <= r["top1"] <= 100 for r in rows)  # every trial reported
    assert all(r["units_run"] >= 1 and r["distill_seconds"] > 0 and r["node_id"] for r in rows)
    assert len((out / "results.csv").read_text().strip().splitlines()) == 1 + 4
    md = (out / "results.md").read_text()
    table = [line for line in md.split("\n\n")[1].splitlines() if line.startswith("| ")]  # the trials' table
    assert len(table) == 1 + 4
    assert (out / "top1_vs_alpha.png").stat().st_size > 0
    # The best is the one of the three best trials that leads on three new student seeds.
    confirmation = summary["confirmation"]
    assert confirmation["new_seeds"] and confirmation["seeds"] == [1, 2, 3] and len(confirmation["trials"]) == 3
    assert summary["best"]["trial"] == confirmation["best"] == confirmation["trials"][0]["trial"]
    assert summary["best"]["top1"] >= sorted(r["top1"] for r in rows)[-3]
    assert "random real images" in (out / "results.md").read_text().split("**Best: trial")[1]
    # Each trial beside random real images of its classes and IPC (one seed: never "clearly" below).
    assert summary["random_real"].startswith("random real images: ")
    assert all(r["vs_random"].endswith("higher on 1 of 1 seed") or r["vs_random"].endswith("higher on 0 of 1 seed")
               for r in rows)
    assert not any(r["below_random"] for r in rows) and "vs random real" in table[0]


@pytest.mark.ray
def test_patches_are_scored_once_per_sweep_not_per_trial(alpha_sweep):
    out, summary, _ = alpha_sweep
    scored = events(out, "patches_scored")
    assert len(scored) == 1 and scored[0]["classes"] == 10
    assert summary["patches"] == {"keys": 1, "scored": 10, "seconds": pytest.approx(scored[0]["seconds"])}
    assert all(r["patches_scored"] == 0 for r in summary["rows"])  # every trial reused them
    # ... and each run keeps them, as any run does.
    for row in summary["rows"]:
        assert len(list((out / "store" / row["run_id"] / "patches").glob("label=*.json"))) == 10


@pytest.mark.ray
def test_rerunning_the_same_command_resumes_without_rerunning_trials(alpha_sweep):
    out, first, second = alpha_sweep
    assert second["resumed"] and second["trials"] == 4
    assert len(events(out, "trial_started")) == 4       # no trial started again
    assert len(events(out, "distilled")) == 4           # no recover stage ran again
    assert len(events(out, "patches_scored")) == 1
    assert {r["trial"]: r["top1"] for r in second["rows"]} == {r["trial"]: r["top1"] for r in first["rows"]}


@pytest.mark.ray
def test_best_yaml_runs_through_fadrm_distill(alpha_sweep, digits_teacher, capsys):
    out, summary, _ = alpha_sweep
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["alpha"] == summary["best"]["alpha"] and best["iterations"] == 8
    capsys.readouterr()
    code = main(["distill", "--local", "--threads", "1", "--quiet", "--json", "--config", str(out / "best.yaml"),
                 "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--out", str(out / "store")])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    # The same run as the best trial's, served from the sweep's store (content-addressed).
    assert result["run_id"] == summary["best"]["run_id"]
    assert result["units_run"] == [] and result["units_skipped"]


@pytest.mark.ray
def test_a_changed_command_on_the_same_out_is_refused(alpha_sweep, digits_teacher, capsys):
    out, _, _ = alpha_sweep
    capsys.readouterr()
    code = main(sweep_args(digits_teacher[0], out, "--param", "alpha=0.3,0.6"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "another sweep" in err[0] and "params" in err[0]


@pytest.mark.ray
def test_asha_stops_a_clearly_bad_trial(digits_teacher, tmp_path, capsys):
    """Gaussian noise recovered for 8 iterations (init=noise) teaches a student far less than real
    patches do: its students trail at every evaluation, so ASHA ends those trials at its rung of
    the students' schedule, while a trial on real patches finishes."""
    out = tmp_path / "asha"
    args = ["tune", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--ipc", "2",
            "--param", "init=real,noise", "--param", "seed=0,1", "--param", "alpha=1", "--param", "iterations=8",
            "--param", "precision=fp32", "--seeds", "1", "--epochs", "40", "--max-concurrent", "1",
            "--out", str(out), "--json"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = summary["rows"]
    assert summary["random_real"].startswith("not compared: the trials sweep the seed or the classes")
    bad = [r for r in rows if r["init"] == "noise"]
    assert len(bad) == 2 and all(r["state"] == "stopped" and r["student_pct"] < 100 for r in bad)
    assert any(r["state"] == "done" for r in rows if r["init"] == "real")
    # A stopped trial's distillation is done: its images are in the store.
    from fadrm_ray.store import open_run
    for row in bad:
        assert open_run(out / "store" / row["run_id"]).complete


@pytest.mark.ray
def test_a_trial_clearly_below_random_real_images_is_marked(digits_teacher, tmp_path, capsys):
    """Gaussian noise no iteration moved (init=noise, T = 0) teaches far less than random real
    images of the same classes and IPC: the sweep marks that trial in its rows and results.md."""
    out = tmp_path / "below"
    args = ["tune", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--ipc", "2",
            "--param", "init=noise", "--param", "alpha=1", "--param", "iterations=0", "--seeds", "3", "--epochs", "40",
            "--scheduler", "fifo", "--confirm-seeds", "0", "--out", str(out), "--json"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    [row] = summary["rows"]
    assert row["state"] == "done" and row["below_random"] is True, row
    assert row["vs_random"].startswith("-") and row["vs_random"].endswith("higher on 0 of 3 seeds")
    assert "1 finished trial clearly below them" in summary["random_real"]
    line = next(x for x in (out / "results.md").read_text().splitlines() if x.startswith(f"| {row['trial']} "))
    assert f"{row['vs_random']} **below**" in line
    # With no new seeds the best is judged on the trials' own, and said to be below random real images.
    assert "Against random real images: -" in (out / "results.md").read_text()
    assert "below random real images by more than two standard errors" in (out / "results.md").read_text()


@pytest.mark.ray
@pytest.mark.slow
def test_trials_spread_over_the_nodes_of_a_cluster(digits_teacher, tmp_path, capsys):
    """Two raylets of one CPU each (ray.cluster_utils.Cluster): the two trials of a sweep run at
    once, one per node, and the results name both nodes."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        out = tmp_path / "cluster"
        assert main(sweep_args(digits_teacher[0], out, "--param", "alpha=0.3,0.7", "--scheduler", "fifo",
                               "--json")) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert len(rows) == 2 and all(r["state"] == "done" for r in rows)
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert {r["node_id"] for r in rows} == nodes and len(nodes) == 2
        assert "node" in (out / "results.md").read_text().splitlines()[2]
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_space_file_and_the_command_line_combine(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("alpha: [0.3, 0.5]\nk: 2\nlr: loguniform(0.01, 0.3)\ndownsample_size: [null, 6]\n")
    fixed, swept = split_space(parse_space(["alpha=0.7,0.9"], space))
    assert fixed == {"k": 2}
    assert swept["alpha"].values == (0.7, 0.9)  # the command line wins
    assert swept["lr"].kind == "loguniform" and swept["downsample_size"].values == (None, 6)


def test_every_combination_is_checked_by_the_config_model(digits):
    from fadrm_ray.settings import ConfigError
    from tune.settings import TrialBase
    from tune.space import validate_space

    base = TrialBase(preset="fadrm", ipc=1)
    _, swept = split_space(parse_space(["k=1,3", "stage_resolutions=[6,8],[8,8]"]))
    with pytest.raises(ConfigError, match="stage_resolutions must have k \\+ 1"):
        validate_space(base, swept, digits)
    _, swept = split_space(parse_space(["k=1,3", "alpha=uniform(0.2,0.9)"]))
    assert validate_space(base, swept, digits) == 4  # 2 values of k x both ends of alpha


@pytest.mark.ray
@pytest.mark.slow
def test_a_trial_can_fan_its_distillation_out_over_workers_in_its_placement_group(digits_teacher, tmp_path, capsys):
    from tests.ray_helpers import events as ledger_events

    out = tmp_path / "workers"
    args = sweep_args(digits_teacher[0], out, "--param", "alpha=0.3,0.7", "--param", "ipc_per_unit=1", "--ipc", "2",
                      "--workers-per-trial", "2", "--cpus-per-trial", "0.5", "--max-concurrent", "1",
                      "--scheduler", "fifo", "--json")
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 2 and all(r["state"] == "done" for r in rows)
    for row in rows:
        run_dir = out / "store" / row["run_id"]
        assert len(ledger_events(run_dir, "worker_started")) == 2
        assert not ledger_events(run_dir, "patches_scored")  # the sweep's rankings were used


def _live_distill_workers() -> list[str]:
    """The DistillWorker actors of the current Ray that are not dead, from the GCS's actor table
    (the state API needs a dashboard, which the tests' Rays do not start)."""
    from ray._private.state import actors

    return [a["ActorID"] for a in actors().values()
            if a["ActorClassName"].endswith("DistillWorker") and a["State"] != "DEAD"]


@pytest.mark.ray
def test_a_cpu_sweep_with_workers_on_a_cluster_with_gpus_distills_on_cpu_and_leaves_no_workers(
        digits_teacher, tmp_path, capsys):
    """A CPU sweep (no --gpus-per-trial) fanning out over DistillWorkers on a Ray that has a GPU
    (declared here; no hardware needed): the trial's device, cpu, is what its workers run on,
    the trial finishes, and no DistillWorker outlives it."""
    import ray

    from tests.ray_helpers import wait_for

    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024 * 1024)
    try:
        out = tmp_path / "cpu-on-gpu-cluster"
        args = sweep_args(digits_teacher[0], out, "--param", "alpha=0.5", "--workers-per-trial", "2",
                          "--cpus-per-trial", "0.5", "--max-concurrent", "1", "--scheduler", "fifo", "--json")
        assert main(args) == 0
        [row] = json.loads(capsys.readouterr().out)["rows"]
        assert row["state"] == "done", row
        manifest = json.loads((out / "store" / row["run_id"] / "manifest.json").read_text())
        assert manifest["summary"]["executor"] == "ray" and manifest["summary"]["device"] == "cpu"
        assert wait_for(lambda: not _live_distill_workers(), timeout=30) is True
    finally:
        ray.shutdown()


@pytest.fixture
def ray_with_a_gpu():
    """An embedded local Ray of two CPUs that declares one GPU (Ray takes the count on trust: no
    hardware is needed), as a GPU cluster looks to a CPU sweep."""
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024 * 1024)
    yield
    ray.shutdown()


def _cpu_trial_on_workers(digits_teacher, tmp_path):
    """What a CPU sweep with --workers-per-trial 2 hands its trials, and the trial's config."""
    from fadrm_ray.config import EvalConfig
    from tune.settings import TrialBase, TrialSettings
    from tune.space import trial_config

    base = TrialBase(preset="fadrm", ipc=2, fixed={"iterations": 8, "precision": "fp32", "ipc_per_unit": 1})
    sweep = TrialSettings(base=base, eval=EvalConfig(), dataset="digits", teachers=[str(digits_teacher[0])],
                          store=str(tmp_path / "store"), device="cpu", threads=1, workers_per_trial=2,
                          cpus_per_worker=0.5, events=str(tmp_path / "events.jsonl"))
    return sweep, trial_config(base, {})


@pytest.mark.ray
def test_a_cpu_trial_on_workers_distills_on_cpu_where_the_cluster_has_a_gpu(ray_with_a_gpu, digits, digits_teacher,
                                                                            tmp_path):
    from tests.ray_helpers import wait_for
    from tune.trainable import distill_trial

    sweep, cfg = _cpu_trial_on_workers(digits_teacher, tmp_path)
    state, _ = distill_trial(cfg, digits, list(sweep.teachers), sweep, None)
    manifest = json.loads((tmp_path / "store" / state.run_dir.rsplit("/", 1)[-1] / "manifest.json").read_text())
    assert manifest["summary"]["executor"] == "ray" and manifest["summary"]["device"] == "cpu"
    assert state.units_run == 2
    assert wait_for(lambda: not _live_distill_workers(), timeout=30) is True


@pytest.mark.ray
def test_a_trial_whose_distillation_fails_stops_its_workers(ray_with_a_gpu, digits, digits_teacher, tmp_path,
                                                            monkeypatch):
    import fadrm_ray.runs.execute
    from tests.ray_helpers import wait_for
    from tune.trainable import distill_trial

    held = []  # what a kept traceback would hold: actor handles alone do not end the actors
    run_job = fadrm_ray.runs.execute.run_job

    def failing_run_job(job, executor, parts=None):
        if not hasattr(executor, "workers"):  # the Ray door's look for units left to do, before Ray
            return run_job(job, executor, parts)
        assert executor.workers  # the pool's actors are started
        held.append(executor)
        raise RuntimeError("injected failure before the job ran")

    monkeypatch.setattr(fadrm_ray.runs.execute, "run_job", failing_run_job)
    sweep, cfg = _cpu_trial_on_workers(digits_teacher, tmp_path)
    with pytest.raises(RuntimeError, match="injected failure"):
        distill_trial(cfg, digits, list(sweep.teachers), sweep, None)
    assert wait_for(lambda: not _live_distill_workers(), timeout=30) is True


def test_a_trial_report_goes_through_tune_and_back_as_its_model():
    from tune.results import TrialRow
    from tune.settings import TrialReport

    report = TrialReport(top1=61.5, student_pct=100.0, final=True, node_id="n1", host="h", run_id="r",
                         distill_seconds=1.5, units_run=2, patches_scored=0, top1_std=0.5,
                         top1_per_seed=[61.0, 62.0], student_seconds=3.0, evaluation_cached=False, trial_seconds=5.0)
    metrics = {**report.model_dump(), "trial_id": "abc_00000", "training_iteration": 3, "done": True}  # Tune's keys
    assert TrialReport.from_metrics(metrics) == report
    assert TrialReport.from_metrics({}) is None and TrialReport.from_metrics({"trial_id": "x"}) is None
    row = TrialRow.of("abc_00000", {"alpha": 0.5}, "done", report)
    assert row.top1_per_seed == [61.0, 62.0] and row.vs_random is None
    assert list(row.flat())[:3] == ["trial", "alpha", "top1"] and row.flat()["alpha"] == 0.5


def test_the_fixed_values_are_config_keys():
    from pydantic import ValidationError

    from tune.settings import TrialBase

    assert TrialBase(preset="fadrm", fixed={"alpha": 0.5}).fixed == {"alpha": 0.5}
    with pytest.raises(ValidationError, match="alphaa"):
        TrialBase(preset="fadrm", fixed={"alphaa": 0.5})
