"""The pilot: on colour data no one measured, `auto` takes the recipe a bounded measurement chose.

- when a pilot runs and when not (a recipe given, grey data, a dataset with a published recipe,
  a baseline preset);
- every door that builds a job takes the cached choice (`build_job`), and the run records it;
- on generated colour data, `fadrm distill` runs the pilot (its cost said first), keeps what its
  rule (`choose`) keeps, records it in the run and `fadrm info`, and a second run reads it back
  instead of measuring again, in this store or another on the machine;
- the rule and the warning tested on recorded rows (what a small run measures moves with the CPU);
- a choice below random real images is said in one line with the choices, only where the
  pilot's verdict held at full size;
- over its bound the pilot is skipped, saying so.
"""
from __future__ import annotations

import json
import re
import secrets

import pytest
import torch

from fadrm_ray.cli import main
from fadrm_ray.config import make_config
from fadrm_ray.data.base import ImageDataset, Split
from fadrm_ray.pilot_record import PilotRecord, PilotRow, cached_pilot, keep_pilot, pilot_reason
from fadrm_ray.recipes import pilot_candidates
from fadrm_ray.evaluation.scores import PairedGain
from fadrm_ray.config import PilotConfig


def _colour(name: str = "imagefolder:mine", channels: int = 3) -> ImageDataset:
    gen = torch.Generator().manual_seed(0)
    split = Split.in_memory(torch.randint(0, 255, (20, channels, 8, 8), generator=gen, dtype=torch.uint8),
                            torch.arange(20) % 4)
    return ImageDataset(name=name, class_names=[f"c{i}" for i in range(4)], image_size=8, channels=channels,
                        mean=(0.5,) * channels, std=(0.25,) * channels, train=split, test=split)


def test_the_pilot_runs_only_where_auto_would_guess_on_colour_data_no_one_measured():
    auto = make_config("fadrm")
    assert pilot_reason(auto, _colour()) is None
    assert pilot_reason(make_config("fadrm+"), _colour()) is None
    assert "set (cifar)" in pilot_reason(make_config("fadrm", overrides={"recipe": "cifar"}), _colour())
    assert "single-channel" in pilot_reason(auto, _colour(channels=1))
    assert "published" in pilot_reason(auto, _colour("cifar10"))
    assert "published" in pilot_reason(auto, _colour("imagefolder:imagenet"))
    assert "sets its own" in pilot_reason(make_config("random-real"), _colour())
    every = {"lr": 0.1, "crop_scale_min": 0.5, "patch_crop_scale": [1, 1], "patch_crops": 1, "bound": "clamp",
             "iterations": 10, "patch_selection": "easy", "mosaic": 1}
    assert "every value" in pilot_reason(make_config("fadrm", overrides=every), _colour())


def _record(dataset: ImageDataset, teacher_sha: str, chosen: str, gain: float, stderr: float,
            pilot_ipc: int = 2) -> PilotRecord:
    row = PilotRow(recipe=chosen, run_id="r", top1_per_seed=[50.0, 52.0], top1_mean=51.0, seconds=1.0,
                   vs_random=PairedGain(mean=gain, stderr=stderr, higher=1, seeds=2))
    rand = PilotRow(recipe="random-real", run_id="q", top1_per_seed=[50.0, 52.0], top1_mean=51.0, seconds=1.0)
    return PilotRecord(dataset=dataset.name, dataset_fingerprint=dataset.fingerprint(), teachers=(teacher_sha,),
                       ipc=2, settings=PilotConfig(), classes=[0, 1], pilot_ipc=pilot_ipc, rows=[row],
                       random_real=rand, chosen=chosen)


