"""What a job gives back, built from the store's run (every read verified against its manifests):
progress from the run's ledger, the dataset file, the ImageFolder zip, the preview, the report,
the student recipe and the teacher checkpoint.

The dataset file is one Parquet table of the requested classes at the requested IPC, in the
store's own part layout (`fadrm_ray.store.export.parquet_bytes`, as `fadrm export --format
parquet` writes it: an `image` struct of PNG bytes and path, `label` the dataset's class index,
`ipc_index`, the losses), with the class names as a `ClassLabel` in the `huggingface` schema
metadata and the request under `fadrm`, whose `labels` (`api.contract.schemas.DatasetLabels`) says
that the reported top-1 trains students with the teachers' soft labels and where the teachers, the
stored soft labels and the recipe are. Each file is written once per job, atomically and with mode
0600, beside the job record, and served from there (api.web.downloads); a write that fails leaves
no partial file behind.

Every top-1 the project reports is a student trained on the images with the teachers' soft labels
(KD, the teachers relabelling each augmented view: `fadrm_ray.evaluation.training`), so a client
that should reach it needs the teachers and the recipe too: `job_recipe` is the `EvalConfig` the
report used (or would use), `open_teacher` a teacher file checked against the sha256 the job
recorded.
"""
from __future__ import annotations

import hashlib
import math
import os
import stat
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO


from fadrm_ray.runs.units import Unit
from fadrm_ray.events import RunStarted, StageDone, read_ledger
from fadrm_ray.layout import RunLayout
from fadrm_ray.config import EvalConfig
from fadrm_ray.store import export_imagefolder, open_run

from api.contract.schemas import DatasetLabels, TeacherFile
from api.jobs.job_files import EvaluationStarted, read_model
from api.jobs.private_files import make_private, private_write

if TYPE_CHECKING:
    from api.planning.requests import JobPlan

LOSS_POINTS = 200


# --------------------------------------------------------------------------- progress
def progress(run_dir: Path, plan: "JobPlan", state: str, started_at: float | None,
             evaluating: Path | None = None) -> tuple[dict, float | None]:
    """Stages done / total, overall and per class, from the run's ledger (the run's schedule on the
    worker pool writes one event per stage), and an ETA from the pace since this job's run started;
    once the driver has said its evaluation started (`evaluating`, an `EvaluationStarted` file),
    the students trained and to train, and the evaluation's ETA (`_evaluation_progress`)."""
    classes, names, stages = plan.classes, plan.class_names, plan.stages
    per_batch = plan.classes_per_batch
    shards = [classes[i:i + per_batch] for i in range(0, len(classes), per_batch)]
    started, done_events = _ledger_since(RunLayout(run_dir).ledger, started_at) if started_at else (None, [])
    per_class = {c: [0, 0] for c in classes}
    overall = [0, 0]
    if started is not None:
        done_now: dict[str, int] = dict(started.plan)
        for event in done_events:
            if event.unit in done_now:
                done_now[event.unit] = max(done_now[event.unit], event.stage + 1)
        for unit_id, done in done_now.items():
            parsed = Unit.parse_id(unit_id)
            if parsed is None or parsed[0] >= len(shards):
                continue
            overall[0] += min(done, stages)
            overall[1] += stages
            for c in shards[parsed[0]]:
                per_class[c][0] += min(done, stages)
                per_class[c][1] += stages
    if state == "succeeded":  # finished, or reused from the store: everything is done
        per_class = {c: [max(t, stages)] * 2 for c, (_, t) in per_class.items()}
        overall = [max(overall[1], stages * len(shards))] * 2
    body = {
        "stages_done": overall[0],
        "stages_total": overall[1],
        "classes": [{"index": c, "name": n, "stages_done": per_class[c][0], "stages_total": per_class[c][1]}
                    for c, n in zip(classes, names)],
    }
    eta = None
    distilled = body["stages_total"] > 0 and body["stages_done"] >= body["stages_total"]
    body["phase"] = ("done" if state in ("succeeded", "failed", "cancelled") else
                     "queued" if state == "queued" else
                     "evaluating" if distilled and plan.evaluate else "distilling")
    evaluation = read_model(evaluating, EvaluationStarted) if state == "running" and evaluating else None
    if evaluation is not None:  # the driver said so: a run already in the store is evaluated at once
        body["phase"] = "evaluating"
        body["students_done"], body["students_total"], eta = _evaluation_progress(run_dir, plan, evaluation.t)
    elif state == "running" and started is not None and done_events and not distilled:
        elapsed = time.time() - started.t
        remaining = body["stages_total"] - body["stages_done"]
        if elapsed > 0 and remaining >= 0:
            eta = round(remaining * elapsed / len(done_events), 1)
    return body, eta


