"""Real-patch selection (docs/method.md section 2)."""

import pytest
import torch
import torch.nn.functional as F

from fadrm_ray.config import DistillConfig
from fadrm_ray.models import load_teacher
from fadrm_ray.patches import ClassSelection, _candidates, cut, grouped_order, rank_position, score_class, select_patches
from fadrm_ray.frozen_teacher import FrozenTeacher


@pytest.fixture(scope="module")
def teacher(digits_teacher):
    model, _ = load_teacher(digits_teacher[0])
    return FrozenTeacher(model)


def class_patches(dataset, label, cfg, teachers=(), device="cpu"):
    """uint8 (cfg.ipc, C, D, D): the patches of IPC indices 0..ipc-1 of class `label`, as a unit
    of that one class selects them."""
    return select_patches(dataset, [label], range(cfg.ipc), cfg, teachers, device)[:, 0]


def ce_of(patches, label, dataset, teacher):
    with torch.no_grad():
        logits, _ = teacher(dataset.normalize(patches))
    return F.cross_entropy(logits, torch.full((patches.shape[0],), label), reduction="none")


def test_easy_patches_are_ranked_by_teacher_cross_entropy(digits, teacher):
    cfg = DistillConfig(ipc=6, patch_selection="easy")
    patches = class_patches(digits, 4, cfg, [teacher])
    assert patches.shape == (6, 1, 8, 8) and patches.dtype == torch.uint8
    ce = ce_of(patches, 4, digits, teacher)
    assert torch.all(ce[1:] >= ce[:-1] - 1e-5), ce  # lowest cross-entropy first
    medium = class_patches(digits, 4, DistillConfig(ipc=6, patch_selection="medium"), [teacher])
    assert ce_of(medium, 4, digits, teacher).mean() > ce.mean()


def test_selection_is_deterministic_per_seed(digits, teacher):
    crops = {"patch_crop_scale": (0.5, 1.0), "patch_crops": 5}
    a = class_patches(digits, 2, DistillConfig(ipc=3, seed=1, **crops), [teacher])
    b = class_patches(digits, 2, DistillConfig(ipc=3, seed=1, **crops), [teacher])
    c = class_patches(digits, 2, DistillConfig(ipc=3, seed=2, **crops), [teacher])
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_small_images_start_from_whole_images_of_lowest_teacher_ce(digits, teacher):
    cfg = DistillConfig(ipc=4, patch_selection="easy")  # digits are 8 px: whole images, one "crop" each
    patches = class_patches(digits, 3, cfg, [teacher])
    real = digits.train.load(digits.train.indices_of_class(3))
    ce = ce_of(real, 3, digits, teacher)
    lowest = real[ce.argsort(stable=True)[:4]]
    assert torch.equal(patches, lowest)
    # The ranking of whole images does not depend on the seed (only ties could).
    assert torch.equal(class_patches(digits, 3, cfg.model_copy(update={"seed": 5}), [teacher]), patches)
    # The default below 64 px is spread: the lowest-CE image first, then the groups' best.
    default = DistillConfig(ipc=4)
    assert default.sized(digits.image_size, 1).patch_selection == "spread"
    spread = class_patches(digits, 3, default, [teacher])
    assert torch.equal(spread, class_patches(digits, 3, default.model_copy(update={"patch_selection": "spread"}), [teacher]))
    assert torch.equal(spread[0], lowest[0])


def test_whole_images_are_real_training_images_of_the_class(digits):
    patches = class_patches(digits, 7, DistillConfig(ipc=5, patch_selection="whole"))
    real = digits.train.load(digits.train.indices_of_class(7))
    for p in patches:
        assert any(torch.equal(p, r) for r in real)
    assert len({p.numpy().tobytes() for p in patches}) == 5  # five different images


def test_random_crops_need_no_teacher_and_scored_ones_do(digits):
    assert class_patches(digits, 1, DistillConfig(ipc=2, patch_selection="random")).shape == (2, 1, 8, 8)
    with pytest.raises(ValueError, match="scores crops with the teacher"):
        class_patches(digits, 1, DistillConfig(ipc=2, patch_selection="easy"))