def test_every_job_built_on_that_data_takes_the_cached_choice_and_a_given_recipe_wins(tmp_path):
    from fadrm_ray.teacher_record import TeacherRecord
    from fadrm_ray.runs.job import build_job

    dataset = _colour()
    info = TeacherRecord(model_name="convnet-bn", model_kwargs={}, num_classes=4, in_chans=3, image_size=8,
                       mean=dataset.mean, std=dataset.std, class_names=dataset.class_names, dataset=dataset.name,
                       dataset_fingerprint=dataset.fingerprint(), sha256="ab" * 32, path=str(tmp_path / "t.pt"))
    record = _record(dataset, info.sha256, "gentle", 0.5, 0.4)
    keep_pilot(tmp_path, record)
    assert cached_pilot(tmp_path, dataset.fingerprint(), [info.sha256], 2) == record
    job = build_job(make_config("fadrm", ipc=2), dataset, dataset.name, [info], tmp_path)
    assert job.config.recipe == "gentle" and job.pilot == record
    assert job.config.lr == 0.01 and job.config.patch_selection == "whole"
    other_ipc = build_job(make_config("fadrm", ipc=3), dataset, dataset.name, [info], tmp_path)
    assert other_ipc.config.recipe == "cifar" and other_ipc.pilot is None  # cached per IPC
    given = build_job(make_config("fadrm", ipc=2, overrides={"recipe": "cifar"}), dataset, dataset.name, [info],
                      tmp_path)
    assert given.config.recipe == "cifar" and given.pilot is None
    # The same settings by name give the same run: the pilot's choice is a recipe like any other.
    pinned = build_job(make_config("fadrm", ipc=2, overrides={"recipe": "gentle"}), dataset, dataset.name, [info],
                       tmp_path)
    assert pinned.run_id == job.run_id


def test_a_choice_below_random_real_images_is_said_in_one_line_with_the_choices():
    dataset = _colour()
    level = _record(dataset, "ab" * 32, "whole", -0.3, 0.4, pilot_ipc=1)
    assert level.below_random is None and "pilot chose whole, -0.30 ± 0.40 over random real" in level.summary()
    below = _record(dataset, "ab" * 32, "whole", -3.0, 0.5, pilot_ipc=1)
    line = below.below_random
    assert "no recipe the pilot tried is level with random real images" in line and "\n" not in line
    assert "goes on with whole" in line and "--preset random-real" in line
    # at an IPC where its short students misjudged the sets before, it says it cannot tell
    unsure = _record(dataset, "ab" * 32, "gentle", -3.0, 0.5, pilot_ipc=10)
    assert unsure.below_random is None and "cannot tell whether gentle" in unsure.cannot_tell
    assert "fadrm evaluate" in unsure.cannot_tell and "\n" not in unsure.cannot_tell


# Every pilot whose verdict was checked at full size (docs/benchmarks/accuracy.md, "Is the pilot's
# verdict right?"): (dataset, pilot IPC, the pilot's gain of its choice over random real images and
# its standard error, the full-size gain of that choice); the IPC 1 pilots with the candidates of
# before (they kept `gentle`) and of now (they keep `mosaic`).
CHECKED = [("pairs10", 10, 2.83, 5.83, 4.06), ("pairs10", 1, -2.61, 1.16, -4.11),
           ("clipart10", 10, -0.68, 1.43, 2.90), ("clipart10", 1, -0.91, 0.30, -2.61),
           ("an unseen colour set", 10, -1.85, 0.89, 4.1),
           ("pairs10, mosaic", 1, 0.72, 0.75, 13.44), ("clipart10, mosaic", 1, 3.69, 2.36, -0.51)]


def test_the_pilot_warns_only_where_its_verdict_held_at_full_size():
    """On the recorded rows (no training here: the rule, not a small run's noise): no warning where
    the full-size gain is above random real images; a warning wherever it fires, right."""
    dataset = _colour()
    for name, ipc, gain, stderr, full in CHECKED:
        record = _record(dataset, "ab" * 32, "gentle", gain, stderr, pilot_ipc=ipc)
        if full > 0:
            assert record.below_random is None, name
        if record.below_random is not None:
            assert full < 0, name
        assert (record.cannot_tell is not None) == (gain < 0 and ipc > 1), name
    fired = [c for c in CHECKED if _record(dataset, "ab" * 32, "gentle", c[2], c[3], pilot_ipc=c[1]).below_random]
    assert [(c[0], c[1]) for c in fired] == [("pairs10", 1), ("clipart10", 1)]


def test_the_pilot_keeps_the_gentle_recipe_unless_another_is_clearly_above_it():
    from fadrm_ray.pilot import choose

    def row(recipe, seeds):
        return PilotRow(recipe=recipe, run_id=recipe, top1_per_seed=seeds, top1_mean=sum(seeds) / len(seeds),
                        seconds=1.0)

    gentle = row("gentle", [80.0, 81.0, 79.0])
    assert choose([row("cifar", [60.0, 61.0, 59.5]), row("whole", [81.0, 80.5, 79.2]), gentle], "gentle") == "gentle"
    assert choose([row("whole", [90.0, 91.0, 89.5]), gentle], "gentle") == "whole"  # above it on every seed, by far
    assert choose([row("cifar", [50.0, 40.0, 45.0])], "gentle") == "cifar"  # no gentle row: the best


