"""Relabel and student evaluation (docs/method.md section 6) on the real digits data."""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from torch import nn

from fadrm_ray.augment import cutmix_box
from fadrm_ray.config import make_config
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, prepare_job
from fadrm_ray.evaluation.eval_job import EvalHooks, EvalJob, EvalParts, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.evaluation.training import EvaluationError, cosine_factor, default_epochs, kd_loss, param_groups, train_student
from fadrm_ray.evaluation.evaluate import evaluate_images
from fadrm_ray.evaluation.relabel import AugmentSpec, OnlineSoftLabels, SoftLabeler, apply_plan, draw_plan, epoch_generator
from fadrm_ray.evaluation.soft_labels import StoredSoftLabels, precompute_soft_labels
from fadrm_ray.config import EvalConfig
from fadrm_ray.store import open_run

DOCUMENTED_KEYS = {"top1_mean", "top1_std", "top1_per_seed", "best_top1_per_seed", "student", "epochs", "seconds"}


pytestmark = pytest.mark.usefixtures("one_thread")  # results are repeatable for a fixed thread count


@pytest.fixture(scope="module")
def labeler(digits, digits_teacher):
    return SoftLabeler.from_paths([digits_teacher[0]], digits)


QUIET = EvalSpec(progress=False)  # students without progress bars


def evaluated(run_dir, job: EvalJob, hooks: EvalHooks | None = None):
    """The store run in `run_dir` evaluated under `job` with `QUIET` (the run opened once)."""
    return evaluate_store_run(run_dir, job, QUIET, hooks=hooks).evaluation


def quiet(cfg: EvalConfig, **settings) -> EvalJob:
    """An evaluation of `cfg` (and any other `settings`), run with `QUIET`."""
    return EvalJob(config=cfg, **settings)


