"""`fadrm verify` reads every file a run holds, not only its units: stored soft labels (each epoch
against the sha256 its folder recorded), the run's own files (config, ledger, patches) and the
evaluation's (cached evaluations, the report); `--repair` mends what it can (soft labels
recomputed from the teacher, the same labels again) and says what it cannot."""
import json

import pyarrow.parquet as pq

from fadrm_ray.cli import main
from fadrm_ray.config import LabelStorage
from fadrm_ray.evaluation.relabel import AugmentSpec, OnlineSoftLabels, SoftLabeler
from fadrm_ray.evaluation.soft_labels import precompute_soft_labels
from fadrm_ray.layout import RunLayout
from fadrm_ray.store import open_run


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def flip(path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def stored_labels(run, teacher, epochs: int):
    """Soft labels of `epochs` epochs of the run's images, stored in the run as an evaluation stores them."""
    images = open_run(run).read()[0]
    source = OnlineSoftLabels(images, SoftLabeler.from_paths([teacher]), AugmentSpec(out_size=8), images.shape[0], 0)
    return precompute_soft_labels(source, epochs, RunLayout(run).soft_labels, LabelStorage(topk=3))


def test_a_damaged_soft_label_epoch_is_found_and_recomputed_the_same(run_copy, digits_teacher, capsys, one_thread):
    folder = stored_labels(run_copy, digits_teacher[0], 300)
    epoch = folder / "epoch=00299.parquet"
    original = pq.read_table(epoch)
    flip(epoch)
    name = f"soft_labels/{folder.name}/epoch=00299.parquet"
    code, out, _ = run_cli(capsys, "verify", "--run", run_copy)
    assert code == 1 and f"{name}: its sha256 differs" in out and "FAILED: 1 other file(s)" in out, out
    code, out, err = run_cli(capsys, "verify", "--run", run_copy, "--repair", "--json", "--quiet")
    assert code == 0, out + err
    assert json.loads(out)["mended"] == [name] and json.loads(out)["ok"]
    assert pq.read_table(epoch).equals(original)  # the teacher's labels of that epoch, again
    assert run_cli(capsys, "verify", "--run", run_copy)[0] == 0


def test_what_repair_cannot_recompute_it_names(run_copy, digits_teacher, capsys, one_thread):
    folder = stored_labels(run_copy, digits_teacher[0], 2)
    (folder / "meta.json").write_text("{not json")
    code, out, _ = run_cli(capsys, "verify", "--run", run_copy, "--repair")
    assert code == 1
    assert f"soft_labels/{folder.name}/meta.json: does not read" in out and f"remove soft_labels/{folder.name}" in out
    assert "not soft_labels/" in out.splitlines()[-1], out  # the FAILED line names what was left


def test_the_runs_own_files_are_read_and_mended(run_copy, capsys):
    layout = RunLayout(run_copy)
    with open(layout.ledger, "ab") as f:
        f.write(b"\x00\x17garbage\n")
    layout.config.write_text("ipc: [unclosed\n")
    code, out, _ = run_cli(capsys, "verify", "--run", run_copy, "--json")
    check = json.loads(out)
    assert code == 1 and set(check["files"]) == {"config.yaml", "ledger.jsonl"} and not check["bad_units"]
    assert "1 of its" in check["files"]["ledger.jsonl"]["problem"]
    code, out, err = run_cli(capsys, "verify", "--run", run_copy, "--repair", "--json", "--quiet")
    assert code == 0 and sorted(json.loads(out)["mended"]) == ["config.yaml", "ledger.jsonl"], out + err
    assert open_run(run_copy).config is not None and b"garbage" not in layout.ledger.read_bytes()


def test_a_mend_that_fails_is_not_offered_again(run_copy, digits_teacher, capsys, one_thread):
    """Labels of images no evaluation of the run records cannot be recomputed: the FAILED line
    names the file as left (with why), never `--repair` as what mends it."""
    images = open_run(run_copy).read()[0][:4]
    source = OnlineSoftLabels(images, SoftLabeler.from_paths([digits_teacher[0]]), AugmentSpec(out_size=8), 4, 0)
    folder = precompute_soft_labels(source, 2, RunLayout(run_copy).soft_labels, LabelStorage(topk=3))
    flip(folder / "epoch=00001.parquet")
    name = f"soft_labels/{folder.name}/epoch=00001.parquet"
    code, out, _ = run_cli(capsys, "verify", "--run", run_copy, "--repair")
    assert code == 1
    assert f"could not mend soft_labels/{folder.name}: " in out, out
    assert out.splitlines()[-1].endswith(f"not {name} (see above)"), out
    code, out, _ = run_cli(capsys, "verify", "--run", run_copy, "--repair", "--json", "--quiet")
    problem = json.loads(out)["files"][name]
    assert not problem["mended"] and "cannot be recomputed" in problem["remedy"], problem
