"""A run's files read back typed: models on the way back as on the way down.

The store's readers (`fadrm_ray/store/`) turn config.yaml, the manifests and the part files'
provenance into pydantic models (`store.run_files`, `DistillConfig`); nothing else reads those
files' contents as dicts. A run written before the format version was recorded still opens,
evaluates, verifies and exports: `tests/data/run-format-1.tar.gz` is a run made by the code of
that time (`python -m fadrm_ray.data.mnist_sample`'s data, a tiny teacher, IPC 1).
"""
from __future__ import annotations

import ast
from pathlib import Path

from fadrm_ray.config import DistillConfig
from fadrm_ray.store import run_files

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("fadrm_ray", "actors", "api", "tune", "bench", "experiments")
STORE_READERS = ROOT / "fadrm_ray" / "store"

# (module, key): `.get("key")` calls that read something other than a run's files, with why.
NOT_RUN_FILES = {
    ("fadrm_ray/data/base.py", "test_split"): "a dataset's own description (ImageDataset.info)",
    ("fadrm_ray/runs/job.py", "path"): "a dataset's own description (ImageDataset.info)",
    ("fadrm_ray/data/parquet.py", "dataset"): "the metadata of any Parquet dataset a user names, ours or not "
                                              "(a file the service served records its dataset by spec)",
    ("fadrm_ray/data/parquet.py", "hflip"): "the same metadata, from files of any origin",
    ("api/jobs/job_records.py", "config"): "the service's own job record (plan.json), an older service's kept readable",
    ("api/planning/requests.py", "config"): "the service's job record as submitted, before it is validated",
    ("api/web/service.py", "run_id"): "a job record the service could not validate, listed as it is",
    ("bench/accuracy.py", "iterations"): "the bench's own table of overrides",
    ("bench/accuracy.py", "teachers"): "the bench's own result rows (accuracy.json)",
    ("bench/speed/contender.py", "pack"): "the bench's own overrides",
    ("bench/faults.py", "complete"): "`fadrm verify --json`'s output, a command's reply",
    ("bench/rehearsal/imagenet.py", "timings"): "a REST reply (the service's Job)",
    ("bench/rehearsal/report.py", "classes"): "the bench's own results JSON",
    ("bench/rehearsal/report.py", "units"): "the bench's own results JSON",
    ("bench/rehearsal/report.py", "summary"): "the bench's own results JSON",
    ("bench/evaluate_reads.py", "path"): "counts reads of runs of any version, without the package's models",
    ("bench/evaluate_reads.py", "sha256"): "the same: runs of any version",
    ("bench/evaluate_reads.py", "teachers"): "the same: runs of any version",
}


def run_file_keys() -> set[str]:
    models = [getattr(run_files, name) for name in dir(run_files)
              if isinstance(getattr(run_files, name), type) and issubclass(getattr(run_files, name), run_files._RunFile)]
    return {key for model in [*models, DistillConfig] for key in model.model_fields}


def dict_reads(keys: set[str]) -> list[tuple[str, str, int]]:
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if STORE_READERS in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                        and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys):
                    found.append((path.relative_to(ROOT).as_posix(), node.args[0].value, node.lineno))
    return found


def test_no_module_outside_the_store_readers_reads_a_run_file_as_a_dict():
    keys = run_file_keys()
    assert {"teachers", "fingerprint", "files", "packs", "ce", "recipe"} <= keys  # the scan looks for these
    reads = dict_reads(keys)
    unexplained = [f"{path}:{line}: .get({key!r})" for path, key, line in reads if (path, key) not in NOT_RUN_FILES]
    assert unexplained == [], "read the run's files through the store's models (fadrm_ray.store.run_files)"
    stale = sorted(set(NOT_RUN_FILES) - {(path, key) for path, key, _ in reads})
    assert stale == [], "entries of NOT_RUN_FILES that no longer match a read"