# Seconds per image-epoch of a student, by (dataset, student): the pace of the last evaluation this
# process timed, an ETA's start before the first student of the next one has trained.
_EVAL_PACE: dict[tuple[str, str], float] = {}
_STUDENTS_CACHE: dict[tuple, tuple[float, int]] = {}
STUDENTS_CACHE_S = 2.0


def _evaluation_progress(run_dir: Path, plan: "JobPlan", since: float) -> tuple[int, int, float | None]:
    """(students trained since `since`, students in all, ETA seconds) of a job's evaluation. A
    student is counted when its result is kept (a `StudentScore` in the run's `evaluations/`; the
    baselines' in their own runs of the store, beside the job's). The ETA is the students left at
    the pace of those trained so far (the whole time since the start, what precedes the students
    included); before the first has trained, the work at the pace of the last evaluation of the
    same dataset and student this service timed; else None."""
    total, each = plan.eval_students
    # Counted from the files kept since the start: another evaluation writing at the same time (a
    # second job, a CLI `fadrm evaluate` on the store) may be counted too, never past the total.
    done = min(total, _students_since(run_dir, plan.baselines, since))
    elapsed = max(0.0, time.time() - since)
    key = (plan.dataset, (plan.evaluation or EvalConfig()).student)
    if done:
        per_student = elapsed / done
        if each:
            _EVAL_PACE[key] = per_student / each
        return done, total, round(max(0, total - done) * per_student, 1)
    pace = _EVAL_PACE.get(key)
    return 0, total, None if pace is None else round(max(0.0, pace * each * total - elapsed), 1)


def _students_since(run_dir: Path, baselines: bool, since: float) -> int:
    """Students kept since `since` in the run's evaluations (and, with baselines, every run's of the
    store), counted at most every STUDENTS_CACHE_S seconds."""
    key = (str(run_dir), baselines, since)
    now = time.monotonic()
    cached = _STUDENTS_CACHE.get(key)
    if cached is not None and now - cached[0] < STUDENTS_CACHE_S:
        return cached[1]
    from fadrm_ray.evaluation.scores import StudentScore

    folders = (run_dir.parent.glob(f"*/{RunLayout(run_dir).evaluations_dir.name}") if baselines
               else [RunLayout(run_dir).evaluations_dir])
    count = 0
    for folder in folders:
        for path in folder.glob("*.json"):
            try:
                recent = path.stat().st_mtime >= since - 1
            except OSError:
                continue
            if recent and read_model(path, StudentScore) is not None:
                count += 1
    if len(_STUDENTS_CACHE) > 256:
        _STUDENTS_CACHE.clear()
    _STUDENTS_CACHE[key] = (now, count)
    return count


_LEDGER_CACHE: dict[tuple, tuple] = {}


def _ledger_since(path: Path, since: float) -> tuple[RunStarted | None, list[StageDone]]:
    """The last `run_started` event at or after `since`, and the `stage_done` events after it
    (kept while the ledger file is unchanged: clients poll far more often than stages end)."""
    try:
        stat = path.stat()
    except OSError:
        return None, []
    key = (str(path), stat.st_mtime_ns, stat.st_size, since)
    if key not in _LEDGER_CACHE:
        if len(_LEDGER_CACHE) > 256:
            _LEDGER_CACHE.clear()
        _LEDGER_CACHE[key] = _parse_ledger(path, since)
    return _LEDGER_CACHE[key]


def _parse_ledger(path: Path, since: float) -> tuple[RunStarted | None, list[StageDone]]:
    started, done = None, []
    for event in read_ledger(path):
        if event.t < since - 1:
            continue
        if isinstance(event, RunStarted):
            started, done = event, []
        elif isinstance(event, StageDone) and started is not None:
            done.append(event)
    return started, done


