"""Run reports (PNG grid, loss curves, evaluation JSON) and the ARC diagnostics."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from experiments.arc_diagnostics import arc_merge_effect, information_vanishing, pre_merge_images
from fadrm_ray.config import DistillConfig, make_config
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.models import create_model
from fadrm_ray.frozen_teacher import FrozenTeacher
from fadrm_ray.recover import init_state, run_stage
from fadrm_ray.evaluation.report import loss_curves, report_files, write_report
from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.config import EvalConfig
from fadrm_ray.store import open_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")  # results are repeatable for a fixed thread count


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(32)
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture(scope="module")
def runs(digits, digits_teacher, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reportstore")
    fadrm = make_config("fadrm", overrides={"ipc": 3, "iterations": 12, "ipc_per_unit": 1, "pack": 1})
    rded = make_config("rded", overrides={"ipc": 2})
    spec = ExecutionSpec(local=True, progress=False)
    runs = {}
    for name, cfg in (("fadrm", fadrm), ("rded", rded)):
        job, parts = prepare_job(cfg, digits, "digits", [digits_teacher[0]], root, device_type=execute.device_type(spec))
        runs[name] = execute.run(job, spec, parts)
    return runs


def test_report_files_exist_and_are_readable_pngs(runs):
    run = runs["fadrm"]
    evaluation = Evaluation(top1_mean=50.0, top1_std=1.0, top1_per_seed=[49.0, 51.0], best_top1_mean=51.0,
                            best_top1_std=0.0, best_top1_per_seed=[51.0, 51.0], student="convnet-bn", seeds=[0, 1],
                            curves=[[(1, 30.0), (2, 49.0)], [(1, 35.0), (2, 51.0)]], epochs=2, steps_per_seed=8,
                            seconds=1.0, images=30, dataset="digits", test_size=359, teachers=["t"],
                            config=EvalConfig(epochs=2, seeds=2))
    paths = write_report(open_run(run.run_dir), evaluation)
    assert set(paths) == {"grid", "losses", "evaluation", "evaluation_plot"}
    for key in ("grid", "losses", "evaluation_plot"):
        width, height = png_size(paths[key])
        assert 300 <= width <= 4000 and 200 <= height <= 4000, (key, width, height)
    import matplotlib.image
    grid = matplotlib.image.imread(paths["grid"])
    assert grid.std() > 0.05  # not a blank canvas
    saved = json.loads(open(paths["evaluation"]).read())
    assert saved["top1_per_seed"] == [49.0, 51.0] and saved["curves"][0] == [[1, 30.0], [2, 49.0]]
    # Rewriting without an evaluation keeps the one written before.
    again = write_report(open_run(run.run_dir))
    assert again["evaluation"] == paths["evaluation"] and report_files(run.run_dir) == again


def test_loss_curves_concatenate_stages_and_mark_every_merge(runs):
    curves = loss_curves(open_run(runs["fadrm"].run_dir))
    assert len(curves.ce) == len(curves.bn) == 12
    assert curves.merges == [3, 6, 9]  # k = 3 merges after stages of 3 iterations, none after the last
    assert curves.units == 3  # ipc 3, one pack per IPC index
    assert torch.isfinite(torch.as_tensor(curves.ce)).all()


def test_a_selection_only_run_gets_a_placeholder_loss_plot(runs):
    assert loss_curves(open_run(runs["rded"].run_dir)).units == 0
    paths = write_report(open_run(runs["rded"].run_dir))
    assert png_size(paths["losses"])[0] > 100 and "evaluation" not in paths


# --------------------------------------------------------------------------- diagnostics
def test_pre_merge_images_invert_the_arc_merge_exactly():
    torch.manual_seed(0)
    model = create_model("convnet-bn", num_classes=10, in_chans=1, image_size=8, width=16)
    model.train()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(32, 1, 8, 8))
    teacher = FrozenTeacher(model.eval())
    patches = torch.randint(0, 256, (1, 10, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def state(cfg):
        return init_state(cfg, list(range(10)), [0], patches, 8, 1, [0.3], [0.37])

    arc = DistillConfig(iterations=8, k=1, alpha=0.5, ipc=1, precision="fp32", stage_resolutions=[6, 8]).resolve(8, 10, False, channels=1)
    plain = DistillConfig(iterations=8, k=1, alpha=1.0, ipc=1, precision="fp32", stage_resolutions=[6, 8]).resolve(8, 10, False, channels=1)
    s_arc, s_plain = run_stage(state(arc), [teacher], arc), run_stage(state(plain), [teacher], plain)
    before, _ = pre_merge_images(s_arc, 0.5)
    assert torch.allclose(before, s_plain.x, atol=1e-5)
    assert not torch.allclose(s_arc.x, s_plain.x, atol=1e-3)


def test_arc_merge_effect_reports_every_merge(digits, digits_teacher, tmp_path):
    result = arc_merge_effect(digits, digits_teacher[0], ipc=1, iterations=8, out_dir=tmp_path)
    assert [m["stage"] for m in result["merges"]] == [0, 1, 2]
    for m in result["merges"]:
        assert -1 <= m["cosine_min"] <= m["cosine_mean"] <= 1 + 1e-6 and m["images"] == 10
        assert 0 <= m["acc_before"] <= 100 and 0 <= m["acc_after"] <= 100
        # The merge moves the images halfway back to the real patch, in pixels; the features follow.
        assert m["patch_cosine_after"] >= m["patch_cosine_before"] - 0.05
    assert png_size(result["png"])[0] > 300


def test_information_vanishing_returns_numbers_and_a_plot(digits, digits_teacher, tmp_path):
    result = information_vanishing(digits, digits_teacher[0], EvalJob(config=EvalConfig(seeds=1, epochs=2)),
                                   EvalSpec(progress=False), budgets=[0, 4], ipc=1, out_dir=tmp_path)
    assert [r["budget"] for r in result["arc"]] == [0, 4] == [r["budget"] for r in result["no_arc"]]
    assert all(0 <= r["top1_mean"] <= 100 for r in result["arc"] + result["no_arc"])
    # With no iterations both are the same real patches, so the same students.
    assert result["arc"][0]["top1_per_seed"] == result["no_arc"][0]["top1_per_seed"]
    assert png_size(result["png"])[0] > 300 and json.loads(open(result["json"]).read())["budgets"] == [0, 4]


def test_the_evaluation_plot_shows_the_images_with_hard_labels_only(tmp_path):
    """Where DD-Ranking measured the set with hard labels, the bars show it beside the run (what
    the teacher's soft labels add) and the summary line names it."""
    from fadrm_ray.evaluation.scores import BaselineScore, PairedGain, Ranking
    from fadrm_ray.evaluation.report import write_evaluation_plot

    ranking = Ranking(full_hard_top1=90.0, hard_top1_per_seed=[41.0, 43.0], hlr=48.0)
    evaluation = Evaluation(top1_mean=60.0, top1_std=1.0, top1_per_seed=[59.0, 61.0], best_top1_mean=61.0,
                            best_top1_std=0.0, best_top1_per_seed=[61.0, 61.0], student="convnet-bn", seeds=[0, 1],
                            curves=[[(1, 30.0), (2, 59.0)], [(1, 35.0), (2, 61.0)]], epochs=2, steps_per_seed=8,
                            seconds=1.0, images=30, dataset="digits", test_size=359, teachers=["t"],
                            config=EvalConfig(epochs=2, seeds=2), ranking=ranking,
                            baselines={"random-real": BaselineScore(top1_mean=55.0, top1_std=1.0,
                                                                    top1_per_seed=[54.0, 56.0])},
                            paired_gains={"random-real": PairedGain(mean=5.0, stderr=0.0, higher=2, seeds=2)})
    assert ranking.hard_label_text() == "42.00 ± 1.41%"
    path = write_evaluation_plot(evaluation, tmp_path / "evaluation.png")
    width, height = png_size(path)
    assert width > 600 and height > 300


def test_class_names_in_any_script_are_drawn_or_written_as_code_points_without_glyph_warnings(tmp_path,
                                                                                              monkeypatch, caplog):
    """A folder whose classes are named in Latin, hiragana (a glyph matplotlib's STIX font has)
    and katakana: the grid draws each name with a font that has its glyphs, writes a character
    no installed font has as its code point, and matplotlib warns of no missing glyph."""
    import warnings

    import numpy as np
    from PIL import Image

    from fadrm_ray.config import SqueezeConfig
    from fadrm_ray.data import get_dataset
    from fadrm_ray.evaluation.fonts import _font_file, _glyphs, drawable
    from fadrm_ray.evaluation.report import write_grid
    from fadrm_ray.squeeze import squeeze

    monkeypatch.setenv("FADRM_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    names = ["slime", "の", "スライム"]
    for c, name in enumerate(names):
        (tmp_path / "sprites" / name).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(40 * c, 100 + 40 * c, (16, 16, 3), dtype=np.uint8)).save(
                tmp_path / "sprites" / name / f"{i}.png")
    data = get_dataset(f"imagefolder:{tmp_path / 'sprites'}")
    teacher = squeeze(data, SqueezeConfig(epochs=1), out_dir=tmp_path / "t", progress=False).path
    spec = ExecutionSpec(local=True, progress=False)
    job, parts = prepare_job(make_config("random-real", overrides={"ipc": 2}), data, "x", [teacher],
                             tmp_path / "store", device_type=execute.device_type(spec))
    run = execute.run(job, spec, parts)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO", logger="matplotlib"):
        warnings.simplefilter("always")
        png = write_grid(open_run(run.run_dir), tmp_path / "grid.png")
    assert png_size(png)[0] > 0
    assert not [w for w in caught if "missing from" in str(w.message) or "Glyph" in str(w.message)]
    # Nor does matplotlib's font lookup log anything (a family without a regular face warns there).
    assert not [r for r in caplog.records if r.levelno >= 30], [r.getMessage() for r in caplog.records]

    labels = [f"{k}: {n}" for k, n in enumerate(data.class_names)]
    drawn = drawable(labels)
    assert "STIXGeneral" in drawn.family and "の" in drawn.labels[data.class_names.index("の")]
    files = [_font_file(f) for f in drawn.family]
    for label in drawn.labels:  # every character left is one a font of the family list has
        assert all(any(ord(ch) in _glyphs(f) for f in files) for ch in label if not ch.isspace())
    for ch in drawn.escaped:  # and every one written as its code point is one none of them has
        assert f"\\u{ord(ch):04x}" in drawn.labels[data.class_names.index("スライム")]
