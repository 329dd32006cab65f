"""House rules checked on the source itself."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("fadrm_ray", "actors", "tune", "api", "bench", "experiments")
MAX_PARAMETERS = 8


def parameter_count(func: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional and keyword-only parameters, *args and **kwargs included; a leading self or
    cls is not counted."""
    args = func.args
    positional = [*args.posonlyargs, *args.args]
    if positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)


def test_no_function_takes_more_than_eight_parameters():
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    count = parameter_count(node)
                    if count > MAX_PARAMETERS:
                        offenders.append(f"{count} {path.relative_to(REPO)}:{node.lineno} {node.name}")
    print("\n".join(offenders))
    assert not offenders, "functions with more than 8 parameters:\n" + "\n".join(offenders)
