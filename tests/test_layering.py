"""Imports point down: the library (fadrm_ray) never imports Ray or the layers built on it."""
import ast
from pathlib import Path

import fadrm_ray

ABOVE = {"ray", "actors", "api", "tune"}


def test_the_library_never_imports_ray_or_the_layers_above_it():
    root = Path(fadrm_ray.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ABOVE, f"{path.relative_to(root)} imports {name}"
