"""The `fadrm` command tells bad input (one line, status 2) from a fault of the program (status 1,
with its traceback): only `InputError` and the error classes derived from it are bad input."""
from dataclasses import dataclass
from typing import Callable

import pytest

from fadrm_ray.cli import EXIT_BAD_INPUT, EXIT_FAILED, main
from fadrm_ray.cli.common import common_parser
from fadrm_ray.data.base import DatasetError
from fadrm_ray.errors import InputError
from fadrm_ray.settings import ConfigError, EvaluationError


@dataclass
class Raising:
    """A subcommand (of the shape `fadrm tune` and `fadrm serve` plug in) whose work raises `error()`."""

    error: Callable[[], BaseException]
    NAME: str = "boom"
    HEAVY: bool = False

    def add_parser(self, sub):
        return sub.add_parser(self.NAME, parents=[common_parser()], help="raises")

    def run(self, args) -> None:
        raise self.error()


def run(capsys, monkeypatch, error):
    monkeypatch.delenv("FADRM_DEBUG", raising=False)
    code = main(["boom"], commands=[Raising(error)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("error", [InputError, ConfigError, DatasetError, EvaluationError])
def test_bad_input_is_one_line_and_status_2(capsys, monkeypatch, error):
    code, err = run(capsys, monkeypatch, lambda: error("alpha must be in (0, 1], got 2"))
    assert code == EXIT_BAD_INPUT
    assert err == "fadrm boom: error: alpha must be in (0, 1], got 2\n"


@pytest.mark.parametrize("error", [ValueError, KeyError, TypeError, AssertionError])
def test_a_fault_of_the_program_is_not_reported_as_bad_input(capsys, monkeypatch, error):
    """A plain ValueError from deep inside (the device mismatch of `run_job`, a shape check) is a
    bug: status 1 and the traceback that finds it, not a line that blames the user."""
    code, err = run(capsys, monkeypatch, lambda: error("the job was resolved for cpu, but this executor runs on cuda"))
    assert code == EXIT_FAILED
    assert "Traceback (most recent call last)" in err and "in run" in err
    assert "fadrm boom: internal error" in err.strip().splitlines()[-1]


def test_every_bad_input_class_of_the_library_is_an_input_error():
    from fadrm_ray.codec import CodecError
    from fadrm_ray.fileio import OutputError
    from fadrm_ray.models import ModelError
    from fadrm_ray.evaluation.soft_labels import SoftLabelError
    from fadrm_ray.store.records import IntegrityError, StoreError

    for cls in (ConfigError, EvaluationError, DatasetError, ModelError, StoreError, IntegrityError, CodecError,
                OutputError, SoftLabelError):
        assert issubclass(cls, InputError), cls


@pytest.mark.parametrize("flags, field", [(["--workers", "0"], "workers"), (["--cpus-per-worker", "0"], "cpus_per_worker"),
                                          (["--threads", "0", "--local"], "threads")])
def test_execution_flags_out_of_range_are_bad_input(digits_teacher, tmp_path, capsys, monkeypatch, flags, field):
    monkeypatch.delenv("FADRM_DEBUG", raising=False)
    code = main(["distill", "--dataset", "digits", "--teacher", str(digits_teacher[0]), "--out", str(tmp_path / "store"),
                 "--quiet", *flags])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and err.startswith(f"fadrm distill: error: {field} must be") and len(err.splitlines()) == 1
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())
