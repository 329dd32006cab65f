"""Run identity: what changes the images names the run; a run grows to a larger IPC and serves
smaller ones (docs/architecture.md, "Reusing a run")."""
import json

import pytest
import torch

from fadrm_ray.cli import main
from fadrm_ray.config import make_config
from fadrm_ray.runs import execute
from fadrm_ray.runs.job import ExecutionSpec, make_run_id, prepare_job
from fadrm_ray.runs.units import Unit
from fadrm_ray.layout import RunLayout
from fadrm_ray.store import StoreError, export_tensors, open_run

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"iterations": 6, "k": 1, "precision": "fp32"}


def distill(digits, teacher, root, **overrides):
    spec = ExecutionSpec(local=True, device="cpu", progress=False)
    job, parts = prepare_job(make_config("fadrm", overrides={**SMALL, **overrides}), digits, "digits", [teacher], root,
                             device_type=execute.device_type(spec))
    return execute.run(job, spec, parts)


def per_shard_indices(unit_ids) -> list[int]:
    """The IPC indices the given units computed (one shard here)."""
    return sorted(i for u in unit_ids for i in range(*Unit.parse_id(u)[1:]))


def test_a_speed_setting_resumes_the_same_run(digits, digits_teacher, tmp_path):
    teacher = digits_teacher[0]
    first = distill(digits, teacher, tmp_path, ipc=2, pack=1, ipc_per_unit=1)
    again = distill(digits, teacher, tmp_path, ipc=2, pack=2, ipc_per_unit=2, channels_last=False)
    assert again.run_id == first.run_id and again.units_run == [] and len(again.units_skipped) == 2
    cfg = make_config("fadrm", overrides=SMALL).resolve(8, 10, False, channels=1)
    same = [cfg.model_copy(update=u) for u in ({"compile": True}, {"pack": 7}, {"ipc": 30}, {"ipc_per_unit": 3})]
    other = [cfg.model_copy(update=u) for u in ({"alpha": 0.6}, {"seed": 1}, {"precision": "bf16"},
                                               {"classes_per_batch": 5}, {"classes": [0, 1]}, {"bound": "clamp"})]
    ids = {make_run_id(c, "data", ["t"]) for c in same}
    assert ids == {make_run_id(cfg, "data", ["t"])}
    assert not ids & {make_run_id(c, "data", ["t"]) for c in other}
    # A field added later is left out of the id at the value that gives the older runs' images.
    assert cfg.identity()["bound"] == "sigmoid" and "bound" not in cfg.model_copy(update={"bound": "clamp"}).identity()


def test_a_run_grows_from_ipc_10_to_20_and_serves_ipc_5_without_recomputing(digits, digits_teacher, tmp_path):
    teacher = digits_teacher[0]
    ten = distill(digits, teacher, tmp_path / "store", ipc=10)
    before, labels, ipcs = open_run(ten.run_dir).read()
    assert per_shard_indices(ten.units_run) == list(range(10))

    twenty = distill(digits, teacher, tmp_path / "store", ipc=20)
    assert twenty.run_id == ten.run_id and twenty.images == 200 and twenty.ipc == 20
    assert per_shard_indices(twenty.units_run) == list(range(10, 20))  # only the 10 new IPC indices per class
    images, labels, ipcs = open_run(twenty.run_dir).read()
    assert images.shape[0] == 200
    assert torch.equal(images[ipcs < 10], before)  # the first ten are the ones distilled before

    five = distill(digits, teacher, tmp_path / "store", ipc=5)
    assert five.run_id == ten.run_id and five.units_run == [] and five.images == 50
    view = open_run(five.run_dir, ipc=5)
    small, small_labels, small_ipcs = view.read()
    assert small_ipcs.max() == 4 and small.shape[0] == 50
    assert torch.equal(small, images[ipcs < 5]) and torch.equal(small_labels, labels[ipcs < 5])
    info = view.info()
    assert info["rows"] == 50 and set(info["images_per_class"].values()) == {5} and info["ipc"] == 5
    assert view.content_hash() != open_run(five.run_dir).content_hash()
    assert open_run(five.run_dir, ipc=10).content_hash() == open_run(five.run_dir, ipc=10).content_hash()

    # the grown run holds what a fresh IPC 20 run would
    fresh = distill(digits, teacher, tmp_path / "fresh", ipc=20)
    assert torch.equal(open_run(fresh.run_dir).read()[0], images)
    # exports and evaluation read the run at the IPC asked for
    assert export_tensors(five.run_dir, tmp_path / "five.pt", ipc=5) == 50
    with pytest.raises(StoreError, match="ipc must be"):
        open_run(five.run_dir, ipc=0)


def test_packed_and_unpacked_runs_through_fadrm_distill_give_the_same_images(digits_teacher, tmp_path, capsys):
    def run(store, *sets):
        argv = ["distill", "--local", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--ipc", "4",
                "--set", "iterations=8", "--set", "k=1", "--set", "precision=fp32", "--threads", "1",
                "--out", str(store), "--json", "--quiet"]
        for item in sets:
            argv += ["--set", item]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    auto = run(tmp_path / "auto")
    plain = run(tmp_path / "plain", "pack=1", "ipc_per_unit=1")
    assert auto["run_id"] == plain["run_id"] and len(auto["units_run"]) == 1 and len(plain["units_run"]) == 4
    a = open_run(auto["run_dir"]).read()
    b = open_run(plain["run_dir"]).read()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_scored_patches_are_kept_in_the_run_and_not_scored_again(digits, digits_teacher, tmp_path):
    teacher = digits_teacher[0]
    first = distill(digits, teacher, tmp_path, ipc=2, classes=[1, 4])
    layout = RunLayout(first.run_dir)
    assert [layout.patch_selection(c).is_file() for c in (1, 4, 5)] == [True, True, False]
    manifest = json.loads(layout.manifest.read_text())
    assert manifest["summary"]["patches_scored"] == 2
    grown = distill(digits, teacher, tmp_path, ipc=3, classes=[1, 4])
    manifest = json.loads(layout.manifest.read_text())
    assert grown.units_run and manifest["summary"]["patches_scored"] == 0  # read from the run
