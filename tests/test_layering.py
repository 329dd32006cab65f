"""Imports point down: the library (fadrm_ray) never imports Ray or the layers built on it, and
the research code (experiments) sits above actors, tune and api: nothing shipped imports it."""
import ast
from pathlib import Path

import fadrm_ray

ROOT = Path(fadrm_ray.__file__).parent.parent
ABOVE = {"ray", "actors", "api", "tune", "bench", "experiments", "tests"}
# experiments: research code, not shipped; a layer above the library, actors, tune and api.
BELOW_EXPERIMENTS = ("fadrm_ray", "actors", "tune", "api")


def top_level_imports(path: Path):
    """(module name) of every absolute import in `path`."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module or ""


def test_the_library_never_imports_ray_or_the_layers_above_it():
    root = Path(fadrm_ray.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for name in top_level_imports(path):
            assert name.split(".")[0] not in ABOVE, f"{path.relative_to(root)} imports {name}"


def test_nothing_below_experiments_imports_it():
    sources = sorted(p for top in BELOW_EXPERIMENTS for p in (ROOT / top).rglob("*.py"))
    assert ROOT / "actors" / "worker.py" in sources and ROOT / "api" / "app.py" in sources
    for path in sources:
        for name in top_level_imports(path):
            assert name.split(".")[0] != "experiments", f"{path.relative_to(ROOT)} imports {name}"