def real_subset(digits, per_class: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    idx = []
    for c in range(digits.num_classes):
        members = digits.train.indices_of_class(c)
        idx.append(members[torch.randperm(members.numel(), generator=gen)[:per_class]])
    idx = torch.cat(idx)
    return digits.train.load(idx), digits.train.labels[idx]


# --------------------------------------------------------------------------- loss and optimizer
def test_kd_loss_equals_a_hand_computation():
    torch.manual_seed(0)
    s, t, temp = torch.randn(4, 5) * 3, torch.randn(4, 5) * 3, 20.0
    total = 0.0
    for i in range(4):
        zs = [math.exp(v / temp) for v in s[i].tolist()]
        zt = [math.exp(v / temp) for v in t[i].tolist()]
        ps = [v / sum(zs) for v in zs]
        pt = [v / sum(zt) for v in zt]
        total += sum(a * (math.log(a) - math.log(b)) for a, b in zip(pt, ps))
    expected = total / 4 * temp * temp  # batch mean, scaled by T^2
    assert kd_loss(s, t, temp).item() == pytest.approx(expected, rel=1e-4)
    assert kd_loss(t, t, temp).item() == pytest.approx(0.0, abs=1e-6)


def test_no_weight_decay_on_biases_and_norms_and_the_stretched_cosine():
    model = nn.Sequential(nn.Conv2d(1, 4, 3, bias=True), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
    model(torch.zeros(2, 1, 5, 5))
    decay, no_decay = param_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert len(no_decay["params"]) == 4  # conv bias, BN weight and bias, linear bias
    assert cosine_factor(0, 100) == 1.0
    assert cosine_factor(100, 100, stretch=2.0) == pytest.approx(0.5)   # stretched: ends at half the rate
    assert cosine_factor(100, 100) == pytest.approx(0.0)               # default: a full cosine
    assert default_epochs(10) > default_epochs(100) >= 40


# --------------------------------------------------------------------------- augmentation
def test_cutmix_box_area_is_the_mixing_weight_of_images_and_soft_labels():
    spec = AugmentSpec(out_size=8, hflip=False)
    images = torch.randint(0, 256, (6, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x01 = images.float() / 255
    # Constant images through a teacher that is linear in the pixel mean: its logits on a
    # CutMix view are exactly lam * own + (1 - lam) * partner iff lam is the kept area.
    flat01 = torch.linspace(0.1, 0.9, 6).view(6, 1, 1, 1).expand(6, 1, 8, 8).contiguous()
    linear = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1, 3))
    teacher = SoftLabeler([linear], [[0.0]], [[1.0]], [1])
    mixed_seen = 0
    for seed in range(20):
        plan = draw_plan(torch.arange(6), 8, 8, spec, torch.Generator().manual_seed(seed))
        assert not plan.flips.any()  # digits: a flip does not keep the label
        y0, y1, x0, x1 = plan.mix_box
        assert plan.lam == pytest.approx(1 - (y1 - y0) * (x1 - x0) / 64)
        plain = apply_plan(x01, type(plan)(plan.indices, plan.boxes, plan.flips, torch.arange(6), (0, 0, 0, 0), 1.0), 8)
        view = apply_plan(x01, plan, 8)
        inside = torch.zeros(8, 8, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        assert torch.equal(view[:, :, ~inside], plain[:, :, ~inside])
        assert torch.equal(view[:, :, inside], plain[plan.partner][:, :, inside])
        if plan.mixed:
            mixed_seen += 1
            flat = apply_plan(flat01, plan, 8)
            own = teacher(flat01)
            expected = plan.lam * own + (1 - plan.lam) * own[plan.partner]
            assert torch.allclose(teacher(flat), expected, atol=1e-5)
    assert mixed_seen >= 10


def test_cutmix_box_is_clipped_and_its_lambda_follows():
    box, lam = cutmix_box(8, 8, 0.0, 0, 0)  # the whole-image box centred on a corner keeps a quarter
    assert box == (0, 4, 0, 4) and lam == pytest.approx(1 - 16 / 64)
    assert cutmix_box(8, 8, 1.0, 3, 3) == ((0, 0, 0, 0), 1.0)


def test_flips_follow_the_dataset():
    plan = draw_plan(torch.arange(64), 8, 8, AugmentSpec(out_size=8, hflip=True), torch.Generator().manual_seed(0))
    assert 10 < int(plan.flips.sum()) < 54


# --------------------------------------------------------------------------- students
def test_a_student_trained_on_real_digits_learns(digits, labeler, digits_teacher):
    images, _ = real_subset(digits, per_class=30)
    result = train_student(images, 0, EvalJob(config=EvalConfig(epochs=15)), QUIET,
                           EvalParts(dataset=digits, labeler=labeler))
    assert result.steps == 15 * 19  # 300 images, batch 16: 18 full batches + one of 12
    # Chance is 10 %; the session teacher (4 epochs, width 32) is about 80 %.
    assert result.final_top1 >= 60.0, result


def test_evaluation_is_deterministic_for_a_seed(digits, digits_teacher):
    images, labels = real_subset(digits, per_class=3)
    cfg = EvalConfig(epochs=6, seeds=[5])
    job, parts = EvalJob(config=cfg, teacher_paths=[digits_teacher[0]]), EvalParts(dataset=digits)
    a = evaluate_images(images, labels, job, QUIET, parts)
    b = evaluate_images(images, labels, job, QUIET, parts)
    assert a.top1_per_seed == b.top1_per_seed and a.curves == b.curves
    c = evaluate_images(images, labels, job.with_config(EvalConfig(epochs=6, seeds=[6])), QUIET, parts)
    assert c.curves != a.curves


def test_the_test_split_is_decoded_once_for_every_student_of_an_evaluation(digits, labeler, decodes_counted):
    images, labels = real_subset(digits, per_class=2)
    decoded = decodes_counted(digits.test)
    job = EvalJob(config=EvalConfig(epochs=1, seeds=3))
    result = evaluate_images(images, labels, job, QUIET, EvalParts(dataset=digits, labeler=labeler))
    assert len(result.top1_per_seed) == 3
    assert sum(decoded) == len(digits.test)  # three students, one decode of the split
    # A student trained on its own decodes it for itself; test images of other classes are refused.
    decoded.clear()
    train_student(images, 0, job, QUIET, EvalParts(dataset=digits, labeler=labeler))
    assert sum(decoded) == len(digits.test)
    from fadrm_ray.evaluation.on_device import TestImages

    others = TestImages(digits.test, digits, torch.device("cpu"), classes=[0, 1])
    with pytest.raises(ValueError, match="test images handed over"):
        train_student(images, 0, job, QUIET, EvalParts(dataset=digits, labeler=labeler, test_images=others))

def test_stored_soft_labels_reproduce_the_online_ones(digits, labeler, tmp_path):
    images, _ = real_subset(digits, per_class=4)
    spec = AugmentSpec(out_size=8, hflip=digits.hflip)
    online = OnlineSoftLabels(images, labeler, spec, batch_size=16, seed=3)
    folder = precompute_soft_labels(online, epochs=3, directory=tmp_path)
    stored = StoredSoftLabels(folder, images)
    assert isinstance(stored, torch.utils.data.Dataset) and len(stored) == 3 * online.steps_per_epoch
    for epoch in (2, 0):  # any epoch, in any order
        for a, b in zip(online.epoch(epoch), stored.epoch(epoch), strict=True):
            assert torch.equal(a.plan.indices, b.plan.indices) and torch.equal(a.plan.boxes, b.plan.boxes)
            assert a.plan.mix_box == b.plan.mix_box and torch.equal(a.plan.partner, b.plan.partner)
            assert torch.equal(a.view01, b.view01)
            assert torch.allclose(a.logits, b.logits, rtol=2e-3, atol=2e-3)  # fp16 storage
    # A rerun fills in only what is missing; fp32 storage gives the very same student.
    parts = EvalParts(dataset=digits, labeler=labeler)
    on, on_model = train_student(images, 3, EvalJob(config=EvalConfig(epochs=4, soft_labels="online")), QUIET,
                                 parts, return_model=True)
    stored_job = EvalJob(config=EvalConfig(epochs=4, soft_labels="stored", soft_label_dtype="float32"))
    st, st_model = train_student(images, 3, stored_job, QUIET, replace(parts, soft_label_dir=tmp_path),
                                 return_model=True)
    a, b = on_model.state_dict(), st_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and on.curve == st.curve
    assert epoch_generator(3, 1).initial_seed() != epoch_generator(3, 2).initial_seed()


def test_several_teachers_average_their_logits(digits, digits_teacher):
    path = digits_teacher[0]
    one = SoftLabeler.from_paths([path], digits)
    two = SoftLabeler.from_paths([path, path], digits)
    view = torch.rand(5, 1, 8, 8)
    assert torch.allclose(one(view), two(view), atol=1e-6)


# --------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def tiny_run(digits, digits_teacher, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("evalstore")
    teacher = root / "teacher.pt"
    shutil.copy(digits_teacher[0], teacher)
    cfg = make_config("fadrm", overrides={"ipc": 2, "iterations": 8, "ipc_per_unit": 2, "pack": 2})
    spec = ExecutionSpec(local=True, progress=False)
    job, parts = prepare_job(cfg, digits, "digits", [teacher], root / "store", device_type=execute.device_type(spec))
    return execute.run(job, spec, parts).run_dir, teacher


def test_evaluate_run_returns_the_documented_keys(tiny_run):
    run_dir, _ = tiny_run
    result = evaluated(run_dir, EvalJob(config=EvalConfig(epochs=3, seeds=2)))
    assert DOCUMENTED_KEYS <= set(result.model_dump())
    assert result.student == "convnet-bn" and result.epochs == 3 and result.images == 20
    assert len(result.top1_per_seed) == 2 and len(result.best_top1_per_seed) == 2
    assert all(0 <= v <= 100 for v in result.top1_per_seed)
    assert all(b >= f for b, f in zip(result.best_top1_per_seed, result.top1_per_seed))
    assert result.top1_mean == pytest.approx(sum(result.top1_per_seed) / 2, abs=1e-3)
    assert result.dataset == "digits" and result.run_id == run_dir.name and result.ipc == 2


def test_more_seeds_later_train_only_the_new_students(tiny_run):
    run_dir, _ = tiny_run
    trained = []
    seen = lambda seed, epoch, epochs, top1: trained.append(seed) if epoch == epochs else None  # noqa: E731
    two = evaluated(run_dir, quiet(EvalConfig(epochs=2, seeds=2)), EvalHooks(on_eval=seen))
    assert trained == [0, 1] and two.seeds_reused == []
    three = evaluated(run_dir, quiet(EvalConfig(epochs=2, seeds=3)), EvalHooks(on_eval=seen))
    assert trained == [0, 1, 2] and three.seeds_reused == [0, 1] and not three.cached
    assert three.top1_per_seed[:2] == two.top1_per_seed
    # The reused students are the ones a fresh evaluation trains.
    fresh = evaluated(run_dir, quiet(EvalConfig(epochs=2, seeds=3), cache=False))
    assert fresh.top1_per_seed == three.top1_per_seed
    assert fresh.curves == [[tuple(point) for point in curve] for curve in three.curves]  # JSON gave lists
    # A seed list alone, and a whole evaluation read back from its cache, train nothing.
    evaluated(run_dir, quiet(EvalConfig(epochs=2, seeds=[2, 0])), EvalHooks(on_eval=seen))
    assert evaluated(run_dir, quiet(EvalConfig(epochs=2, seeds=3)), EvalHooks(on_eval=seen)).cached
    assert trained == [0, 1, 2]
    # A whole evaluation cached before students were kept apart gives them up when it is read.
    cached = {f: json.loads(f.read_text()) for f in open_run(run_dir).layout.evaluations_dir.glob("*.json")}
    students = [f for f, r in cached.items() if "seeds" not in r and r["epochs"] == 2]  # this test's only
    assert len(students) == 3
    for f in students:
        f.unlink()
    assert evaluated(run_dir, quiet(EvalConfig(epochs=2, seeds=3))).cached
    one = evaluated(run_dir, quiet(EvalConfig(epochs=2, seeds=[1])), EvalHooks(on_eval=seen))
    assert trained == [0, 1, 2] and one.top1_per_seed == three.top1_per_seed[1:2]


def test_evaluate_run_refuses_a_changed_teacher(tiny_run, tmp_path):
    run_dir, teacher = tiny_run
    backup = tmp_path / "teacher.pt"
    shutil.copy(teacher, backup)
    try:
        with open(teacher, "ab") as fh:
            fh.write(b"x")
        with pytest.raises(EvaluationError, match="changed since the run was distilled"):
            evaluated(run_dir, quiet(EvalConfig(epochs=1, seeds=1)))
        result = evaluated(run_dir, quiet(EvalConfig(epochs=1, seeds=1), teacher_paths=[backup]))
        assert len(result.top1_per_seed) == 1
    finally:
        shutil.copy(backup, teacher)


def test_bad_options_fail_clearly(digits, digits_teacher):
    images, labels = real_subset(digits, per_class=1)
    parts = EvalParts(dataset=digits)
    with pytest.raises(EvaluationError, match="soft_labels"):
        evaluate_images(images, labels, quiet(EvalConfig(soft_labels="disk"), teacher_paths=[digits_teacher[0]]), QUIET,
                        parts)
    with pytest.raises(EvaluationError, match=r"images must be \(N, 1, 8, 8\)"):
        evaluate_images(images[:, :, :4, :4], labels, quiet(EvalConfig(), teacher_paths=[digits_teacher[0]]), QUIET,
                        parts)
    with pytest.raises(ValueError, match="soft_label_dir"):
        evaluate_images(images, labels, quiet(EvalConfig(soft_labels="stored", epochs=1, seeds=1),
                                              teacher_paths=[digits_teacher[0]]), QUIET, parts)


def test_a_class_subset_is_scored_on_its_own_classes(digits, digits_teacher, tmp_path):
    """A 2-class run is tested on the test images of its 2 classes, its prediction the better of
    their two outputs: far above the 50 % of chance there, where the whole test set would put
    it near 20 % (it never saw the other eight classes)."""
    cfg = make_config("random-real", overrides={"ipc": 5, "classes": [3, 7]})
    spec = ExecutionSpec(local=True, progress=False)
    job, parts = prepare_job(cfg, digits, "digits", [digits_teacher[0]], tmp_path / "store",
                             device_type=execute.device_type(spec))
    run = execute.run(job, spec, parts)
    result = evaluated(run.run_dir, quiet(EvalConfig(epochs=20, seeds=2)))
    tested = int(sum(int((digits.test.labels == c).sum()) for c in (3, 7)))
    assert result.classes == [3, 7] and result.test_size == tested < len(digits.test)
    assert result.top1_mean >= 65.0, result.top1_per_seed
    # The same images scored on every class: the number a subset used to get.
    images, labels, _ = open_run(run.run_dir).read()
    everything = evaluate_images(images, labels,
                                 quiet(EvalConfig(epochs=20, seeds=2), teacher_paths=[digits_teacher[0]]), QUIET,
                                 EvalParts(dataset=digits))
    assert everything.classes is None and everything.test_size == len(digits.test)
    assert everything.top1_mean < 40.0 < result.top1_mean
    # The subset is part of what names the cached evaluation: the score read back is the subset's.
    assert evaluated(run.run_dir, quiet(EvalConfig(epochs=20, seeds=2))).top1_per_seed == \
        result.top1_per_seed


def test_students_without_augmentation_see_the_images_as_they_are(tiny_run, digits, labeler, monkeypatch):
    from fadrm_ray.evaluation import training as evaluate_module

    specs = []
    real_source = evaluate_module.soft_label_source

    def recording(mode, online, *args, **kwargs):
        specs.append(online.spec)
        return real_source(mode, online, *args, **kwargs)

    monkeypatch.setattr(evaluate_module, "soft_label_source", recording)
    images, _ = real_subset(digits, 2)
    train_student(images, 0, quiet(EvalConfig(epochs=1), augment=False), QUIET,
                  EvalParts(dataset=digits, labeler=labeler))
    assert specs[-1] == AugmentSpec(out_size=8, crop_scale=(1.0, 1.0), hflip=False, cutmix_prob=0.0)
    # Every view of such a spec is a batch of the images themselves.
    for step in OnlineSoftLabels(images, labeler, specs[-1], batch_size=8, seed=3).epoch(0):
        assert torch.equal(step.view01, images[step.plan.indices].float() / 255)
    # In a run, such an evaluation is kept apart from the augmented one of the same settings.
    run_dir, _ = tiny_run
    cfg = EvalConfig(epochs=2, seeds=1)
    augmented = evaluated(run_dir, quiet(cfg))
    plain = evaluated(run_dir, quiet(cfg, augment=False))
    assert (augmented.augment, plain.augment, plain.cached) == (True, False, False)
    assert evaluated(run_dir, quiet(cfg, augment=False)).cached
    assert evaluated(run_dir, quiet(cfg)).top1_per_seed == augmented.top1_per_seed


def test_an_eval_job_is_plain_data_that_crosses_json(tmp_path):
    job = EvalJob(config=EvalConfig(epochs=3, seeds=[1, 2], soft_labels="stored"), teacher_paths=[tmp_path / "t.pt"],
                  teacher_copies=str(tmp_path / "copy.pt"), ipc=4, augment=False)
    spec = EvalSpec(threads=2)
    assert job.teacher_paths == (str(tmp_path / "t.pt"),) and job.teacher_copies == (str(tmp_path / "copy.pt"),)
    assert EvalJob.model_validate_json(job.model_dump_json()) == job
    assert EvalSpec.model_validate_json(spec.model_dump_json()) == spec
    assert job.with_config(EvalConfig()).config == EvalConfig() and job.config.seed_list == [1, 2]
    with pytest.raises(ValueError):
        EvalJob(config=EvalConfig(), num_threads=2)  # settings are named once, and only so
