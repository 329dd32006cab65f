"""DD-Ranking's scores: each against a hand computation, the hard-label students, and the scores
of an evaluation with baselines (the full-data student trained once per store and reused)."""
from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from fadrm_ray.evaluation import evaluate as evaluate_module
from fadrm_ray.evaluation import ranking
from fadrm_ray.evaluation.baselines import evaluate_with_baselines
from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.evaluation.evaluate import open_for_evaluation
from fadrm_ray.config import make_config
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.evaluation.ranking import HardLabels, augmentation_robust_score, label_robust_score, ranking_scores, ranking_text
from fadrm_ray.evaluation.report import write_report
from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.config import EvalConfig
from fadrm_ray.store import open_run

E = math.e


def test_each_score_equals_a_hand_computation():
    # Two seeds. Full data, hard labels: 90. The set with hard labels: 60 and 70; with soft
    # labels 80 and 84; random real images with soft labels 78 and 80; without augmentation the
    # set 75 and 79, the random images 76 and 74.
    scores = ranking_scores(top1=[80.0, 84.0], random_top1=[78.0, 80.0], full_hard_top1=90.0, hard_top1=[60.0, 70.0],
                            plain_top1=[75.0, 79.0], plain_random_top1=[76.0, 74.0])
    # HLR per seed 30 and 20; IOR 2 and 4; IOR without augmentation -1 and 5.
    assert (scores.hlr, scores.ior, scores.plain_ior) == (25.0, 3.0, 2.0)
    # LRS per seed: alpha = 0.5 * IOR - 0.5 * HLR (fractions of 1) = -0.14 and -0.08,
    # (e^alpha - e^-1) / (e - e^-1) = 0.213359 and 0.236231.
    lrs = ((E ** -0.14 - E ** -1) / (E - E ** -1) + (E ** -0.08 - E ** -1) / (E - E ** -1)) / 2
    assert scores.lrs == round(lrs, 4) == 0.2248
    # ARS per seed: beta = 0.5 * 0.02 + 0.5 * -0.01 = 0.005 and 0.5 * 0.04 + 0.5 * 0.05 = 0.045,
    # mapped alike: 0.271075 and 0.288525.
    ars = ((E ** 0.005 - E ** -1) / (E - E ** -1) + (E ** 0.045 - E ** -1) / (E - E ** -1)) / 2
    assert scores.ars == round(ars, 4) == 0.2798
    assert scores.hard_top1_per_seed == [60.0, 70.0] and scores.full_hard_top1 == 90.0


def test_the_scores_span_zero_to_one_and_follow_the_weight():
    assert label_robust_score(hlr=100.0, ior=-100.0) == pytest.approx(0.0)
    assert label_robust_score(hlr=-100.0, ior=100.0) == pytest.approx(1.0)
    assert augmentation_robust_score(0.0, 0.0) == pytest.approx((1 - E ** -1) / (E - E ** -1))
    # w = 1 counts the IOR only, w = 0 the HLR only.
    assert label_robust_score(hlr=50.0, ior=10.0, weight=1.0) == pytest.approx((E ** 0.1 - E ** -1) / (E - E ** -1))
    assert label_robust_score(hlr=50.0, ior=10.0, weight=0.0) == pytest.approx((E ** -0.5 - E ** -1) / (E - E ** -1))


def test_a_score_without_its_inputs_is_not_measured():
    only_ior = ranking_scores(top1=[80.0], random_top1=[79.5], missing=["HLR and LRS: no full data"])
    assert (only_ior.ior, only_ior.hlr, only_ior.lrs, only_ior.ars) == (0.5, None, None, None)
    assert ranking_text(only_ior) == "IOR +0.50" and only_ior.missing == ["HLR and LRS: no full data"]
    with pytest.raises(ValueError, match="paired seeds must match"):
        ranking_scores(top1=[80.0, 81.0], random_top1=[79.0])


def test_hard_labels_are_cross_entropy_on_the_images_unaugmented():
    images = torch.arange(5 * 1 * 2 * 2, dtype=torch.uint8).view(5, 1, 2, 2) * 10
    labels = torch.tensor([3, 1, 4, 1, 5])
    targets = HardLabels(labels)
    batches = list(targets.source(images, batch_size=2, seed=0).epoch(0))
    # Every image once per epoch, as it is (in [0, 1]); the trailing single image joins the batch before.
    seen = torch.cat([b.indices for b in batches])
    assert sorted(seen.tolist()) == [0, 1, 2, 3, 4] and [len(b.indices) for b in batches] == [2, 3]
    for b in batches:
        assert torch.equal(b.view01, images[b.indices].float() / 255)
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    step = batches[1]
    by_hand = -torch.log_softmax(logits, dim=1)[torch.arange(3), labels[step.indices]].mean()
    assert torch.allclose(targets.loss(logits, step), by_hand)
    assert torch.allclose(targets.loss(logits, step), F.cross_entropy(logits, labels[step.indices]))
    with pytest.raises(ValueError, match="5 images but 4 labels"):
        HardLabels(labels[:4]).source(images, 2, 0)


