"""Evaluation protocols, the evaluation cache and the baselines every evaluation is judged against."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fadrm_ray.evaluation import evaluate as evaluate_module
from fadrm_ray.evaluation.baselines import baseline_configs, evaluate_with_baselines, gain_text, paired_gain
from fadrm_ray.config import make_config
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.evaluation.training import default_epochs, images_per_class, resolve_protocol
from fadrm_ray.evaluation.evaluate import open_for_evaluation
from fadrm_ray.evaluation.report import write_report
from fadrm_ray.config import EvalConfig
from fadrm_ray.store import open_run

pytestmark = pytest.mark.usefixtures("one_thread")


def with_baselines(run_dir, job: EvalJob, spec: EvalSpec, **kwargs):
    """`evaluate_with_baselines` of the run in `run_dir`, opened with its own teachers."""
    return evaluate_with_baselines(open_for_evaluation(run_dir, job, spec, own_teachers=True), job, spec, **kwargs)


def test_the_published_protocol_is_300_epochs_1000_at_ipc_1_with_the_stretched_cosine():
    published = EvalConfig(protocol="published")
    assert (resolve_protocol(published, 100, 10).epochs, resolve_protocol(published, 100, 10).cosine_stretch) == (300, 2.0)
    assert (resolve_protocol(published, 10, 1).epochs, resolve_protocol(published, 10, 1).cosine_stretch) == (1000, 2.0)
    assert (resolve_protocol(published, 500, 50).epochs, resolve_protocol(published, 500, 50).cosine_stretch) == (300, 1.0)
    short = resolve_protocol(EvalConfig(), 100, 10)
    assert (short.epochs, short.cosine_stretch) == (default_epochs(100), 1.0)
    explicit = resolve_protocol(EvalConfig(protocol="published", epochs=7, cosine_stretch=1.5), 100, 10)
    assert (explicit.epochs, explicit.cosine_stretch) == (7, 1.5)  # what the user set wins


def test_images_per_class_is_the_largest_class():
    assert images_per_class(torch.tensor([0, 0, 1, 2, 2, 2]), 6, 3) == 3
    assert images_per_class(None, 20, 10) == 2


@pytest.fixture(scope="module")
def store(digits, digits_teacher, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("baselines")
    teacher = root / "teacher.pt"
    shutil.copy(digits_teacher[0], teacher)
    cfg = make_config("fadrm", overrides={"ipc": 2, "iterations": 8, "ipc_per_unit": 2, "pack": 2, "classes": [0, 1, 2, 3]})
    spec = ExecutionSpec(local=True, progress=False)
    job, parts = prepare_job(cfg, digits, "digits", [teacher], root / "store", device_type=execute.device_type(spec))
    return execute.run(job, spec, parts).run_dir, teacher


def test_an_evaluation_is_cached_in_its_run_and_read_back_without_training(store, monkeypatch):
    run_dir, _ = store
    cfg = EvalConfig(epochs=2, seeds=1)
    first = evaluate_store_run(run_dir, EvalJob(config=cfg), EvalSpec(progress=False)).evaluation
    assert not first.cached and list(open_run(run_dir).layout.evaluations_dir.glob("*.json"))

    def no_training(*args, **kwargs):
        raise AssertionError("a cached evaluation trained a student again")

    monkeypatch.setattr(evaluate_module, "train_student", no_training)
    again = evaluate_store_run(run_dir, EvalJob(config=cfg), EvalSpec(progress=False)).evaluation
    assert again.cached and again.top1_per_seed == first.top1_per_seed
    with pytest.raises(AssertionError, match="trained a student again"):  # other settings: a new evaluation
        evaluate_store_run(run_dir, EvalJob(config=EvalConfig(epochs=3, seeds=1)), EvalSpec(progress=False)).evaluation
    with pytest.raises(AssertionError, match="trained a student again"):  # cache=False: never read
        evaluate_store_run(run_dir, EvalJob(config=cfg, cache=False), EvalSpec(progress=False)).evaluation


def test_the_baselines_are_random_real_images_and_the_starting_patches():
    cfg = make_config("fadrm", overrides={"ipc": 3, "seed": 5, "classes": [1, 2], "patch_selection": "medium",
                                          "patch_crop_scale": [1.0, 1.0], "lr": 0.05})
    configs = baseline_configs(cfg)
    real, patches = configs["random_real"], configs["starting_patches"]
    assert (real.preset, real.patch_selection, real.iterations) == ("random-real", "whole", 0)
    assert (patches.preset, patches.iterations, patches.patch_selection, patches.patch_crop_scale) == \
        ("patches", 0, "medium", (1.0, 1.0))
    for b in (real, patches):
        assert (b.ipc, b.seed, b.classes) == (3, 5, [1, 2])
    noise = make_config("sre2l", overrides={"ipc": 3})
    assert set(baseline_configs(noise)) == {"random_real"}  # noise has no starting patches


def test_the_configs_tell_when_the_starting_patches_are_random_real_images():
    from fadrm_ray.evaluation.baselines import same_images

    def baselines_of(recipe: str):
        run = make_config("fadrm", overrides={"recipe": recipe, "iterations": 2}, ipc=1).resolve(16, 3, True,
                                                                                                 channels=3)
        return [b.resolve(16, 3, True, channels=3) for b in baseline_configs(run).values()]

    assert same_images(*baselines_of("gentle"))  # random whole images: how crops would be drawn does not count
    for recipe in ("cifar", "whole", "crops-random"):  # picked by the teacher, or cropped
        assert not same_images(*baselines_of(recipe))
    real, patches = baselines_of("gentle")
    assert not same_images(real, patches.model_copy(update={"seed": 1}))
    assert not same_images(real, patches.model_copy(update={"patch_candidates": 3}))


def test_evaluate_with_baselines_reports_each_baseline_and_the_gains(store, digits, monkeypatch):
    from fadrm_ray.evaluation import ranking

    # A short full-data student: DD-Ranking's scores are tested in test_ranking.py, the baselines here.
    monkeypatch.setattr(ranking, "FULL_DATA_STEPS", 40)
    run_dir, _ = store
    cfg = EvalConfig(epochs=2, seeds=2)
    result = with_baselines(run_dir, EvalJob(config=cfg), EvalSpec(progress=False))
    assert set(result.baselines) == {"random_real", "starting_patches"}
    for name, base in result.baselines.items():
        assert base.run_id != result.run_id
        assert result.gains[name] == pytest.approx(result.top1_mean - base.top1_mean, abs=1e-3)
        diffs = [a - b for a, b in zip(result.top1_per_seed, base.top1_per_seed)]
        paired = result.paired_gains[name]
        assert paired.mean == pytest.approx(result.gains[name], abs=2e-3) and paired.seeds == 2
        assert paired.higher == sum(d > 0 for d in diffs)
        assert paired.stderr == pytest.approx(abs(diffs[0] - diffs[1]) / 2, abs=1e-3)  # s.d. / sqrt(2), n = 2
        images, labels, ipc = open_run(base.run_dir).read()
        assert sorted(set(labels.tolist())) == [0, 1, 2, 3] and images.shape[0] == 8  # same classes and IPC
    # The starting patches are the run's own patches: recover changed the pixels, not the choice.
    patches, plabels, pipc = open_run(result.baselines["starting_patches"].run_dir).read()
    distilled, dlabels, dipc = open_run(run_dir).read()
    assert torch.equal(plabels, dlabels) and torch.equal(pipc, dipc) and not torch.equal(patches, distilled)
    # Written into the report: evaluation.json carries them and the plot shows them.
    files = write_report(open_run(run_dir), evaluation=result)
    saved = json.loads(open_run(run_dir).layout.report_files()["evaluation"].read_text())
    assert saved["gains"] == result.gains and set(saved["baselines"]) == set(result.baselines)
    assert saved["paired_gains"] == {k: v.model_dump() for k, v in result.paired_gains.items()}
    assert files["evaluation_plot"].endswith(".png")
    # An evaluation saved before paired gains were recorded still plots, with the plain gains.
    older = result.model_copy(update={"paired_gains": {}})
    assert write_report(open_run(run_dir), evaluation=older)["evaluation_plot"].endswith(".png")


def test_a_paired_gain_is_the_mean_seed_by_seed_difference_with_its_standard_error():
    gain = paired_gain([90.0, 88.0, 92.0, 85.0], [89.0, 88.5, 90.0, 84.0])  # differences 1, -0.5, 2, 1
    assert gain.model_dump() == {"mean": 0.875, "stderr": pytest.approx(0.515, abs=1e-3), "higher": 3, "seeds": 4}
    assert gain_text(gain) == "+0.88 ± 0.52 s.e., higher on 3 of 4 seeds"
    assert gain_text(gain, seeds=False) == "+0.88 ± 0.52"
    one = paired_gain([80.0], [81.5])
    assert one.model_dump() == {"mean": -1.5, "stderr": None, "higher": 0, "seeds": 1}
    assert gain_text(one) == "-1.50, higher on 0 of 1 seed"
    with pytest.raises(ValueError, match="paired seeds must match"):
        paired_gain([1.0, 2.0], [1.0])


def test_a_baseline_whose_teacher_is_gone_is_reported_not_raised(store, tmp_path, monkeypatch):
    from fadrm_ray.evaluation import ranking

    monkeypatch.setattr(ranking, "FULL_DATA_STEPS", 40)  # the short full-data student kept above
    run_dir, teacher = store
    backup = tmp_path / "teacher.pt"
    shutil.copy(teacher, backup)
    teacher.unlink()
    try:
        result = with_baselines(run_dir, EvalJob(config=EvalConfig(epochs=2, seeds=1), teacher_paths=[backup]),
                                         EvalSpec(progress=False))
    finally:
        shutil.copy(backup, teacher)
    assert set(result.baselines) == {"random_real", "starting_patches"}
    assert all("does not exist" in b.error for b in result.baselines.values())
    assert result.gains == {} and len(result.top1_per_seed) == 1  # the run itself is still evaluated


def test_the_demo_reads_its_chart_from_the_paired_gain_over_random_real_images():
    from types import SimpleNamespace

    from fadrm_ray.demo import CLEAR_GAIN, reading
    from fadrm_ray.evaluation.scores import PairedGain

    def line(mean, stderr):
        gain = PairedGain(mean=mean, stderr=stderr, higher=2, seeds=2)
        return reading(SimpleNamespace(paired_gains={"random_real": gain}, dataset="digits"))

    assert line(2.0, 0.5).startswith("the distilled set is above random real images of the same size: +2.00 ± 0.50")
    level = line(0.6, 0.5)  # within two standard errors: not a gain the chart can show
    assert level.startswith("the distilled set is not clearly above random real images (+0.60 ± 0.50")
    assert "digits" in level and level.endswith(CLEAR_GAIN)
    assert CLEAR_GAIN in line(-0.56, 0.2) and CLEAR_GAIN in line(1.0, None)  # one seed: no error, no claim
    assert "could not be evaluated" in reading(SimpleNamespace(paired_gains={}, dataset="digits"))


def test_below_random_speaks_only_when_the_set_is_clearly_below():
    from fadrm_ray.evaluation.baselines import below_random
    from fadrm_ray.evaluation.scores import PairedGain

    clear = PairedGain(mean=-6.0, stderr=1.0, higher=0, seeds=3)
    line = below_random(clear, "cifar", 32, 3)
    assert line == ("this set is clearly below random real images of the same size (-6.00 ± 1.00 s.e., higher on "
                    "0 of 3 seeds); try recipe gentle (`--set recipe=gentle`, or overrides.recipe), or "
                    "`fadrm tune` over lr, iterations, crop_scale_min and patch_selection")
    assert "try recipe cifar" in below_random(clear, "small-grey", 28, 1)
    assert "try recipe small-grey" in below_random(clear, "cifar", 28, 1)
    assert "try recipe whole" in below_random(clear, "gentle", 32, 3)
    assert "try recipe gentle" in below_random(clear, "imagenet", 224, 3)
    assert below_random(clear, "imagenet", 224, 1).endswith("; try `fadrm tune` over lr, iterations, "
                                                            "crop_scale_min and patch_selection")
    assert below_random(PairedGain(mean=-1.5, stderr=1.0, higher=1, seeds=3), "cifar", 32, 3) is None  # level
    assert below_random(PairedGain(mean=-9.0, stderr=None, higher=0, seeds=1), "cifar", 32, 3) is None  # one seed
    assert below_random(PairedGain(mean=4.0, stderr=0.5, higher=3, seeds=3), "cifar", 32, 3) is None
    assert below_random(None, "cifar", 32, 3) is None


def test_a_set_clearly_below_random_real_images_is_warned_about(store, digits, capsys):
    """Gaussian noise no iteration moved (preset sre2l, T = 0) teaches far less than random real images:
    the evaluation says so in one line, which the report keeps and `fadrm evaluate` prints."""
    from fadrm_ray.cli import main

    run_dir, teacher = store
    noise = make_config("sre2l", overrides={"ipc": 2, "iterations": 0, "classes": [0, 1, 2, 3]})
    spec = ExecutionSpec(local=True, progress=False)
    job, parts = prepare_job(noise, digits, "digits", [teacher], Path(run_dir).parent,
                             device_type=execute.device_type(spec))
    run = execute.run(job, spec, parts)
    result = with_baselines(run.run_dir, EvalJob(config=EvalConfig(epochs=40, seeds=3)),
                                     EvalSpec(progress=False), ranking=False)
    gain = result.paired_gains["random_real"]
    assert gain.mean < -2 * gain.stderr, gain
    [line] = result.warnings
    assert line.startswith("this set is clearly below random real images") and "try recipe" in line
    assert write_report(open_run(run.run_dir), evaluation=result)["evaluation_plot"].endswith(".png")
    assert json.loads(open_run(run.run_dir).layout.report_files()["evaluation"].read_text())["warnings"] == [line]
    capsys.readouterr()
    assert main(["evaluate", "--run", str(run.run_dir), "--no-ranking", "--epochs", "40", "--seeds", "3",
                 "--threads", "1", "--quiet"]) == 0
    assert f"  warning: {line}" in capsys.readouterr().out.splitlines()
