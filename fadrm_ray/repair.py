"""`fadrm verify --repair`: recompute the units of a run that fail verification, and mend its own
other damaged files (`fadrm_ray.store.verify`; the evaluation's files are mended a layer up,
`fadrm_ray.evaluation.verify_files.mend_evaluation_files`).

A unit's images depend only on the run's config, data, teachers and seed, so a damaged unit is
not restored from anywhere: it is computed again. The run's own records say how: its config
(config.yaml, else the copy every part file carries), its dataset (reopened by the spec it
records, or given where it is now, and checked by fingerprint) and its teachers (at the paths it
records, or given where they are now, checked by sha256), as `fadrm evaluate` finds them. Before
anything is removed, these must give the same run id, so a repair never writes another run's
images into this one. Then, under the run's writer lock, the failing units' manifests and the
run manifest are removed, and the same job, run by `run_job` in this process, recomputes
exactly the units that are not done and writes the run manifest again.

The run's other files are mended once the units read right (`_mend`): config.yaml written again
from the copy the part files carry; a damaged stage checkpoint or scored-patch file removed (each
is computed again where it is next needed); the ledger rewritten with the lines that read.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from pydantic import BaseModel

from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.runs import execute
from fadrm_ray.runtime import resolve_device
from fadrm_ray.runs.reopen import GIVE_DATASET, GIVE_TEACHERS, load_run_teachers, run_dataset
from fadrm_ray.runs.job import ExecutionSpec, JobParts, build_job
from fadrm_ray.layout import RunLayout
from fadrm_ray.store import RunStore, StoreError
from fadrm_ray.store.lock import RunLock
from fadrm_ray.store.manifests import read_config
from fadrm_ray.store.records import part_provenance
from fadrm_ray.store.run_files import RunProvenance
from fadrm_ray.store.verify import FileProblem, RunCheck, verify_run


def _provenance(layout: RunLayout) -> RunProvenance | None:
    """What the run's part files record about how it was made (any readable one will do)."""
    for part in layout.parts_on_disk():
        try:
            found = part_provenance(part)
        except StoreError:
            continue
        if found is not None:
            return found
    return None


class Repaired(BaseModel):
    """What `repair_run` did: the units it computed, the other files it mended, the check before
    and the check after."""

    repaired: list[str]
    mended: list[str] = []
    before: RunCheck
    after: RunCheck


def repair_run(run_dir: str | os.PathLike, *, dataset: ImageDataset | str | None = None,
               teacher_copies: Sequence[str | Path] | None = None, device: str | None = None,
               progress: bool = True) -> Repaired:
    """Verify the run, recompute every unit that fails (and any not yet written), verify again.

    `dataset` and `teacher_copies` say where the run's data and teachers are now, when not where
    the run records them (`reopen.run_dataset`, `reopen.load_run_teachers`: each checked against
    the fingerprint or sha256 the run records). Returns `Repaired`: the unit ids computed, the
    first check and the last. StoreError or
    EvaluationError, with nothing changed, when the run's config, data or teachers cannot be
    found or would not make this run.
    """
    layout = RunLayout(run_dir)
    before = verify_run(layout.run_dir)
    if before.complete and before.ok:
        return Repaired(repaired=[], before=before, after=before)
    units_run: list[str] = []
    if before.bad_units or not before.complete:
        units_run = _recompute_units(layout, before, dataset, teacher_copies, device, progress)
    mended = _mend(layout, before.files)
    return Repaired(repaired=units_run, mended=mended, before=before, after=verify_run(layout.run_dir))


def _recompute_units(layout: RunLayout, before: RunCheck, dataset, teacher_copies, device, progress) -> list[str]:
    prov = _provenance(layout)
    if prov is None and (dataset is None or not teacher_copies):
        raise StoreError(f"{layout.run_dir}: no part file is left to record the run's dataset and teachers; "
                         f"name them: {GIVE_DATASET} and {GIVE_TEACHERS}")
    prov = prov or RunProvenance()
    cfg = _config(layout, prov)
    dataset = run_dataset(layout.run_dir, prov, dataset)
    spec = ExecutionSpec(local=True, device=resolve_device(device), progress=progress)
    parts = JobParts.of(dataset, load_run_teachers(layout.run_dir, prov, teacher_copies, spec.device), spec.device)
    # By its name, which build_job records as the spec that reopens it from where it is now.
    job = build_job(cfg, dataset, dataset.name, parts.infos, layout.run_dir.parent, execute.device_type(spec))
    if job.run_id != layout.run_id:
        raise StoreError(f"the recorded config, data and teachers make run {job.run_id}, not {layout.run_id}; "
                         f"nothing was changed")
    with RunLock(layout).held():
        for uid in before.bad_units:
            layout.unit(uid).unlink(missing_ok=True)
        layout.manifest.unlink(missing_ok=True)
    return execute.run(job, spec, parts).units_run


def _config(layout: RunLayout, prov: RunProvenance) -> DistillConfig:
    """The run's config: config.yaml, else (missing or damaged) the copy the part files carry."""
    try:
        cfg = read_config(layout)
    except StoreError:
        cfg = None
    if cfg is None:
        cfg = prov.config  # read as a DistillConfig (an earlier shape migrated) when the part's provenance was
    if cfg is None:
        raise StoreError(f"{layout.run_dir}: neither {layout.config.name} nor any part file records the run's config; "
                         f"it cannot be recomputed")
    return cfg


def _mend(layout: RunLayout, damaged: dict[str, FileProblem]) -> list[str]:
    """Mend the run's own damaged files outside its units (module docstring); their paths."""
    mended: list[str] = []
    files = {rel: layout.run_dir / rel for rel, problem in damaged.items() if problem.mended}
    if layout.relative(layout.config) in files:
        cfg = _config(layout, _provenance(layout) or RunProvenance())
        with RunLock(layout).held():
            RunStore(layout.run_dir.parent, layout.run_id).write_config(cfg)
        mended.append(layout.relative(layout.config))
    removed = [rel for rel, path in files.items()
               if path.parent == layout.checkpoints_dir or path in layout.patch_selections()]
    for rel in removed:
        files[rel].unlink(missing_ok=True)
    mended += removed
    if layout.relative(layout.ledger) in files:
        _rewrite_ledger(layout.ledger)
        mended.append(layout.relative(layout.ledger))
    return mended


def _rewrite_ledger(path: Path) -> None:
    """The ledger with only its lines that are JSON objects (a last line without its newline kept as it is)."""
    from fadrm_ray.fileio import atomic_write_bytes
    from fadrm_ray.store.verify import json_object

    *lines, tail = path.read_bytes().split(b"\n")
    atomic_write_bytes(path, b"".join(line + b"\n" for line in lines if json_object(line)) + tail)
