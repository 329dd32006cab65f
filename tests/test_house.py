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


def test_the_base_install_brings_everything_the_rest_client_imports():
    """`pip install -e .` (the README's install) must be enough for `from api.client import
    FadrmClient`: every third-party module the client imports belongs to a base dependency."""
    import ast
    import sys
    import tomllib
    from importlib.metadata import packages_distributions

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parent.parent
    base = {Requirement(r).name.lower().replace("_", "-")
            for r in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]}
    tree = ast.parse((root / "api" / "client.py").read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    own = {"api", "fadrm_ray", "actors", "tune", "__future__"}
    third = sorted(m for m in modules - own if m not in sys.stdlib_module_names)
    assert third, "the client imports no third-party module: this test checks nothing"
    owners = packages_distributions()
    for module in third:
        dists = {d.lower().replace("_", "-") for d in owners.get(module, [])}
        assert dists & base, f"api/client.py imports {module} ({dists}), which no base dependency brings: {sorted(base)}"