def with_baselines(run_dir, job: EvalJob, spec: EvalSpec, **kwargs):
    """`evaluate_with_baselines` of the run in `run_dir`, opened with its own teachers."""
    return evaluate_with_baselines(open_for_evaluation(run_dir, job, spec, own_teachers=True), job, spec, **kwargs)


@pytest.fixture(scope="module")
def ranked(digits, digits_teacher, tmp_path_factory):
    """An IPC 2 run of four digit classes evaluated with its baselines and DD-Ranking's scores."""
    from fadrm_ray.runtime import torch_threads

    root = tmp_path_factory.mktemp("ranking")
    teacher = root / "teacher.pt"
    shutil.copy(digits_teacher[0], teacher)
    cfg = make_config("fadrm", overrides={"ipc": 2, "iterations": 8, "classes": [0, 1, 2, 3]})
    steps = ranking.FULL_DATA_STEPS
    ranking.FULL_DATA_STEPS = 40  # a short full-data student: the test is of the bookkeeping
    try:
        with torch_threads(1):
            spec = ExecutionSpec(local=True, progress=False)
            job, parts = prepare_job(cfg, digits, "digits", [teacher], root / "store",
                                     device_type=execute.device_type(spec))
            run = execute.run(job, spec, parts)
            result = with_baselines(run.run_dir, EvalJob(config=EvalConfig(epochs=3, seeds=2)),
                                             EvalSpec(progress=False), ars=True)
    finally:
        ranking.FULL_DATA_STEPS = steps
    return run.run_dir, result


def test_an_evaluation_with_baselines_carries_its_scores(ranked):
    run_dir, result = ranked
    r = result.ranking
    assert r is not None and r.missing == []
    # IOR is the gain over the random-real baseline; HLR the full-data student minus the hard-label ones.
    assert r.ior == pytest.approx(result.paired_gains["random_real"].mean, abs=1e-3)
    assert r.hlr == pytest.approx(r.full_hard_top1 - sum(r.hard_top1_per_seed) / 2, abs=1e-3)
    hlr = [r.full_hard_top1 - h for h in r.hard_top1_per_seed]
    ior = [a - b for a, b in zip(result.top1_per_seed, result.baselines["random_real"].top1_per_seed)]
    assert r.lrs == round(sum(label_robust_score(h, i) for h, i in zip(hlr, ior)) / 2, 4)
    assert 0.0 <= r.lrs <= 1.0 and 0.0 <= r.ars <= 1.0 and r.plain_ior is not None
    # The full-data student is kept beside the store's runs, once.
    assert len(list((run_dir.parent / "references").glob("full-hard-*.json"))) == 1
    # The scores travel with the evaluation's JSON and into the report's figure.
    again = Evaluation.model_validate_json(result.model_dump_json())
    assert again.ranking == r
    report = write_report(open_run(run_dir), evaluation=result)
    assert Evaluation.model_validate_json(open(report["evaluation"]).read()).ranking == r


def test_the_students_behind_the_scores_are_not_trained_again(ranked, monkeypatch):
    run_dir, result = ranked

    def no_training(*args, **kwargs):
        raise AssertionError("a kept student was trained again")

    monkeypatch.setattr(ranking, "train_student", no_training)
    monkeypatch.setattr(evaluate_module, "train_student", no_training)
    monkeypatch.setattr(ranking, "FULL_DATA_STEPS", 40)  # the key of the student kept by the fixture
    again = with_baselines(run_dir, EvalJob(config=EvalConfig(epochs=3, seeds=2)), EvalSpec(progress=False),
                                    ars=True)
    assert again.ranking == result.ranking


def test_without_the_ranking_nothing_is_scored(ranked):
    run_dir, result = ranked
    plain = with_baselines(run_dir, EvalJob(config=EvalConfig(epochs=3, seeds=2)), EvalSpec(progress=False),
                                    ranking=False)
    assert plain.ranking is None and plain.top1_per_seed == result.top1_per_seed


def test_the_hard_label_ranking_reads_the_students_the_full_ranking_kept(ranked, monkeypatch):
    """What the service reports beside an evaluation (`hard_label_ranking`) is the hard-label part
    of the full ranking, read back from the students it kept."""
    run_dir, result = ranked

    def no_training(*args, **kwargs):
        raise AssertionError("a kept student was trained again")

    monkeypatch.setattr(ranking, "train_student", no_training)
    job, spec = EvalJob(), EvalSpec(progress=False)
    hard = ranking.hard_label_ranking(open_for_evaluation(run_dir, job, spec), result, job, spec)
    assert hard.hard_top1_per_seed == result.ranking.hard_top1_per_seed
