"""Refuse what would destroy data, fail in one clear line before any work, leave nothing behind."""
import errno
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fadrm_ray.cli import main
from fadrm_ray.layout import RunLayout


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def distill_argv(teacher, out, *extra):
    return ["distill", "--local", "--dataset", "digits", "--teacher", teacher, "--ipc", "1", "--set", "iterations=4",
            "--out", out, "--quiet", "--threads", "1", *extra]


# --------------------------------------------------------------------------- finding 2
def test_export_never_replaces_an_existing_file(run_copy, tmp_path, capsys):
    target = tmp_path / "mine.pt"
    target.write_bytes(b"someone's work")
    code, _, err = run_cli(capsys, "export", "--run", run_copy, "--format", "pt", "--out", target)
    assert code == 2 and "already exists" in one_line(err)
    assert target.read_bytes() == b"someone's work"


# --------------------------------------------------------------------------- finding 3
@pytest.mark.parametrize("classes, message", [("10", "no images of class 10"), ("0,0", "more than once"),
                                              ("1,,2", "comma-separated"), ("-1", "comma-separated")])
def test_export_classes_must_name_classes_the_run_holds_once(run_copy, tmp_path, capsys, classes, message):
    out = tmp_path / "folder"
    code, _, err = run_cli(capsys, "export", "--run", run_copy, "--classes", classes, "--out", out)
    assert code == 2 and message in one_line(err) and not out.exists()


def test_distill_classes_with_an_empty_item_is_refused(digits_teacher, tmp_path, capsys):
    code, _, err = run_cli(capsys, *distill_argv(digits_teacher[0], tmp_path / "store", "--classes", "1,,2"))
    assert code == 2 and "--classes" in one_line(err) and not (tmp_path / "store").exists()


