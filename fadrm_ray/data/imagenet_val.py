"""ImageNet's flat validation folder: every image directly in ``val/``, its class in a CSV.

The labels are those of Kaggle's ``LOC_val_solution.csv`` (columns ``ImageId,PredictionString``;
the prediction string starts with the image's wnid, then its boxes:
``ILSVRC2012_val_00008726,n02119789 255 142 454 329 ...``), found beside the dataset folder
(``PATH/LOC_val_solution.csv``) or in the validation folder itself.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

from .base import DatasetError

SOLUTION_CSV = "LOC_val_solution.csv"


def find_solution(root: Path, val_dir: Path) -> Path | None:
    """The label file of a flat validation folder, or None."""
    return next((p for p in (root / SOLUTION_CSV, val_dir / SOLUTION_CSV) if p.is_file()), None)


def read_solution(path: Path) -> dict[str, str]:
    """ImageId -> wnid (the first word of the prediction string; "" for an empty one)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    header = [h.strip() for h in rows[0][:2]] if rows else []
    if header != ["ImageId", "PredictionString"]:
        raise DatasetError(f"{path}: expected the columns ImageId,PredictionString, got {','.join(header) or 'nothing'}")
    labels = {}
    for row in rows[1:]:
        if row and row[0].strip():
            words = row[1].split() if len(row) > 1 else []
            labels[row[0].strip()] = words[0] if words else ""
    return labels


def label_flat_files(names: list[str], solution: Path, classes: list[str], train_dir: Path) -> list[int]:
    """The label of each image file name of the flat folder, from `solution`; DatasetError when
    an image has no label, or a class that has no folder in `train_dir`."""
    wnids = read_solution(solution)
    index = {name: label for label, name in enumerate(classes)}
    unlabelled = [n for n in names if not wnids.get(os.path.splitext(n)[0])]
    if unlabelled:
        raise DatasetError(f"{len(unlabelled)} image(s) of the validation folder have no label in {solution} "
                           f"(first: {unlabelled[0]})")
    unknown = sorted({wnids[os.path.splitext(n)[0]] for n in names} - set(index))
    if unknown:
        raise DatasetError(f"{solution} labels images with {len(unknown)} class(es) that have no folder in "
                           f"{train_dir}: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    return [index[wnids[os.path.splitext(n)[0]]] for n in names]
