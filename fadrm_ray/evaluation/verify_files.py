"""The files an evaluation keeps in a run, checked for `fadrm verify` (each a `FileProblem` where it
is damaged, by its path in the run, naming what `--repair` does about it):

- stored soft labels (`soft_labels/<key>/`, evaluation/soft_labels.py): `meta.json` reads as a
  `SoftLabelMeta` and every epoch it counts is there; each epoch file has the sha256 its folder
  recorded as it was written (`sha256.json`), or, where none was recorded (a folder of an earlier
  version), reads whole as an epoch table (`epoch_problem`). `fadrm_ray.repair` recomputes
  damaged and missing epochs from the teachers; a folder whose `meta.json` is damaged it cannot.
  `check_epochs` is the same check of the epochs a download packs (api.jobs.soft_label_packing), raising
  `SoftLabelDamaged`;
- cached evaluations (`evaluations/*.json`): each reads as a JSON object; a damaged one is a cache
  entry `--repair` removes (computed again when it is next asked for);
- the report (`report/`): evaluation.json reads as an `Evaluation`, source.json as JSON, the
  figures decode; `--repair` draws the figures again (the evaluation's from evaluation.json),
  but only `fadrm evaluate` makes a damaged evaluation.json again.

`check_run` is the check of every file a run holds: the store's (`fadrm_ray.store.verify`) and these.
`fadrm_ray.evaluation.mend_files` mends what `--repair` can of these.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.evaluation.soft_labels import (DIGESTS, PLAN_COLUMNS, EpochDigests, SoftLabelError, SoftLabelMeta,
                                              recorded_digests)
from fadrm_ray.layout import RunLayout
from fadrm_ray.store.verify import FileProblem, RunCheck, verify_run

_META = "meta.json"
_EPOCH = "epoch={:05d}.parquet"
RECOMPUTED = "--repair recomputes it from the run's images and teachers"


class SoftLabelDamaged(SoftLabelError):
    """A stored soft-label file that is damaged (`file`: its path under the run, `problem`)."""

    def __init__(self, file: str, problem: str):
        super().__init__(f"{file}: {problem}")
        self.file, self.problem = file, problem


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def epoch_problem(path: Path, digest: str | None) -> str | None:
    """What is wrong with one stored epoch file, else None: its sha256 against `digest` where one
    was recorded, else the whole file read as an epoch table (its plan columns and logits)."""
    try:
        if digest is not None:
            return None if sha256_file(path) == digest else "its sha256 differs from the one recorded when it was written"
        table = pq.read_table(path)
        table.validate(full=True)
    except FileNotFoundError:
        return "missing"
    except (OSError, pa.ArrowException) as exc:
        return f"does not read as a Parquet table ({type(exc).__name__})"
    missing = [name for name in (*PLAN_COLUMNS, "logits") if name not in table.column_names]
    if missing or table.num_rows == 0:
        return f"is not an epoch of soft labels ({'no ' + ', '.join(missing) if missing else 'no rows'})"
    return None


def folder_problems(folder: Path, under: str) -> dict[str, FileProblem]:
    """The damaged files of one soft-label folder, by `under/<folder>/<name>`."""
    found: dict[str, FileProblem] = {}
    where = f"{under}/{folder.name}"
    try:
        meta = SoftLabelMeta.model_validate_json((folder / _META).read_bytes())
    except (OSError, ValueError):
        found[f"{where}/{_META}"] = FileProblem(
            problem="does not read as the folder's soft-label settings",
            remedy=f"--repair cannot recompute the folder without it: remove {where} (an evaluation that stores "
                   f"soft labels makes it again)", mended=False)
        return found
    if (folder / DIGESTS).is_file():
        try:
            EpochDigests.model_validate_json((folder / DIGESTS).read_bytes())
        except (OSError, ValueError):
            found[f"{where}/{DIGESTS}"] = FileProblem(
                problem="does not read as the epochs' digests (each epoch is read whole instead)",
                remedy="--repair writes it again from the epochs that read whole", mended=True)
    digests = recorded_digests(folder)
    epochs = max(meta.epochs, _contiguous(folder))
    for epoch in range(epochs):
        name = _EPOCH.format(epoch)
        if (problem := epoch_problem(folder / name, digests.get(name))) is not None:
            found[f"{where}/{name}"] = FileProblem(problem=problem, remedy=RECOMPUTED, mended=True)
    return found


def _contiguous(folder: Path) -> int:
    n = 0
    while (folder / _EPOCH.format(n)).is_file():
        n += 1
    return n


def check_epochs(folder: Path, files: list[Path], under: str) -> None:
    """SoftLabelDamaged for the first of `files` (epoch files of `folder`) that `epoch_problem`
    finds wrong: what a download checks before it packs them."""
    digests = recorded_digests(folder)
    for path in files:
        if (problem := epoch_problem(path, digests.get(path.name))) is not None:
            raise SoftLabelDamaged(f"{under}/{folder.name}/{path.name}", problem)


def check_run(run_dir: str | Path) -> RunCheck:
    """Every file the run holds checked: `verify_run` (its units and its own files) and the
    evaluation's files (`evaluation_file_problems`)."""
    check = verify_run(run_dir)
    return check.model_copy(update={"files": {**check.files, **evaluation_file_problems(run_dir)}})


def evaluation_file_problems(run_dir: str | Path) -> dict[str, FileProblem]:
    """Every damaged file the run's evaluations keep (module docstring), by its path in the run."""
    layout = RunLayout(run_dir)
    found: dict[str, FileProblem] = {}
    labels = layout.soft_labels
    if labels.is_dir():
        for folder in sorted(p for p in labels.iterdir() if p.is_dir()):
            found.update(folder_problems(folder, layout.relative(labels)))
    for path in sorted(layout.evaluations_dir.glob("*.json")) if layout.evaluations_dir.is_dir() else ():
        if not _json_object(path):
            found[layout.relative(path)] = FileProblem(
                problem="does not read as a kept evaluation (JSON)",
                remedy="--repair removes it: a cache entry, trained again when it is next asked for", mended=True)
    files = layout.report_files()
    if files["evaluation"].is_file():
        try:
            Evaluation.model_validate_json(files["evaluation"].read_bytes())
        except (OSError, ValueError):
            found[layout.relative(files["evaluation"])] = FileProblem(
                problem="does not read as an evaluation",
                remedy=f"--repair cannot recompute it: `fadrm evaluate --run {layout.run_dir}` writes it again",
                mended=False)
    for name in ("grid", "losses", "evaluation_plot"):
        if files[name].is_file() and not _image(files[name]):
            found[layout.relative(files[name])] = FileProblem(
                problem="does not decode as an image", remedy="--repair draws it again", mended=True)
    if layout.report_source.is_file() and not _json_object(layout.report_source):
        found[layout.relative(layout.report_source)] = FileProblem(
            problem="does not read as JSON", remedy="--repair draws the figures again and writes it", mended=True)
    return found


def _json_object(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_bytes()), dict)
    except (OSError, ValueError):
        return False


def _image(path: Path) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
        return True
    except (OSError, ValueError, SyntaxError):
        return False
