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
from types import SimpleNamespace
from typing import Sequence

from fadrm_ray.config import DistillConfig
from fadrm_ray.data.base import ImageDataset
from fadrm_ray.run.execute import LocalExecutor, run_job
from fadrm_ray.runtime import resolve_device
from fadrm_ray.evaluate import GIVE_DATASET, GIVE_TEACHERS, run_dataset, run_teachers
from fadrm_ray.run.job import prepare_job
from fadrm_ray.layout import RunLayout
from fadrm_ray.store import StoreError
from fadrm_ray.store.lock import RunLock
from fadrm_ray.store.manifests import read_config
from fadrm_ray.store.records import part_provenance
from fadrm_ray.store.verify import verify_run


def _provenance(layout: RunLayout) -> dict:
    """What the run's part files record about how it was made (any readable one will do)."""
    for part in layout.parts_on_disk():
        try:
            found = part_provenance(part)
        except StoreError:
            continue
        if found:
            return found
    return {}


def repair_run(run_dir: str | os.PathLike, *, dataset: ImageDataset | str | None = None,
               teacher_copies: Sequence[str | Path] | None = None, device: str | None = None,
               progress: bool = True) -> dict:
    """Verify the run, recompute every unit that fails (and any not yet written), verify again.

    `dataset` and `teacher_copies` say where the run's data and teachers are now, when not where
    the run records them (`evaluate.run_dataset`, `evaluate.run_teachers`: each checked against
    the fingerprint or sha256 the run records). Returns {"repaired":
    unit ids computed, "before": the first check, "after": the last}. StoreError or
    EvaluationError, with nothing changed, when the run's config, data or teachers cannot be
    found or would not make this run.
    """
    layout = RunLayout(run_dir)
    before = verify_run(layout.run_dir)
    if before["complete"] and not before["bad_units"]:
        return {"repaired": [], "before": before, "after": before}
    prov = _provenance(layout)
    if not prov and (dataset is None or not teacher_copies):
        raise StoreError(f"{layout.run_dir}: no part file is left to record the run's dataset and teachers; "
                         f"name them: {GIVE_DATASET} and {GIVE_TEACHERS}")
    saved = read_config(layout) or prov.get("config")
    if not saved:
        raise StoreError(f"{layout.run_dir}: neither {layout.config.name} nor any part file records the run's config; "
                         f"it cannot be recomputed")
    cfg = DistillConfig.from_dict(saved)
    recorded = SimpleNamespace(run_dir=layout.run_dir, provenance=prov)  # what run_dataset/run_teachers read
    dataset = run_dataset(recorded, dataset)
    teacher_paths = run_teachers(recorded, teacher_copies)
    executor = LocalExecutor(resolve_device(device), progress)
    # By its name, which build_job records as the spec that reopens it from where it is now.
    job, parts = prepare_job(cfg, dataset, dataset.name, teacher_paths, layout.run_dir.parent, executor.device)
    if job.run_id != layout.run_id:
        raise StoreError(f"the recorded config, data and teachers make run {job.run_id}, not {layout.run_id}; "
                         f"nothing was changed")
    with RunLock(layout).held():
        for uid in before["bad_units"]:
            layout.unit(uid).unlink(missing_ok=True)
        layout.manifest.unlink(missing_ok=True)
    result = run_job(job, executor, parts)
    return {"repaired": result.units_run, "before": before, "after": verify_run(layout.run_dir)}
