"""CI's test lanes are the README's one test command: `.ci/run` runs the fast lane (no Ray, no
torch.compile), then the torch.compile lane, then the Ray lane; together they select exactly what
`python -m pytest` selects, each test in one lane, and the README names each lane's command as
`.ci/run` runs it."""
import re
import shlex
import tomllib
from itertools import product
from pathlib import Path

from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parent.parent
LANES = ["not slow and not ray and not compile", "compile and not slow and not ray", "ray and not slow"]


def pytest_marker_options(line: str) -> str | None:
    if not line.startswith("python -m pytest"):
        return None
    words = shlex.split(line)[3:]  # after `python -m pytest`
    return words[words.index("-m") + 1] if "-m" in words else ""


def test_the_lanes_together_are_the_readme_command():
    ci = (ROOT / ".ci" / "run").read_text()
    lanes = [m for line in ci.splitlines() if (m := pytest_marker_options(line)) is not None]
    assert lanes == LANES
    assert "ruff check ." in ci
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^pip install .*&& python -m pytest$", readme, re.M)
    assert [f'-m "{lane}"' in readme for lane in lanes] == [True] * len(lanes)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    addopts = shlex.split(pyproject["addopts"])
    default = addopts[addopts.index("-m") + 1]
    assert default == "not slow"
    assert {line.split(":")[0] for line in pyproject["markers"]} == {"slow", "ray", "compile"}
    chosen_by = [Expression.compile(e) for e in lanes]
    readme_command = Expression.compile(default)
    for slow, ray, compiled in product((False, True), repeat=3):
        marks = {"slow": slow, "ray": ray, "compile": compiled}

        def has(name, **_):
            return marks.get(name, False)

        chosen = [lane.evaluate(has) for lane in chosen_by]
        assert sum(chosen) <= 1 and any(chosen) == readme_command.evaluate(has), marks


def test_ci_installs_as_the_readme_says():
    """`.ci/run` installs with the README's test command (quietly), and its CPU path is the README's
    commented line for a machine without a GPU, word for word."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    install = re.search(r"^(pip install .*) && python -m pytest$", readme, re.M).group(1)
    assert install.replace("pip install ", "pip install -q ", 1) in ci.splitlines()
    cpu = re.search(r"^# No GPU\? Once, before them: (pip config --site set .*)$", readme, re.M)
    assert cpu and "download.pytorch.org/whl/cpu" in cpu.group(1)
    assert "  " + cpu.group(1) in ci.splitlines()