FRAME_COLOURS = [(200, 40, 40), (40, 170, 40), (40, 40, 200), (200, 190, 30)]


def _frames(root, per_class: int, test_per_class: int, size: int = 16):
    """Colour images whose class is the colour of a 2-px frame around random clutter: a whole
    image shows it, a crop of its middle does not (where crops lose to random real images)."""
    import numpy as np
    from PIL import Image, ImageDraw

    for split, count, offset in (("train", per_class, 0), ("val", test_per_class, 1)):
        for label, colour in enumerate(FRAME_COLOURS):
            rng = np.random.default_rng([offset, label])
            folder = root / split / f"frame{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(0, 256, 3)))
                pen = ImageDraw.Draw(image)
                for _ in range(4):
                    x, y = (int(v) for v in rng.integers(0, size - 4, 2))
                    w, h = (int(v) for v in rng.integers(2, 6, 2))
                    pen.rectangle((x, y, x + w, y + h), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
                pen.rectangle((0, 0, size - 1, size - 1), outline=colour, width=2)
                pixels = np.asarray(image, np.float32) + rng.normal(0, 8, (size, size, 3))
                Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


# The smallest pilot its rules allow: a few recover iterations per candidate, the shortest students,
# two paired seeds.
PILOT_FLAGS = ["--pilot-set", "recover_share=0.01", "--pilot-set", "student_steps=50", "--pilot-set", "seeds=2"]


def test_the_pilot_is_measured_once_kept_and_every_later_run_reads_it(tmp_path, capsys, one_thread):
    from fadrm_ray.estimate import seconds_text
    from fadrm_ray.store import open_run

    data = f"imagefolder:{_frames(tmp_path / 'frames', 30, 8)}"
    assert main(["squeeze", "--dataset", data, "--epochs", "4", "--set", "cutmix_prob=0", "--set", "batch_size=32",
                 "--out", str(tmp_path / "t"), "--quiet"]) == 0
    teacher, store = str(tmp_path / "t" / "teacher.pt"), str(tmp_path / "store")
    distill = ["distill", "--local", "--dataset", data, "--teacher", teacher, "--ipc", "2", "--set", "iterations=8",
               "--out", store, "--quiet", "--json", *PILOT_FLAGS]
    capsys.readouterr()
    assert main(distill) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if "pilot" in line]
    # Its cost first, as a share of the run it sizes, and the run's own estimate at each recipe.
    assert "beside random real images on 4 classes at IPC 2" in notes[0] and " s here, " in notes[0]
    assert re.search(r" s here, (\d+% of|[\d.]+x) this run's estimated [\d.]+ s at recipe cifar \([\d.]+ s at "
                     r"crops-random, [\d.]+ s at whole, [\d.]+ s at gentle\)", notes[0]), notes[0]
    said = json.loads(out)
    record = PilotRecord.model_validate(said["pilot"]["record"])
    # The run's estimate at the recipe chosen, said before it starts and kept beside its time.
    assert set(record.run_estimates) == {"cifar", "crops-random", "whole", "gentle"}
    factor = record.seconds / record.estimated_seconds  # as the pilot's own sets took against their estimates
    assert said["estimated_seconds"] == pytest.approx(record.run_estimates[record.chosen] * factor)
    assert f"this run: about {seconds_text(said['estimated_seconds'])} at recipe {record.chosen}, from its steps " \
           f"timed on this machine ({record.run_estimates[record.chosen]:.1f} s), times {factor:.2f}" in err
    rows = {row.recipe: row for row in record.rows}
    assert list(rows) == ["cifar", *pilot_candidates(2).recipes]
    # What it chose follows its rule from what it measured (the measurements themselves move with
    # the CPU's arithmetic: no test here asserts a small run's accuracy within its noise).
    from fadrm_ray.pilot import choose

    assert record.chosen == choose(record.rows, pilot_candidates(2).safe)
    assert all(row.vs_random is not None and row.vs_random.seeds == 2 for row in record.rows)
    assert record.below_random is None  # pilot IPC 2: above the IPC where its verdict was checked
    assert said["recipe"].startswith(f"{record.chosen}, auto's choice for this data by its pilot")
    reader = open_run(said["run_dir"])
    assert reader.config.recipe == record.chosen
    assert PilotRecord.model_validate(reader.provenance.pilot) == record
    assert main(["info", "--run", said["run_dir"], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["pilot"] == record.summary() and "by its pilot" in shown["recipe"]
    # A second run of that data, teachers and IPC reads the pilot back: nothing is measured again.
    assert main(distill) == 0
    out, err = capsys.readouterr()
    assert "measured before" in err and json.loads(out)["run_dir"] == said["run_dir"]
    # So does a run into another store on this machine (a sweep's, the service's).
    other = [str(tmp_path / "store2") if a == store else a for a in distill]
    assert main(other) == 0
    out, err = capsys.readouterr()
    assert "measured before" in err and "pilots" in err
    assert PilotRecord.model_validate(json.loads(out)["pilot"]["record"]) == record
    assert not list((tmp_path / "store2" / ".pilots").glob("*/config.yaml"))  # no set distilled there
    assert {row.images for row in [*record.rows, record.random_real]} == {8}
    # A pilot at IPC 1 in the same store reads its sets at IPC 1, though the runs hold IPC 2 already.
    one = ["--ipc" if a == "--ipc" else ("1" if prev == "--ipc" else a) for prev, a in zip(["", *distill], distill)]
    assert main(one) == 0
    small = PilotRecord.model_validate(json.loads(capsys.readouterr()[0])["pilot"]["record"])
    assert small.pilot_ipc == 1 and {row.images for row in [*small.rows, small.random_real]} == {4}
    # A recipe named skips it.
    assert main([*distill, "--set", "recipe=cifar"]) == 0
    out, err = capsys.readouterr()
    assert "pilot" not in err and "pilot" not in json.loads(out)


def test_over_its_bound_the_pilot_is_skipped_and_says_so(tmp_path, capsys, one_thread):
    data = f"imagefolder:{_frames(tmp_path / 'frames', 6, 4)}"
    assert main(["squeeze", "--dataset", data, "--epochs", "1", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["distill", "--local", "--dataset", data, "--teacher", str(tmp_path / "t" / "teacher.pt"), "--ipc",
                 "1", "--set", "iterations=4", "--out", str(tmp_path / "store"), "--quiet", "--pilot-set",
                 "free_seconds=0", "--pilot-set", "max_share=0.001"]) == 0
    out, err = capsys.readouterr()
    assert "pilot skipped: it would take about" in err and "more than its bound" in err
    assert "recipe: cifar" in out
    assert not (tmp_path / "store" / ".pilots").exists() or not list((tmp_path / "store" / ".pilots").glob("*.json"))


def test_the_service_takes_the_stores_pilot_and_says_so_or_says_none_was_measured(tmp_path, capsys, one_thread):
    from api.contract.schemas import DistillationRequest
    from api.planning.catalog import Catalog
    from api.planning.requests import plan_request
    from api.planning.service_settings import ServiceSettings

    data = _frames(tmp_path / "frames", 6, 4)
    assert main(["squeeze", "--dataset", f"imagefolder:{data}", "--epochs", "1", "--out", str(tmp_path / "t"),
                 "--quiet"]) == 0
    (tmp_path / "teachers").mkdir()
    (tmp_path / "t" / "teacher.pt").rename(tmp_path / "teachers" / "frames-net.pt")
    (tmp_path / "datasets.yaml").write_text(f"frames: imagefolder:{data}\n")
    settings = ServiceSettings(api_token=secrets.token_urlsafe(32), store=tmp_path / "store", teachers=tmp_path / "teachers",
                               datasets=tmp_path / "datasets.yaml")
    catalog = Catalog(settings.teachers, settings.datasets)
    request = DistillationRequest(dataset="frames", teacher="frames-net", classes=[0, 1], ipc=2)
    plan = plan_request(request, catalog, settings.limits, settings.store, settings.device)
    note, warnings = plan.recipe_notes
    assert plan.job.config.recipe == "cifar" and warnings == []
    assert note.startswith("no pilot has measured the recipes on frames") and "fadrm distill" in note
    dataset = catalog.dataset("frames")
    keep_pilot(settings.store, _record(dataset, catalog.teacher("frames-net").info.sha256, "whole", -3.0, 0.5,
                                         pilot_ipc=1))
    plan = plan_request(request, catalog, settings.limits, settings.store, settings.device)
    note, warnings = plan.recipe_notes
    assert plan.job.config.recipe == "whole" and note.startswith("pilot chose whole")
    assert len(warnings) == 1 and "no recipe the pilot tried is level with random real images" in warnings[0]


def test_a_sweep_fixes_the_stores_pilot_choice_in_every_trial_unless_it_sweeps_the_recipe(tmp_path, capsys,
                                                                                          one_thread):
    from fadrm_ray.models import load_teacher
    from tune.space import trial_config
    from tune.prepare import prepare, with_pilot
    from tune.request import SweepRequest

    data = _frames(tmp_path / "frames", 6, 4)
    assert main(["squeeze", "--dataset", f"imagefolder:{data}", "--epochs", "1", "--out", str(tmp_path / "t"),
                 "--quiet"]) == 0
    teacher = tmp_path / "t" / "teacher.pt"
    request = SweepRequest(dataset=f"imagefolder:{data}", teachers=[str(teacher)], out=str(tmp_path / "sweep"),
                           ipc=2, params=["alpha=0.3,0.5"])
    prepared = prepare(request)
    dataset = prepared.dataset
    keep_pilot(prepared.store, _record(dataset, load_teacher(teacher)[1].sha256, "gentle", 0.4, 0.3))
    capsys.readouterr()
    fixed, pilot = with_pilot(prepared)
    assert pilot.chosen == "gentle" and "measured before" in capsys.readouterr().err
    assert trial_config(fixed.base, {"alpha": 0.3}).recipe == "gentle"
    swept = prepare(request.model_copy(update={"params": ["recipe=cifar,gentle"]}))
    assert with_pilot(swept) == (swept, None)


def test_the_pilot_keeps_the_best_only_where_it_is_clearly_above_the_gentle_recovery():
    from fadrm_ray.pilot import choose

    def row(recipe, *top1):
        return PilotRow(recipe=recipe, run_id=recipe, top1_per_seed=list(top1), top1_mean=sum(top1) / len(top1),
                        seconds=1.0)

    gentle = row("gentle", 81.2, 73.5, 86.2)
    # The best by its mean, within the seeds' noise of the gentle one: the gentle one.
    assert choose([row("cifar", 63.5, 59.5, 59.2), row("whole", 82.2, 84.5, 75.8), gentle], "gentle") == "gentle"
    # Clearly above it on every seed: the best.
    assert choose([row("cifar", 90.0, 84.0, 95.0), row("whole", 82.2, 84.5, 75.8), gentle], "gentle") == "cifar"
    assert choose([row("cifar", 60.0, 61.0, 62.0), row("whole", 70.0, 70.5, 71.0)], "gentle") == "whole"  # no gentle


def test_each_ipc_has_its_candidates_and_its_safe_recipe():
    from fadrm_ray.pilot import candidates, choose
    from fadrm_ray.recipes import PILOT_CANDIDATES, RECIPES

    for entry in PILOT_CANDIDATES:
        assert entry.safe in entry.recipes and all(r in RECIPES for r in entry.recipes)
    assert PILOT_CANDIDATES[-1].up_to_ipc is None  # every IPC has its entry
    assert pilot_candidates(1).safe == "mosaic" and pilot_candidates(10).safe == "gentle"
    assert candidates(32, 3, 1)[0] == "cifar" and candidates(96, 3, 50)[0] == "tiny-imagenet"
    # From IPC 2, the pilot whose verdicts were checked at IPC 10 (accuracy.md), unchanged.
    assert candidates(32, 3, 10) == ["cifar", "crops-random", "whole", "gentle"] == candidates(32, 3, 2)

    def row(recipe, *top1):
        return PilotRow(recipe=recipe, run_id=recipe, top1_per_seed=list(top1), top1_mean=sum(top1) / len(top1),
                        seconds=1.0)

    # At IPC 1 the mosaics stay unless another recipe is clearly above them.
    rows = [row("cifar", 41.0, 44.0, 40.0), row("gentle", 42.0, 43.5, 44.0), row("mosaic", 43.0, 40.0, 42.5)]
    assert choose(rows, pilot_candidates(1).safe) == "mosaic"
    assert choose(rows, pilot_candidates(10).safe) == "gentle"