def _old_run(tmp_path: Path, version: int = 1) -> tuple[Path, Path]:
    import tarfile

    with tarfile.open(ROOT / "tests" / "data" / f"run-format-{version}.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    (run,) = (tmp_path / "store").iterdir()
    return run, tmp_path / "teacher" / "teacher.pt"


def test_a_run_of_the_first_format_opens_typed_verifies_evaluates_and_exports(tmp_path):
    from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
    from fadrm_ray.evaluation.store_run import EvalScope, evaluate_store_run
    from fadrm_ray.config import EvalConfig
    from fadrm_ray.store import export_imagefolder, open_run
    from fadrm_ray.store.verify import verify_run

    run, teacher = _old_run(tmp_path)
    assert "format_version" not in (run / "manifest.json").read_text()  # written before it was recorded
    reader = open_run(run)
    assert reader.manifest.format_version == run_files.RUN_FORMAT_VERSION
    assert reader.provenance.dataset.spec == "mnist-sample" and reader.provenance.dataset.fingerprint
    assert reader.config.classes == [0, 1] and reader.config.ipc == 2
    assert [u.stats.packs[0].stages[0].resolution for u in reader.manifest.units] == [28]

    check = verify_run(run)
    assert check.complete and check.bad_units == [] and check.rows == 4

    job = EvalJob(config=EvalConfig(epochs=1, seeds=1), teacher_copies=[teacher])
    spec = EvalSpec(device="cpu", threads=1, progress=False)
    measured = evaluate_store_run(run, job, spec, EvalScope(report=True))
    assert measured.evaluation.images == 4 and measured.evaluation.classes == [0, 1]
    assert 0.0 <= measured.evaluation.top1_mean <= 100.0 and set(measured.report) >= {"grid", "losses", "evaluation"}
    again = evaluate_store_run(run, job, spec)
    assert again.evaluation.cached and again.evaluation.top1_per_seed == measured.evaluation.top1_per_seed

    assert export_imagefolder(run, tmp_path / "export") == 4
    assert sorted(p.name for p in (tmp_path / "export").iterdir() if p.is_dir()) == ["0", "1"]


def test_a_run_records_what_was_asked_in_its_provenance_and_its_files_read_back_as_models(small_run):
    from fadrm_ray.layout import RunLayout
    from fadrm_ray.store import open_run
    from fadrm_ray.teacher_record import TeacherRecord

    layout = RunLayout(small_run)
    assert not layout.legacy_job.exists()  # one record of what was asked: the parts' provenance
    reader = open_run(small_run)
    recorded = reader.provenance
    assert recorded.run_id == layout.run_id and recorded.dataset.spec == "digits"
    assert isinstance(recorded.config, DistillConfig) and recorded.config.ipc == 3
    assert isinstance(reader.config, DistillConfig) and reader.config.ipc == recorded.config.ipc
    assert recorded.device_type == "cpu" and recorded.recipe_given is False and recorded.pilot is None
    assert reader.manifest.format_version == run_files.RUN_FORMAT_VERSION and reader.manifest.run_id == recorded.run_id
    (teacher,) = recorded.teachers
    assert isinstance(teacher, TeacherRecord) and Path(teacher.path).is_absolute() and len(teacher.sha256) == 64
    assert teacher.model_name and teacher.in_chans == 1 and teacher.num_classes is None  # a reference, not the file
    stages = [stage for unit in reader.unit_manifests().values() for pack in unit.stats.packs for stage in pack.stages]
    assert stages and all(len(stage.ce) == len(stage.bn) == stage.iterations for stage in stages)


def test_a_run_of_the_second_format_with_its_job_json_opens_verifies_evaluates_and_exports(tmp_path):
    """`tests/data/run-format-2.tar.gz`: a run as the version before the teacher record was one
    type wrote it (a job.json beside config.yaml; its teachers' model under "model"; its config and
    pilot plain JSON in the provenance), with its teacher checkpoint (mnist-sample, IPC 2 of
    classes 0 and 1, 4 iterations)."""
    import json

    from fadrm_ray.config import EvalConfig
    from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
    from fadrm_ray.evaluation.store_run import evaluate_store_run
    from fadrm_ray.models import load_teacher
    from fadrm_ray.store import export_imagefolder, open_run
    from fadrm_ray.store.verify import verify_run

    run, teacher = _old_run(tmp_path, version=2)
    assert json.loads((run / "job.json").read_text())["teachers"][0]["model"] == "convnet-bn"
    reader = open_run(run)
    recorded = reader.provenance
    assert isinstance(recorded.config, DistillConfig) and recorded.config.ipc == 2 and recorded.config.classes == [0, 1]
    assert recorded.teachers[0].model_name == "convnet-bn" and recorded.teachers[0].sha256
    _, info = load_teacher(teacher)  # a checkpoint of that version reads as a TeacherRecord
    assert info.sha256 == recorded.teachers[0].sha256 and info.model_name == "convnet-bn" and not info.missing()

    check = verify_run(run)
    assert check.complete and check.bad_units == [] and check.rows == 4
    job = EvalJob(config=EvalConfig(epochs=1, seeds=1), teacher_copies=[teacher])
    spec = EvalSpec(device="cpu", threads=1, progress=False)
    measured = evaluate_store_run(run, job, spec)
    assert measured.evaluation.images == 4 and measured.evaluation.classes == [0, 1]
    assert export_imagefolder(run, tmp_path / "export") == 4


def test_a_record_an_earlier_version_wrote_that_no_longer_validates_reads_as_absent():
    """A pilot or config recorded by an earlier version of its model does not stop the run opening."""
    raw = {"run_id": "r", "pilot": {"version": 0, "recipe": "cifar"}, "config": {"not_a_key": 1},
           "teachers": [{"path": "/t.pt", "sha256": "ab" * 32, "model": "convnet-bn", "test_accuracy": 91.0}]}
    recorded = run_files.RunProvenance.from_raw(raw)
    assert recorded.pilot is None and recorded.config is None
    assert recorded.teachers[0].model_name == "convnet-bn" and recorded.teachers[0].test_accuracy == 91.0
    assert run_files.RunProvenance.from_raw({"config": {}}).config is None
