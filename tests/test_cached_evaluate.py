"""A cached `fadrm evaluate` is read-only: every result kept, it rewrites no file of the run, its
report or its baselines, opens the run once and loads each teacher once."""
from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

import fadrm_ray.models
from fadrm_ray.config import EvalConfig, make_config
from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.evaluation.store_run import EvalScope, evaluate_store_run
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.store.reader import RunReader

pytestmark = pytest.mark.usefixtures("one_thread")


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root`: its bytes and its mtime_ns."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_cached_evaluate_writes_nothing_opens_the_run_once_and_loads_each_teacher_once(
        digits, digits_teacher, tmp_path, monkeypatch):
    teacher = tmp_path / "teacher.pt"
    shutil.copy(digits_teacher[0], teacher)
    store = tmp_path / "store"
    cfg = make_config("fadrm", overrides={"ipc": 2, "iterations": 8, "ipc_per_unit": 2, "pack": 2,
                                          "classes": [0, 1, 2, 3]})
    spec = ExecutionSpec(local=True, device="cpu", progress=False)
    job, parts = prepare_job(cfg, digits, "digits", [teacher], store, device_type=execute.device_type(spec))
    run_dir = execute.run(job, spec, parts).run_dir
    # As `fadrm evaluate` measures: the run, its baselines, DD-Ranking's scores, the report.
    eval_job = EvalJob(config=EvalConfig(epochs=2, seeds=2))
    eval_spec = EvalSpec(device="cpu", progress=False)
    scope = EvalScope(baselines=True, ranking="full", report=True)
    first = evaluate_store_run(run_dir, eval_job, eval_spec, scope)
    assert not first.evaluation.cached and set(first.evaluation.baselines) == {"random_real", "starting_patches"}
    assert all(b.error is None for b in first.evaluation.baselines.values())
    baseline_dirs = {Path(b.run_dir) for b in first.evaluation.baselines.values()}
    assert all(d.parent == store for d in baseline_dirs)  # beside the run: the snapshot below covers them
    before = _files(store)
    assert {"report/evaluation.json", "report/source.json"} <= {k[len(run_dir.name) + 1:] for k in before}

    opened, loaded = Counter(), Counter()
    reader_init, load_teacher = RunReader.__init__, fadrm_ray.models.load_teacher

    def counting_init(self, layout, *args, **kwargs):
        opened[Path(layout.run_dir).resolve()] += 1
        reader_init(self, layout, *args, **kwargs)

    def counting_load(path, *args, **kwargs):
        loaded[Path(path).resolve()] += 1
        return load_teacher(path, *args, **kwargs)

    monkeypatch.setattr(RunReader, "__init__", counting_init)
    monkeypatch.setattr(fadrm_ray.models, "load_teacher", counting_load)
    again = evaluate_store_run(run_dir, eval_job, eval_spec, scope)

    assert again.evaluation.cached and again.evaluation.top1_per_seed == first.evaluation.top1_per_seed
    assert again.evaluation.baselines == first.evaluation.baselines
    after = _files(store)
    assert sorted(after) == sorted(before), "files appeared or went"
    changed = [name for name in before if after[name] != before[name]]
    assert changed == [], f"a cached evaluate rewrote {changed}"
    assert opened[run_dir.resolve()] == 1, opened
    assert loaded == Counter({teacher.resolve(): 1}), loaded
