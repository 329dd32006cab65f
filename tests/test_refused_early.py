"""Bad input is refused in one line with status 2 before any work starts: before any Ray process
(on the default, Ray, door too), before the pilot, before a run is written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fadrm_ray.cli import main
from tests.folder_helpers import colour_folder, squeezed_teacher

ROOT = Path(__file__).resolve().parent.parent


def _refused_before_ray(*argvs: list[str]) -> list[tuple[int, str, bool]]:
    """Each command line through `fadrm`'s main in turn, in one fresh process: its status, what it
    wrote to stderr, and whether Ray had been imported by then."""
    code = textwrap.dedent("""
        import contextlib, io, json, sys
        from actors.cli import main
        said = []
        for argv in json.loads(sys.argv[1]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main(argv)
            said.append({'rc': rc, 'err': err.getvalue(), 'ray': 'ray' in sys.modules})
        print(json.dumps(said))
    """)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return [(s["rc"], s["err"], s["ray"]) for s in json.loads(proc.stdout.strip().splitlines()[-1])]


def _fadrm(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actors.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})


def test_bad_input_is_refused_before_any_ray_process_starts(digits_teacher, tmp_path):
    """The default door is Ray: a typo'd dataset path and classes the dataset has not are refused
    in one line with status 2, and Ray is never even imported."""
    teacher = str(digits_teacher[0])
    (rc, err, ray), (rc2, err2, ray2) = _refused_before_ray(
        ["distill", "--dataset", f"imagefolder:{tmp_path / 'nope'}", "--teacher", teacher, "--out",
         str(tmp_path / "store"), "--quiet"],
        ["distill", "--dataset", "digits", "--teacher", teacher, "--classes", "3,12", "--out", str(tmp_path / "store"),
         "--quiet"])
    assert (rc, ray) == (2, False) and "image folder not found" in err and len(err.strip().splitlines()) == 1
    assert (rc2, ray2) == (2, False) and "classes must be in [0, 9]" in err2 and len(err2.strip().splitlines()) == 1


def test_device_cuda_without_a_gpu_is_refused_on_the_ray_path_too(digits_teacher, tmp_path):
    """`--local` refused it; the default (Ray) door distilled on the CPU and exited 0."""
    proc = _fadrm(["distill", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--device", "cuda",
                   "--ipc", "1", "--set", "iterations=2", "--out", str(tmp_path / "store"), "--quiet"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert "--device cuda" in proc.stderr and "no GPU" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


def test_a_teacher_of_other_classes_is_refused_before_the_pilot(tmp_path):
    """A 5-class teacher on 10-class colour data (no recipe named: the pilot would run first)."""
    five = colour_folder(tmp_path / "five", 5)
    ten = colour_folder(tmp_path / "ten", 10)
    assert main(["squeeze", "--dataset", f"imagefolder:{five}", "--epochs", "1", "--out", str(tmp_path / "t"),
                 "--quiet"]) == 0
    proc = _fadrm(["distill", "--local", "--dataset", f"imagefolder:{ten}", "--teacher", str(tmp_path / "t" / "teacher.pt"),
                   "--ipc", "2", "--out", str(tmp_path / "store")], tmp_path)
    assert proc.returncode == 2, proc.stderr[-1500:]
    err = proc.stderr.strip()
    assert "pilot" not in err.lower() and "Traceback" not in err
    assert "classes" in err.splitlines()[-1]
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.json"))


def test_a_pilot_budget_of_zero_skips_the_pilot_and_a_negative_one_is_refused(tmp_path, capsys, one_thread):
    data = colour_folder(tmp_path / "c", 3, per_class=5)
    squeezed_teacher(data, tmp_path)
    capsys.readouterr()
    base = ["distill", "--local", "--dataset", f"imagefolder:{data}", "--teacher", str(tmp_path / "t" / "teacher.pt"),
            "--ipc", "1", "--set", "iterations=2", "--out", str(tmp_path / "store"), "--quiet"]
    assert main([*base, "--pilot-budget", "-5"]) == 2
    assert "--pilot-budget" in capsys.readouterr().err
    assert main([*base, "--pilot-budget", "0"]) == 0
    out, err = capsys.readouterr()
    assert "pilot skipped: --pilot-budget 0" in err and "recipe: cifar" in out
    assert not (tmp_path / "store" / ".pilots").exists()
