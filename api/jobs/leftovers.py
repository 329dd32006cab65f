"""What a job that did not succeed leaves behind, and its removal.

A finished run's images are the content-addressed store and stay; so do its finished units and
stage checkpoints, from which a later request resumes. What an evaluation adds to the run's
soft-label folder (`RunLayout.soft_labels`) belongs to that evaluation only: the driver records
the folder's contents before it starts (`snapshot`), and when the job ends cancelled or failed the
service removes every file added since (`remove_added`), partial epochs and temporary files
included, and puts back any `meta.json` (and `sha256.json`, the epochs' digests) it rewrote.
Hidden temporary files in the job's own folder (an interrupted download or preview) go too.
"""
from __future__ import annotations

import os
from pathlib import Path

from fadrm_ray.evaluation.soft_labels import DIGESTS

from api.jobs.job_files import SoftLabelSnapshot, write_model
from api.jobs.job_outputs import remove_partial
from api.jobs.private_files import private_write

_RECORDS = ("meta.json", DIGESTS)  # rewritten by an evaluation: their text is kept, and put back


def snapshot(folder: Path) -> SoftLabelSnapshot:
    """The files and folders under `folder` now, and the text of each `meta.json` and `sha256.json`."""
    files, dirs, meta = [], [], {}
    for root, names, found in os.walk(folder):
        here = Path(root)
        dirs.extend((here / d).relative_to(folder).as_posix() for d in names)
        for name in found:
            rel = (here / name).relative_to(folder).as_posix()
            files.append(rel)
            if name in _RECORDS:
                meta[rel] = (here / name).read_text()
    return SoftLabelSnapshot(existed=folder.is_dir(), files=sorted(files), dirs=sorted(dirs), meta=meta)


def write_snapshot(folder: Path, out: Path) -> None:
    write_model(out, snapshot(folder))


def remove_added(folder: Path, before: SoftLabelSnapshot) -> list[str]:
    """Remove what was added under `folder` since `before` (the files, and the folders left empty);
    returns the removed files' relative paths."""
    if not folder.is_dir():
        return []
    kept_files, kept_dirs, meta = set(before.files), set(before.dirs), before.meta
    removed = []
    for root, _, found in os.walk(folder, topdown=False):
        here = Path(root)
        for name in found:
            path = here / name
            rel = path.relative_to(folder).as_posix()
            if rel not in kept_files:
                path.unlink(missing_ok=True)
                removed.append(rel)
            elif rel in meta and path.read_text() != meta[rel]:
                private_write(path, meta[rel])  # the epochs it names are those that are still there
        rel_dir = here.relative_to(folder).as_posix()
        if here != folder and rel_dir not in kept_dirs and not any(here.iterdir()):
            here.rmdir()
    if not before.existed and not any(folder.iterdir()):
        folder.rmdir()
    return removed


def remove_job_temporaries(job_root: Path) -> None:
    """Hidden temporary files and folders in a job's folder (a write that was interrupted)."""
    if job_root.is_dir():
        for path in job_root.glob(".*"):
            remove_partial(path)
