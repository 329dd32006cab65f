"""What is read is verified: a damaged run is refused on every read path, naming the file, and
`fadrm verify --repair` recomputes it; an unfinished run is read only when asked for; reports
say when they no longer describe the run."""
import json
import shutil

import pytest
import torch

from fadrm_ray.cli import main
from fadrm_ray.layout import RunLayout
from fadrm_ray.store import RunStore, open_run
from fadrm_ray.store import ImageRecord, StoreError
from bench import fault_inject


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def read_paths(run, out):
    """Every way the CLI reads a run's images, as argv lists."""
    return {
        "info": ["info", "--run", run],
        "export imagefolder": ["export", "--run", run, "--format", "imagefolder", "--out", out / "folder"],
        "export pt": ["export", "--run", run, "--format", "pt", "--out", out / "images.pt"],
        "evaluate": ["evaluate", "--run", run, "--epochs", "1", "--seeds", "1", "--no-baselines", "--quiet",
                     "--threads", "1"],
    }


@pytest.mark.parametrize("fault", ["replace_png", "swap_rows", "flip_png_bit", "truncate_part", "zero_unit_sha",
                                   "delete_unit_manifest", "delete_part"])
def test_every_read_path_refuses_a_damaged_run_and_names_the_file(run_copy, fault, tmp_path, capsys):
    damaged = getattr(fault_inject, fault)(run_copy)
    out = tmp_path / "out"
    for path, argv in read_paths(run_copy, out).items():
        code, _, err = run_cli(capsys, *argv)
        line = one_line(err)
        assert code == 2 and str(damaged) in line and "--repair" in line, (path, line)
    assert not out.exists()  # nothing was exported
    assert not RunLayout(run_copy).report_dir.exists()  # nothing was trained on
    with pytest.raises(StoreError, match=str(run_copy)):
        open_run(run_copy).read()


def test_a_damaged_part_is_named_even_where_nothing_else_is_read(run_copy, tmp_path):
    part = fault_inject.replace_png(run_copy, label=3)
    reader = open_run(run_copy)
    with pytest.raises(StoreError, match=str(part)):
        reader.read(classes=[3])
    with pytest.raises(StoreError, match=str(part)):
        reader.records()
    assert reader.read(classes=[0])[0].shape[0] == 3  # the parts that match are still readable


def test_a_bare_copy_names_the_file_and_row_of_an_image_that_does_not_decode(run_copy, tmp_path, capsys):
    copy = tmp_path / "bare"
    for part in RunLayout(run_copy).parts_on_disk():
        target = copy / part.parent.name / part.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(part, target)
    damaged = fault_inject.flip_png_bit(copy)
    with pytest.raises(StoreError, match=f"{damaged} row 0"):
        open_run(copy, incomplete=True).read()
    code, _, err = run_cli(capsys, "export", "--run", copy, "--incomplete", "--out", tmp_path / "folder")
    assert code == 2 and f"{damaged} row 0" in err and not (tmp_path / "folder").exists()


def test_verify_finds_the_unit_and_repair_recomputes_it_bit_identical(run_copy, small_run, capsys):
    expected = open_run(small_run).read()
    fault_inject.replace_png(run_copy, label=3)
    fault_inject.delete_unit_manifest(run_copy, index=-1)  # a second unit, damaged another way
    code, out, _ = run_cli(capsys, "verify", "--run", run_copy, "--json")
    check = json.loads(out)
    assert code == 1 and not check["ok"] and len(check["bad_units"]) == 2
    code, out, err = run_cli(capsys, "verify", "--run", run_copy, "--repair", "--json", "--quiet")
    assert code == 0, err
    assert sorted(json.loads(out)["repaired"]) == check["bad_units"] and json.loads(out)["ok"]
    again = open_run(run_copy).read()
    assert all(torch.equal(a, b) for a, b in zip(again, expected))


def test_an_unfinished_run_is_read_only_when_asked_for(run_copy, tmp_path, capsys):
    RunLayout(run_copy).manifest.unlink()
    for argv in (read_paths(run_copy, tmp_path)["export pt"], read_paths(run_copy, tmp_path)["evaluate"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and "incomplete" in one_line(err) and "--incomplete" in err
    with pytest.raises(ValueError, match="incomplete"):
        open_run(run_copy)
    code, out, err = run_cli(capsys, *read_paths(run_copy, tmp_path)["export pt"], "--incomplete", "--json")
    assert code == 0 and "warning" in err and "incomplete" in err and json.loads(out)["complete"] is False
    code, out, _ = run_cli(capsys, "info", "--run", run_copy, "--json")
    assert code == 0 and json.loads(out)["complete"] is False


def test_reports_are_tied_to_the_data_they_describe(run_copy, capsys):
    code, out, err = run_cli(capsys, *read_paths(run_copy, run_copy)["evaluate"], "--json")
    assert code == 0, err
    evaluation = json.loads(out)
    assert evaluation["content_hash"] == open_run(run_copy).content_hash()
    code, out, _ = run_cli(capsys, "info", "--run", run_copy, "--json")
    assert json.loads(out)["report_stale"] == {}

    # A rerun rewrites a unit with other images (as when it repairs one): the report is stale.
    layout = RunLayout(run_copy)
    uid = layout.unit_ids()[0]
    store = RunStore(run_copy.parent, run_copy.name)
    images, labels, ipcs = open_run(run_copy).read()
    unit = json.loads(layout.unit(uid).read_text())
    rows = [ImageRecord(int(lab), int(ipc), 255 - img) for img, lab, ipc in zip(images, labels, ipcs)
            if any(int(ipc) in range(f["ipc_start"], f["ipc_end"]) for f in unit["files"])]
    store.write_unit(uid, rows, open_run(run_copy).class_names, open_run(run_copy).provenance, unit["stats"])
    store.finalize({})
    code, out, _ = run_cli(capsys, "info", "--run", run_copy, "--json")
    stale = json.loads(out)["report_stale"]
    assert code == 0 and set(stale) == {"grid", "losses", "evaluation", "evaluation_plot"}
    code, out, _ = run_cli(capsys, "verify", "--run", run_copy)
    assert code == 0 and "rerun `fadrm evaluate`" in out

    code, _, err = run_cli(capsys, *read_paths(run_copy, run_copy)["evaluate"])
    assert code == 0, err
    code, out, _ = run_cli(capsys, "info", "--run", run_copy, "--json")
    assert json.loads(out)["report_stale"] == {}