def test_a_patch_does_not_depend_on_the_unit_that_asks_for_it(digits, teacher):
    cfg = DistillConfig(ipc=2)
    whole = select_patches(digits, list(range(10)), [0, 1], cfg, [teacher])
    part = select_patches(digits, [3, 8], [1], cfg, [teacher])
    assert whole.shape == (2, 10, 1, 8, 8) and part.shape == (1, 2, 1, 8, 8)
    assert torch.equal(part[0, 0], whole[1, 3]) and torch.equal(part[0, 1], whole[1, 8])


def test_more_ipc_than_candidates_reuses_the_ranking(digits, teacher):
    cfg = DistillConfig(ipc=5, patch_candidates=2)
    patches = class_patches(digits, 0, cfg, [teacher])
    assert torch.equal(patches[0], patches[2]) and torch.equal(patches[1], patches[3])


def test_cache_is_used(digits, teacher):
    cache = {}
    cfg = DistillConfig(ipc=2, patch_selection="easy")
    select_patches(digits, [5], [0], cfg, [teacher], cache=cache)
    assert isinstance(cache[5], ClassSelection)
    whole = (0, 0, 8)  # a cached ranking is used as it is: here one image, uncropped
    cache[5] = ClassSelection(label=5, ranked=(17,), boxes=(whole,))
    assert torch.equal(select_patches(digits, [5], [1], cfg, [teacher], cache=cache)[0, 0], digits.train.load([17])[0])


@pytest.mark.parametrize("selection", ["easy", "medium", "grouped", "spread", "random", "whole"])
def test_the_patch_of_an_ipc_index_does_not_depend_on_the_ipc(digits, teacher, selection):
    small = class_patches(digits, 3, DistillConfig(ipc=4, patch_selection=selection), [teacher])
    large = class_patches(digits, 3, DistillConfig(ipc=9, patch_selection=selection), [teacher])
    assert torch.equal(small, large[:4])