# --------------------------------------------------------------------------- files
def write_dataset(run_dir: Path, plan: "JobPlan", out: Path, job_id: str, evaluation_file: Path) -> Path:
    """The requested classes at the requested IPC as one Parquet file (module docstring)."""
    from fadrm_ray.store.export import parquet_bytes

    about = {"run_id": plan.run_id, "dataset": plan.dataset, "teachers": plan.teachers, "ipc": plan.ipc,
             "classes": plan.classes, "class_names": plan.class_names, "preset": plan.preset, "seed": plan.seed,
             "labels": dataset_labels(plan, job_id, evaluation_file).model_dump(mode="json"),
             "recipe": plan.job.config.recipe, "pilot": plan.recipe_notes[0], "warnings": plan.recipe_notes[1]}
    return private_write(out, parquet_bytes(open_run(run_dir, ipc=plan.ipc), plan.classes, about))


def stored_labels(plan: "JobPlan", evaluation_file: Path) -> bool:
    """Whether the job's evaluation stored its students' soft labels (then `write_soft_labels` packs them)."""
    return evaluation_file.is_file() and plan.evaluation is not None and plan.evaluation.soft_labels == "stored"


def write_soft_labels(run_dir: Path, plan: "JobPlan", out: Path, evaluation_file: Path) -> Path:
    """The stored soft labels of the job's evaluation, one part per student seed, packed in one
    file as `fadrm_ray.evaluation.soft_labels.pack_soft_labels` packs them, written as it is read
    (`api.jobs.soft_label_packing`: bounded memory): what `fadrm train-student --soft-labels` reads."""
    from fadrm_ray.evaluation.scores import Evaluation
    from fadrm_ray.evaluation.soft_labels import SoftLabelError, SoftLabelMeta, folders_of
    from fadrm_ray.evaluation.verify_files import SoftLabelDamaged

    from api.jobs.soft_label_packing import pack_to_file

    evaluation = Evaluation.model_validate_json(evaluation_file.read_text())
    reader = open_run(run_dir, ipc=plan.ipc)
    images, _, _ = reader.read(plan.classes)
    labels = RunLayout(run_dir).soft_labels
    try:
        folders = folders_of(labels, images, evaluation.config, evaluation.teachers)
    except SoftLabelError:  # none found: one whose meta.json is damaged would say so, not "gone"
        for meta in sorted(labels.glob("*/meta.json")):
            try:
                SoftLabelMeta.model_validate_json(meta.read_bytes())
            except (OSError, ValueError):
                raise SoftLabelDamaged(f"{labels.name}/{meta.parent.name}/{meta.name}",
                                       "does not read as the folder's soft-label settings") from None
        raise
    return pack_to_file(folders, out)


def dataset_labels(plan: "JobPlan", job_id: str, evaluation_file: Path) -> DatasetLabels:
    """What the dataset file says about its labels: the soft labels of the reported top-1, and
    where its teachers, its stored soft labels (where the evaluation stored them) and its recipe are."""
    base = f"/v1/distillations/{job_id}"
    temperature = (plan.evaluation or EvalConfig()).temperature  # the recipe's (resolving keeps it)
    several = len(plan.teachers) > 1
    whose = "the teachers' soft labels" if several else "the teacher's soft labels"
    teacher = f"GET {base}/teacher{'?index=i' if several else ''}"
    stored = stored_labels(plan, evaluation_file)
    note = (f"the reported top-1 trains students with {whose} (KD at T={temperature:g}) on these images; "
            f"{teacher} (unless the operator keeps teachers private)"
            + (f", GET {base}/soft-labels (those the report's students learnt from, stored)" if stored else "")
            + f" and GET {base}/recipe give them; the file's hard labels alone reach less")
    teachers = [TeacherFile(name=name, sha256=ref.sha256, url=f"{base}/teacher?index={i}")
                for i, (name, ref) in enumerate(zip(plan.teachers, plan.job.teachers))]
    return DatasetLabels(note=note, kd_temperature=temperature, teachers=teachers, recipe=f"{base}/recipe",
                         soft_labels=f"{base}/soft-labels" if stored else None)


