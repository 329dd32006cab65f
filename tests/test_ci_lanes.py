"""CI's two test lanes are the README's one test command: `.ci/run` runs the fast lane (no Ray)
and then the Ray lane, and together they select exactly what `python -m pytest` selects."""
import re
import shlex
import tomllib
from itertools import product
from pathlib import Path

from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parent.parent


def pytest_marker_options(line: str) -> str | None:
    if not line.startswith("python -m pytest"):
        return None
    words = shlex.split(line)[3:]  # after `python -m pytest`
    return words[words.index("-m") + 1] if "-m" in words else ""


def test_the_two_lanes_together_are_the_readme_command():
    lanes = [m for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if (m := pytest_marker_options(line)) is not None]
    assert lanes == ["not slow and not ray", "ray and not slow"]
    assert "ruff check ." in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^pip install .*&& python -m pytest$", (ROOT / "README.md").read_text(), re.M)
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    default = shlex.split(addopts)[shlex.split(addopts).index("-m") + 1]
    assert default == "not slow"
    fast, ray_lane, readme = (Expression.compile(e) for e in (*lanes, default))
    for slow, ray in product((False, True), repeat=2):
        marks = {"slow": slow, "ray": ray}
        chosen = [lane.evaluate(lambda name, **_: marks.get(name, False)) for lane in (fast, ray_lane)]
        assert sum(chosen) <= 1 and any(chosen) == readme.evaluate(lambda name, **_: marks.get(name, False))


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