def test_medium_grows_a_window_centred_in_the_ranking():
    for n in (7, 8):
        order = [rank_position("medium", i, n) for i in range(n)]
        assert sorted(order) == list(range(n))  # every rank once, then the order starts over
        for ipc in range(1, n + 1):
            window = sorted(order[:ipc])
            assert window == list(range(window[0], window[0] + ipc))        # consecutive ranks
            assert abs((window[0] + window[-1]) / 2 - (n - 1) / 2) <= 1    # centred
    assert [rank_position("medium", i, 8) for i in range(8, 11)] == [rank_position("medium", i, 8) for i in range(3)]
    assert [rank_position("easy", i, 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]


def test_a_selection_travels_as_plain_data_and_cuts_like_one_crop_at_a_time(digits, teacher):
    cfg = DistillConfig(ipc=3)
    selection = score_class(digits, 6, cfg, [teacher])
    assert ClassSelection.model_validate_json(selection.model_dump_json()) == selection
    images = digits.train.load(torch.tensor(selection.ranked[:20]))
    boxes = list(selection.boxes[:20])
    one_by_one = torch.cat([cut(images[j:j + 1], boxes[j:j + 1], 8) for j in range(20)])
    assert torch.equal(cut(images, boxes, 8), one_by_one)


def test_grouped_takes_the_lowest_ce_image_of_each_group_of_shuffled_candidates(digits, teacher):
    cfg = DistillConfig(ipc=5, patch_selection="grouped", patch_group=3, seed=2)
    patches = class_patches(digits, 6, cfg, [teacher])
    shuffled, _ = _candidates(digits, 6, cfg.sized(digits.image_size, 1))
    for i in range(5):
        group = digits.train.load(shuffled[3 * i:3 * i + 3])
        ce = ce_of(group, 6, digits, teacher)
        assert torch.equal(patches[i], group[int(ce.argmin())])  # whole images below 64 px
    # The groups are drawn from the seed: another seed, other groups; group size 1 is random images.
    assert not torch.equal(class_patches(digits, 6, cfg.model_copy(update={"seed": 3}), [teacher]), patches)
    single = class_patches(digits, 6, cfg.model_copy(update={"patch_group": 1}), [teacher])
    assert torch.equal(single, digits.train.load(shuffled[:5]))


def test_grouped_order_gives_each_group_its_best_then_its_second_best():
    selection = ClassSelection(label=0, ranked=(5, 3, 9, 1, 7, 2, 8, 0, 4, 6), boxes=((0, 0, 1),) * 10)
    # groups of shuffled images {0..3}, {4..7}, {8, 9}: ranks {7, 3, 5, 1}, {8, 0, 9, 4}, {6, 2}
    assert grouped_order(selection, list(range(10)), 4) == [1, 0, 2, 3, 4, 6, 5, 8, 7, 9]
    assert grouped_order(selection, list(range(10)), 10) == list(range(10))  # one group: easy
    # spread: rank 0 first, then the grouped order without it
    assert grouped_order(selection, list(range(10)), 4, best_first=True) == [0, 1, 2, 3, 4, 6, 5, 8, 7, 9]
    assert grouped_order(selection, list(range(10)), 2, best_first=True)[:3] == [0, 3, 1]  # {7,3} {5,1} {8,0}...


def test_spread_starts_with_the_easy_patch_and_goes_on_with_the_groups(digits, teacher):
    cfg = DistillConfig(ipc=6, patch_selection="spread", patch_group=3, seed=2)
    spread = class_patches(digits, 6, cfg, [teacher])
    easy = class_patches(digits, 6, cfg.model_copy(update={"patch_selection": "easy"}), [teacher])
    grouped = class_patches(digits, 6, cfg.model_copy(update={"patch_selection": "grouped"}), [teacher])
    assert torch.equal(spread[0], easy[0])  # IPC 1: the class's most typical image
    rest = [p for p in grouped if not torch.equal(p, easy[0])]
    assert all(torch.equal(a, b) for a, b in zip(spread[1:], rest))


# ------------------------------------------------------------------ mosaics (RDED's stitched images)
def test_mosaic_1_is_the_default_and_changes_no_run_id_and_no_patch(digits, teacher):
    from fadrm_ray.config import make_config
    from fadrm_ray.runs.job import make_run_id

    for preset in ("fadrm", "rded", "random-real", "fadrm-paper"):
        auto = make_config(preset).resolve(8, 10, channels=1)
        pinned = make_config(preset, overrides={"mosaic": 1}).resolve(8, 10, channels=1)
        assert auto.mosaic == pinned.mosaic == 1
        assert "mosaic" not in auto.identity() and make_run_id(auto, "d", ["t"]) == make_run_id(pinned, "d", ["t"])
    for selection in ("easy", "spread", "random", "whole"):
        cfg = DistillConfig(ipc=3, patch_selection=selection)
        assert torch.equal(class_patches(digits, 4, cfg, [teacher]),
                           class_patches(digits, 4, cfg.model_copy(update={"mosaic": 1}), [teacher]))


def test_a_mosaic_of_whole_images_is_the_next_four_images_each_resized_to_its_quarter(digits):
    single = class_patches(digits, 7, DistillConfig(ipc=8, patch_selection="whole"))  # indices 0-7, as they are
    mosaic = class_patches(digits, 7, DistillConfig(ipc=2, patch_selection="whole", mosaic=2))
    assert mosaic.shape == (2, 1, 8, 8) and mosaic.dtype == torch.uint8
    for i in range(2):
        for r in range(2):
            for c in range(2):
                source = single[4 * i + 2 * r + c:4 * i + 2 * r + c + 1].float()
                quarter = F.interpolate(source, size=(4, 4), mode="bilinear", align_corners=False, antialias=True)
                assert torch.equal(mosaic[i, :, 4 * r:4 * r + 4, 4 * c:4 * c + 4],
                                   quarter.round().clamp(0, 255).to(torch.uint8)[0])


def test_a_mosaic_of_scored_crops_cuts_each_crop_straight_to_its_cell(digits, teacher):
    from fadrm_ray.patches import tile

    cfg = DistillConfig(ipc=2, patch_selection="easy", mosaic=2, patch_crops=3, patch_crop_scale=(0.5, 1.0))
    selection = score_class(digits, 5, cfg.sized(8, 1), [teacher])
    mosaic = class_patches(digits, 5, cfg, [teacher])
    images = digits.train.load(torch.tensor(selection.ranked[:8]))
    assert torch.equal(mosaic, tile(images, list(selection.boxes[:8]), 8, 2))  # easy: ranks 0-3, then 4-7
    # each cell is one resampling of the real crop, not a resize of a full-size patch
    assert torch.equal(mosaic[1, :, 4:, :4], cut(images[6:7], [selection.boxes[6]], 4)[0])


@pytest.mark.parametrize("selection", ["easy", "medium", "spread", "random", "whole"])
def test_the_mosaic_of_an_ipc_index_does_not_depend_on_the_ipc_or_the_unit(digits, teacher, selection):
    small = class_patches(digits, 3, DistillConfig(ipc=2, patch_selection=selection, mosaic=2), [teacher])
    large = class_patches(digits, 3, DistillConfig(ipc=5, patch_selection=selection, mosaic=2), [teacher])
    assert torch.equal(small, large[:2])
    unit = select_patches(digits, [1, 3], [4], DistillConfig(ipc=5, patch_selection=selection, mosaic=2), [teacher])
    assert torch.equal(unit[0, 1], large[4])


def test_mosaic_cells_split_any_size_as_evenly_as_pixels_allow():
    from fadrm_ray.patches import mosaic_edges, tile

    assert mosaic_edges(32, 2) == [0, 16, 32] and mosaic_edges(32, 3) == [0, 11, 21, 32]
    assert mosaic_edges(28, 3) == [0, 9, 19, 28]
    flat = torch.stack([torch.full((3, 32, 32), 10 * j, dtype=torch.uint8) for j in range(9)])
    stitched = tile(flat, [(0, 0, 32)] * 9, 32, 3)
    assert stitched.shape == (1, 3, 32, 32)
    assert stitched[0, 0, 0, 0] == 0 and stitched[0, 0, 0, 31] == 20 and stitched[0, 0, 31, 31] == 80
    assert stitched[0, 0, 15, 15] == 40 and stitched[0, 0, 10, 11] == 10  # row 0 ends at 11 px, column 1 begins


def test_a_mosaic_too_fine_for_the_images_is_refused_naming_the_field():
    from fadrm_ray.config import ConfigError, make_config

    with pytest.raises(ConfigError, match="mosaic 4 would cut 8-px images into cells of 2 px; at most 2") as err:
        make_config("fadrm", overrides={"mosaic": 4}).resolve(8, 10, channels=1)
    assert err.value.loc == ("mosaic",)
    with pytest.raises(ConfigError, match="mosaic"):
        make_config("fadrm", overrides={"mosaic": 9})
    assert make_config("fadrm", overrides={"mosaic": 8}).resolve(32, 10, channels=3).mosaic == 8


def test_the_starting_patches_of_a_mosaic_run_are_its_mosaics_and_random_real_images_are_not():
    from fadrm_ray.evaluation.baselines import baseline_configs

    run = DistillConfig(ipc=1, mosaic=2, patch_selection="whole").resolve(32, 10, channels=3)
    baselines = baseline_configs(run)
    assert baselines["starting_patches"].mosaic == 2
    assert baselines["random_real"].resolve(32, 10, channels=3).mosaic == 1


def test_a_mosaic_run_starts_from_its_mosaics_recovers_them_and_stores_ordinary_images(digits, digits_teacher,
                                                                                       tmp_path, one_thread):
    from fadrm_ray.config import make_config
    from fadrm_ray.runs import execute
    from fadrm_ray.runs.job import ExecutionSpec, prepare_job
    from fadrm_ray.store import open_run

    spec = ExecutionSpec(local=True, device="cpu", progress=False)
    common = {"ipc": 2, "classes": [0, 1, 2], "mosaic": 2, "precision": "fp32"}

    def distilled(preset, **overrides):
        job, parts = prepare_job(make_config(preset, overrides={**common, **overrides}), digits, "digits",
                                 [digits_teacher[0]], tmp_path / "store", device_type="cpu")
        images, labels, ipc = open_run(execute.run(job, spec, parts).run_dir).read()
        assert images.shape == (6, 1, 8, 8) and images.dtype == torch.uint8
        return images, labels, ipc, job.config

    start, labels, ipc, cfg = distilled("patches")
    expected = select_patches(digits, [0, 1, 2], [0, 1], cfg, [FrozenTeacher(load_teacher(digits_teacher[0])[0])])
    for image, label, i in zip(start, labels.tolist(), ipc.tolist()):
        assert torch.equal(image, expected[i, label])
    recovered, labels2, ipc2, cfg2 = distilled("fadrm", iterations=8, k=1)
    assert cfg2.mosaic == 2 and cfg2.identity()["mosaic"] == 2
    assert torch.equal(labels2, labels) and torch.equal(ipc2, ipc)
    change = (recovered.float() - start.float()).abs()
    assert 0 < change.mean() < 20  # recovered from the mosaics, near them at the small-image step