def job_recipe(plan: "JobPlan", evaluation_file: Path) -> EvalConfig:
    """The student recipe of the job's report: the `config` its evaluation recorded, or (not
    evaluated) the job's evaluation settings or the defaults, resolved as `evaluate_run` resolves
    them for the job's images (ipc x classes, ipc per class)."""
    from fadrm_ray.evaluation.training import resolve_protocol

    if evaluation_file.is_file():
        from fadrm_ray.evaluation.scores import Evaluation

        return Evaluation.model_validate_json(evaluation_file.read_text()).config
    return resolve_protocol(plan.evaluation or EvalConfig(), plan.ipc * len(plan.classes), plan.ipc)


class TeacherChanged(Exception):
    """The teacher file a job recorded is gone, or no longer holds the bytes the job was built with."""


_DIGESTS: dict[tuple, str] = {}


def open_teacher(path: str | Path, sha256: str) -> tuple[BinaryIO, int]:
    """The file at `path` open for reading, and its size, when it holds the bytes whose sha256 is
    `sha256`; else TeacherChanged. The digest is taken through the open file, so what is read
    from it is what was checked; it is kept while the file (device, inode, size, mtime) stays the same."""
    try:
        f = open(path, "rb")
    except OSError:
        raise TeacherChanged("missing") from None
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TeacherChanged("not a file")
        key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        digest = _DIGESTS.get(key)
        if digest is None:
            h = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            digest = h.hexdigest()
            f.seek(0)
            if len(_DIGESTS) > 256:
                _DIGESTS.clear()
            _DIGESTS[key] = digest
        if digest != sha256:
            raise TeacherChanged("changed")
        return f, st.st_size
    except BaseException:
        f.close()
        raise


def write_imagefolder_zip(run_dir: Path, plan: "JobPlan", out: Path) -> Path:
    """The same images as a zip of an ImageFolder (`fadrm export --format imagefolder`)."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".imagefolder-") as tmp:
        folder = Path(tmp) / "imagefolder"
        export_imagefolder(run_dir, folder, plan.classes, ipc=plan.ipc)
        partial = Path(tmp) / "out.zip"
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as zf:
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    zf.write(path, path.relative_to(folder).as_posix())
        os.replace(make_private(partial), out)
    return out


def write_preview(run_dir: Path, plan: "JobPlan", out: Path) -> Path:
    """The image grid of the request: its classes, IPC indices 0..ipc-1 (at most 20 of each)."""
    from fadrm_ray.evaluation.report import write_grid

    partial = out.with_name(f".{out.name}.{os.getpid()}.png")
    try:
        write_grid(open_run(run_dir), partial, max_classes=20, max_ipc=min(plan.ipc, 20))
        os.replace(make_private(partial), out)
    except BaseException:
        remove_partial(partial)
        raise
    return out


def report(run_dir: Path, plan: "JobPlan", evaluation_file: Path) -> dict:
    """Recover losses (averaged over the run's units, at most LOSS_POINTS points each) and the
    evaluation when the job made one."""
    from fadrm_ray.evaluation.report import loss_curves

    curves = loss_curves(open_run(run_dir))
    step = max(1, math.ceil(len(curves.ce) / LOSS_POINTS))
    losses = {
        "iterations": len(curves.ce),
        "every": step,
        "ce": [finite(v) for v in curves.ce[::step].tolist()],
        "bn": [finite(v) for v in curves.bn[::step].tolist()],
        "final_ce": finite(curves.ce[-1]) if len(curves.ce) else None,
        "final_bn": finite(curves.bn[-1]) if len(curves.bn) else None,
        "arc_merges_after": [int(m) for m in curves.merges],
        "units": int(curves.units),
    }
    evaluation = None
    if evaluation_file.is_file():  # the driver's `Evaluation`, less the server's paths and the curves
        from api.contract.schemas import EvaluationReported
        from fadrm_ray.evaluation.scores import Evaluation

        evaluation = EvaluationReported.of(Evaluation.model_validate_json(evaluation_file.read_text()))
    pilot, warnings = plan.recipe_notes
    return {"run_id": plan.run_id, "ipc": plan.ipc, "recipe": plan.job.config.recipe, "pilot": pilot,
            "warnings": warnings, "losses": losses, "evaluation": evaluation}


def finite(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def remove_partial(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
