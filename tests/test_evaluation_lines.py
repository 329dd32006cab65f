"""What an evaluation says beside its top-1, and that each line is true: DD-Ranking's full-data
reference says its cost first, keeps to a step budget (the teachers' recorded top-1 stands in
beyond it) and never loads a whole training split; the hard-label line says what is so in both
directions; a weak teacher is named the weak part; a baseline of the same images as another is
reported once."""
from __future__ import annotations

import json

import pytest

from fadrm_ray.cli import main
from tests.folder_helpers import colour_folder, tiny_run


def _loads_at_most(split):
    """The split, recording how many images each call of its loader asked for."""
    asked: list[int] = []
    load = split.load

    def counted(indices):
        asked.append(len(indices))
        return load(indices)

    split.load = counted
    return asked


def test_the_full_data_reference_says_its_cost_streams_its_split_and_keeps_to_its_budget(digits, tmp_path, one_thread,
                                                                                         monkeypatch):
    from dataclasses import replace

    from fadrm_ray.evaluation import ranking
    from fadrm_ray.evaluation.ranking import FULL_DATA_BATCH, full_data_student
    from fadrm_ray.config import EvalConfig

    monkeypatch.setattr(ranking, "FULL_DATA_STEPS", 40)  # a short reference student: still over 10 steps

    train = replace(digits.train)
    asked = _loads_at_most(train)
    data = replace(digits, train=train)
    notes: list[str] = []
    cfg = EvalConfig(epochs=2, seeds=1)
    # Over the budget: nothing trains, the teachers' recorded top-1 stands in, and it says so.
    ref = full_data_student(data, cfg.model_copy(update={"reference_steps": 10}), tmp_path / "refs",
                            teacher_top1=[91.5, 88.0], on_note=notes.append)
    assert ref.top1 == 91.5 and ref.source.startswith("the teacher's recorded test top-1") and not asked
    assert "over the budget of 10 steps" in notes[-1] and "91.50%" in notes[-1]
    with pytest.raises(ValueError, match="no teacher records a test top-1"):
        full_data_student(data, cfg.model_copy(update={"reference_steps": 10}), tmp_path / "refs", teacher_top1=[])
    # Within it: the cost is said first, then the student trains on batches, never the whole split.
    ref = full_data_student(data, cfg, tmp_path / "refs", on_note=notes.append)
    assert "DD-Ranking's full-data reference: a convnet-bn trained with hard labels" in notes[-1]
    assert "--no-ranking skips it" in notes[-1] and ref.source.endswith(f"(kept in {tmp_path / 'refs'})")
    assert asked and max(asked) <= 2 * FULL_DATA_BATCH < len(train)
    # Kept: asked again, nothing trains and nothing is said.
    before = (len(asked), len(notes))
    assert full_data_student(data, cfg, tmp_path / "refs", on_note=notes.append).top1 == ref.top1
    assert (len(asked), len(notes)) == before


def test_the_hard_label_line_says_what_is_so_in_both_directions():
    from fadrm_ray.evaluation.ranking import hard_label_line
    from fadrm_ray.evaluation.scores import Ranking

    below = hard_label_line(Ranking(hard_top1_per_seed=[40.0, 42.0]), soft_top1=60.0)
    assert "19.00 points below the soft-label top-1" in below and "need the teacher's soft labels" in below
    above = hard_label_line(Ranking(hard_top1_per_seed=[100.0]), soft_top1=60.0)
    assert "40.00 points at or above" in above and "need the teacher" not in above
    assert hard_label_line(Ranking(), soft_top1=60.0) is None


def test_a_teacher_well_below_the_full_data_student_is_named_the_weak_part():
    from fadrm_ray.evaluation.baselines import weak_teacher
    from fadrm_ray.evaluation.ranking import TEACHERS_RECORD
    from fadrm_ray.evaluation.scores import Ranking

    from fadrm_ray.teacher_record import ImportRecord, TeacherRecord

    squeezed = TeacherRecord(model_name="convnet-bn", test_accuracy=67.5, squeeze_config={"epochs": 20})
    line = weak_teacher(Ranking(full_hard_top1=93.5), [squeezed])
    assert "the teacher is the weak part" in line and "26.0 points below" in line
    assert "(`fadrm squeeze --epochs 80`)" in line  # four times its own 20 epochs
    # Imported: the remedy is where its weights came from, not squeeze.
    imported = TeacherRecord(model_name="timm:resnet18", test_accuracy=67.5, imported=ImportRecord(
        source="file /w/sprites.safetensors", normalization="flags", eval_images=100, chance=10.0))
    line = weak_teacher(Ranking(full_hard_top1=93.5), [imported])
    assert "squeeze" not in line and "trained elsewhere (file /w/sprites.safetensors)" in line
    assert "`fadrm import-teacher --model timm:resnet18 --weights FILE`" in line
    assert weak_teacher(Ranking(full_hard_top1=93.5), [squeezed.model_copy(update={"test_accuracy": 90.0})]) is None
    assert weak_teacher(Ranking(full_hard_top1=93.5, full_source=TEACHERS_RECORD), [squeezed]) is None
    assert weak_teacher(Ranking(), [squeezed]) is None and weak_teacher(None, [squeezed]) is None


def test_a_baseline_of_the_same_images_as_another_is_reported_once(tmp_path, capsys, one_thread):
    """Under the gentle recipe the starting patches are random whole images: random real images,
    byte for byte. One row, one set of students."""
    data = colour_folder(tmp_path / "c", 3, per_class=6)
    run_dir = tiny_run(data, tmp_path, capsys, "gentle")
    assert main(["evaluate", "--run", run_dir, "--seeds", "2", "--epochs", "1", "--no-ranking", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "its starting patches: the same images as random real images" in out
    assert main(["evaluate", "--run", run_dir, "--seeds", "2", "--epochs", "1", "--no-ranking", "--quiet",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["baselines"]["starting_patches"]["same_as"] == "random_real"
    assert set(result["paired_gains"]) == {"random_real"}
    from fadrm_ray.store import open_run

    random_dir = result["baselines"]["random_real"]["run_dir"]
    assert list(open_run(random_dir).layout.evaluations_dir.glob("*.json"))  # its students are kept there
    # Known from the configs: the starting patches are never distilled, and name the run that holds them.
    assert result["baselines"]["starting_patches"]["run_dir"] == random_dir
    assert not list((tmp_path / "store").glob("patches-*"))
