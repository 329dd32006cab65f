"""Each class's scored patch ranking, kept in the run (`patches/label=<c>.json`): a run scores a
class once, whatever the requests, workers and restarts that need its patches."""
from __future__ import annotations

from typing import Sequence

from fadrm_ray.fileio import atomic_write_text
from fadrm_ray.layout import RunLayout
from fadrm_ray.store.run_files import ClassSelection


def keep_selection(layout: RunLayout, selection: ClassSelection) -> None:
    atomic_write_text(layout.patch_selection(selection.label), selection.model_dump_json())


def kept_selections(layout: RunLayout, labels: Sequence[int]) -> dict[int, ClassSelection]:
    """The selections of `labels` the run keeps; a missing or unreadable file is a class to score."""
    out = {}
    for label in labels:
        try:
            selection = ClassSelection.from_json(layout.patch_selection(label).read_bytes())
        except OSError:
            continue
        if selection is not None and selection.label == label:
            out[label] = selection
    return out
