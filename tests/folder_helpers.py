"""A user's own data for the tests: image folders written as PNGs, a one-epoch teacher of one, and
a tiny run of it."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fadrm_ray.cli import main


def grey_folder(root: Path, layout: dict[str, int], classes: int = 3, size: int = 8) -> Path:
    """Grey PNGs under root/<split>/<class>/ for each split of `layout` ("" for a flat folder)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, count in layout.items():
        for c in range(classes):
            folder = root / split / f"c{c}" if split else root / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                x = (torch.rand(size, size, generator=gen) * 80 + 60 * c).clamp(0, 255).byte()
                Image.fromarray(x.numpy()).save(folder / f"{i}.png")
    return root


def colour_folder(root: Path, classes: int, per_class: int = 6, size: int = 16) -> Path:
    """RGB PNGs under root/<class>/, each class its own hue."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for c in range(classes):
        folder = root / f"class{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            x = torch.rand(size, size, 3, generator=gen) * 60
            x[..., c % 3] += 100 + 10 * (c // 3)
            Image.fromarray(x.clamp(0, 255).byte().numpy()).save(folder / f"{i}.png")
    return root


def squeezed_teacher(data: Path, tmp_path: Path) -> str:
    """A one-epoch teacher of the folder `data` at tmp_path/t/teacher.pt."""
    assert main(["squeeze", "--dataset", f"imagefolder:{data}", "--epochs", "1", "--out", str(tmp_path / "t"),
                 "--quiet"]) == 0
    return str(tmp_path / "t" / "teacher.pt")


def tiny_run(data: Path, tmp_path: Path, capsys, recipe: str) -> str:
    """A one-epoch teacher of `data` and a tiny run of it (IPC 1, 2 iterations) under `recipe`: its folder."""
    teacher = squeezed_teacher(data, tmp_path)
    capsys.readouterr()
    assert main(["distill", "--local", "--dataset", f"imagefolder:{data}", "--teacher", teacher, "--ipc", "1",
                 "--set", f"recipe={recipe}", "--set", "iterations=2", "--out", str(tmp_path / "store"),
                 "--quiet", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["run_dir"]