# --------------------------------------------------------------------------- finding 4
def test_squeeze_to_a_file_fails_before_training(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("x")
    started = time.perf_counter()
    code, out, err = run_cli(capsys, "squeeze", "--dataset", "digits", "--epochs", "30", "--out", target, "--quiet")
    assert code == 2 and "is a file, not a directory" in one_line(err) and out == ""
    assert time.perf_counter() - started < 20  # 30 epochs would take far longer


def test_squeeze_never_replaces_a_teacher(digits_teacher, tmp_path, capsys):
    shutil.copy(digits_teacher[0], tmp_path / "teacher.pt")
    before = (tmp_path / "teacher.pt").read_bytes()
    code, _, err = run_cli(capsys, "squeeze", "--dataset", "digits", "--epochs", "1", "--out", tmp_path, "--quiet")
    assert code == 2 and "already exists" in one_line(err) and (tmp_path / "teacher.pt").read_bytes() == before


def test_distill_to_a_file_fails_in_one_line(digits_teacher, tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("x")
    code, _, err = run_cli(capsys, *distill_argv(digits_teacher[0], target / "store"))
    assert code == 2 and "is a file, not a directory" in one_line(err)


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def run_on_tmpfs(mount_options: str, mount_dir, argv, env=None):
    """The `fadrm` command in a private mount namespace where `mount_dir` is a tmpfs (read-only,
    or a tiny one that fills up): a real EROFS / ENOSPC, which permission bits cannot give root."""
    mount_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join([sys.executable, "-m", "actors.cli", *[f"'{a}'" for a in map(str, argv)]])
    # What is left on the tmpfs is listed before it goes away with the namespace.
    script = (f"mount -t tmpfs -o {mount_options} tmpfs '{mount_dir}' && "
              f"{{ {command}; rc=$?; echo LEFT:$(ls -A '{mount_dir}'); exit $rc; }}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=300)


needs_namespaces = pytest.mark.skipif(not _namespaces_work(),
                                      reason="unshare -rm (user and mount namespaces) unavailable")


@needs_namespaces
def test_read_only_outputs_fail_before_any_work(run_copy, digits_teacher, tmp_path):
    ro = tmp_path / "ro"
    for argv in (distill_argv(digits_teacher[0], ro / "store"),
                 ["squeeze", "--dataset", "digits", "--epochs", "30", "--out", ro / "teacher", "--quiet"],
                 ["export", "--run", run_copy, "--out", ro / "folder"],
                 ["export", "--run", run_copy, "--format", "pt", "--out", ro / "images.pt"]):
        done = run_on_tmpfs("ro,size=1m", ro, argv)
        assert done.returncode == 2 and "not writable" in one_line(done.stderr), done.stderr
        assert "Read-only file system" in done.stderr and done.stdout == "LEFT:\n"


@needs_namespaces
def test_a_full_disk_fails_in_one_line_and_leaves_nothing_behind(run_copy, tmp_path):
    small = tmp_path / "small"
    done = run_on_tmpfs("size=16k", small, ["export", "--run", run_copy, "--out", small / "folder"])
    assert done.returncode == 1 and "No space left on device" in one_line(done.stderr), done.stderr
    assert done.stdout == "LEFT:\n"  # the half-built export is gone


# --------------------------------------------------------------------------- finding 5
def _parquet_without_training_images_of_class_1(folder):
    rng = np.random.default_rng(0)
    names = {b"huggingface": json.dumps({"info": {"features": {
        "image": {"_type": "Image"}, "label": {"names": ["a", "b"], "_type": "ClassLabel"}}}}).encode()}
    folder.mkdir()
    for split, labels in (("train", [0] * 8), ("test", [0, 0, 1, 1])):
        pngs = []
        for _ in labels:
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(buf, format="PNG")
            pngs.append({"bytes": buf.getvalue(), "path": None})
        table = pa.table({"image": pngs, "label": labels}).replace_schema_metadata(names)
        pq.write_table(table, folder / f"{split}.parquet")


def test_a_run_that_fails_at_the_start_leaves_nothing_behind(tmp_path, capsys):
    data = tmp_path / "data"
    _parquet_without_training_images_of_class_1(data)
    code, _, err = run_cli(capsys, "squeeze", "--dataset", f"parquet:{data}", "--epochs", "1", "--out",
                           tmp_path / "teacher", "--quiet", "--threads", "1")
    assert code == 0, err
    store = tmp_path / "store"
    code, _, err = run_cli(capsys, "distill", "--local", "--dataset", f"parquet:{data}", "--teacher",
                           tmp_path / "teacher" / "teacher.pt", "--ipc", "1", "--set", "iterations=2",
                           "--out", store, "--quiet", "--threads", "1")
    assert code == 2 and "no training images" in one_line(err)
    assert not store.exists() or list(store.rglob("*")) == []  # no half-created run for `info` to report


def test_an_interrupted_run_with_finished_units_is_kept(digits_teacher, tmp_path, capsys, monkeypatch):
    import fadrm_ray.runs.execute as distill

    real, calls = distill.distill_unit, []

    def second_unit_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(distill, "distill_unit", second_unit_fails)
    code, _, err = run_cli(capsys, *distill_argv(digits_teacher[0], tmp_path / "store", "--ipc", "2",
                                                 "--set", "ipc_per_unit=1"))
    assert code == 130
    (run,) = (tmp_path / "store").iterdir()
    assert len(RunLayout(run).unit_ids()) == 1 and RunLayout(run).config.is_file()  # resumable
    assert not RunLayout(run).lock.exists()


# --------------------------------------------------------------------------- finding 6
def test_teacher_messages_say_what_the_file_is(tmp_path, capsys):
    text = tmp_path / "notes.pt"
    text.write_text("hello\n")
    folder = tmp_path / "folder.pt"
    folder.mkdir()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps(Payload()))
    expected = {text: "not a PyTorch checkpoint", folder: "is a directory", evil: "a safe load refused it"}
    for path, message in expected.items():
        code, _, err = run_cli(capsys, *distill_argv(path, tmp_path / "store"))
        line = one_line(err)
        assert code == 2 and message in line and str(path) in line, line
        assert "KeyError" not in line and "weights_only" not in line and "does not exist" not in line
    assert not marker.exists()


@pytest.mark.parametrize("argv, message", [
    (["distill", "--dataset", "digits", "--teacher", "T", "--out", "O", "--preset", "nope"], "invalid choice: 'nope'"),
    (["export", "--run", "R"], "the following arguments are required: --out"),
    (["nosuchcommand"], "invalid choice"),
    (["squeeze", "--dataset", "digits", "--out", "O", "--epochs", "many"], "invalid int value"),
])
def test_argument_errors_are_one_line_with_status_2(argv, message, capsys):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and message in one_line(err) and one_line(err).startswith("fadrm")


def test_a_write_probe_on_a_full_disk_says_why_and_leaves_nothing(tmp_path):
    """A file can be created where none can be written (a full disk, a quota; here a file size
    limit of 0): the probe says so, and leaves no probe file, however often it is asked (the
    service asks every second)."""
    code = ("import resource, sys; from pathlib import Path; from fadrm_ray.fileio import probe_writable; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
            "print([probe_writable(Path(sys.argv[1]), write_byte=True) for _ in range(3)])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([os.strerror(errno.EFBIG)] * 3)
    assert list(tmp_path.iterdir()) == []
