"""`fadrm verify --repair`: recompute the units of a run that fail verification.

A unit's images depend only on the run's config, data, teachers and seed, so a damaged unit is
not restored from anywhere: it is computed again. The run's own records say how: its config
(config.yaml, else the copy every part file carries), its dataset (reopened by the spec it
records, or given where it is now, and checked by fingerprint) and its teachers (at the paths it
records, or given where they are now, checked by sha256), as `fadrm evaluate` finds them. Before
anything is removed, these must give the same run id, so a repair never writes another run's
images into this one. Then, under the run's writer lock, the failing units' manifests and the
run manifest are removed, and the same job, run by `run_job` in this process, recomputes
exactly the units that are not done and writes the run manifest again.
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
from fadrm_ray.store import StoreError
from fadrm_ray.store.lock import RunLock
from fadrm_ray.store.manifests import migrate_config, read_config
from fadrm_ray.store.records import part_provenance
from fadrm_ray.store.run_files import RunProvenance
from fadrm_ray.store.verify import RunCheck, verify_run


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
    """What `repair_run` did: the units it computed, the check before and the check after."""

    repaired: list[str]
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
    if before.complete and not before.bad_units:
        return Repaired(repaired=[], before=before, after=before)
    prov = _provenance(layout)
    if prov is None and (dataset is None or not teacher_copies):
        raise StoreError(f"{layout.run_dir}: no part file is left to record the run's dataset and teachers; "
                         f"name them: {GIVE_DATASET} and {GIVE_TEACHERS}")
    prov = prov or RunProvenance()
    cfg = read_config(layout)
    if cfg is None and prov.config:
        cfg = DistillConfig.from_dict(migrate_config(prov.config))
    if cfg is None:
        raise StoreError(f"{layout.run_dir}: neither {layout.config.name} nor any part file records the run's config; "
                         f"it cannot be recomputed")
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
    result = execute.run(job, spec, parts)
    return Repaired(repaired=result.units_run, before=before, after=verify_run(layout.run_dir))
