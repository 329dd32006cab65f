"""`fadrm distill` and `fadrm info` say which recipe "auto" took and why; config.yaml records it."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from fadrm_ray.cli import main
from fadrm_ray.cli.info import run_recipe
from fadrm_ray.config import make_config
from fadrm_ray.store.run_files import RecordedDataset, RunProvenance

pytestmark = pytest.mark.usefixtures("one_thread")


def test_distill_and_info_name_the_recipe(digits_teacher, tmp_path, capsys):
    store = tmp_path / "store"
    code = main(["distill", "--local", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--ipc", "1",
                 "--classes", "0,1", "--set", "iterations=4", "--set", "precision=fp32", "--out", str(store),
                 "--quiet", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    recipe = next(line for line in out.splitlines() if line.startswith("recipe: "))
    assert recipe.startswith("recipe: small-grey, auto's choice for 1-channel 8-px images: measured")
    # iterations was given: the recipe gave the other values only.
    assert recipe.endswith("it gave lr, crop_scale_min, patch_crop_scale, patch_crops, bound, patch_selection, mosaic")
    run_dir = next(p for p in store.iterdir() if p.is_dir())
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["recipe"] == "small-grey"
    assert main(["info", "--run", str(run_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["recipe"].startswith("small-grey, auto's choice for 1-channel 8-px images")
    assert info["config"]["recipe"] == "small-grey"

    # The paper's preset sets every value a recipe would give.
    code = main(["distill", "--local", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--ipc", "1",
                 "--classes", "0,1", "--preset", "fadrm-paper", "--set", "iterations=4", "--out", str(store),
                 "--quiet", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "every value it sets was given explicitly" in out, out


def test_the_recipe_line_reads_the_run_s_own_record(tmp_path):
    from fadrm_ray.layout import RunLayout

    layout = RunLayout(tmp_path)  # from its saved config and provenance
    colour_data = RunProvenance(dataset=RecordedDataset(image_size=32, channels=3))
    colour = SimpleNamespace(config=make_config(overrides={"recipe": "cifar"}), provenance=colour_data, layout=layout)
    assert run_recipe(colour).startswith("cifar, auto's choice for 3-channel 32-px images: the released")
    pinned = SimpleNamespace(config=make_config(overrides={"recipe": "small-grey"}), provenance=colour_data,
                             layout=layout)
    assert run_recipe(pinned).startswith("small-grey, set (auto takes cifar for 3-channel 32-px images)")
    older = SimpleNamespace(config=None, provenance=RunProvenance(), layout=layout)  # before recipes were recorded
    assert run_recipe(older).startswith("not recorded")
