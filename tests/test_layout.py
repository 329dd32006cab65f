"""The run layout: one module names every path inside a run directory, and no other builds one."""
from __future__ import annotations

import ast
from pathlib import Path

from fadrm_ray.layout import RunLayout

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_MODULE = ROOT / "fadrm_ray" / "layout.py"

# Entries of a run directory (docs/architecture.md, "The store"). A string equal to one of these, used to
# build a path, means a module knows the layout itself instead of asking RunLayout.
RUN_ENTRIES = {"config.yaml", "manifest.json", "units", "checkpoints", "ledger.jsonl", "soft_labels", "report", "evaluations",
               "grid.png", "losses.png", "evaluation.json", "evaluation.png", "writer.lock", "source.json"}
# Pieces of generated names inside a run (label folders, part files, stage checkpoints).
NAME_PIECES = ("label=", "part-ipc", ".after")
# File names no module outside the layout has a reason to spell at all (docstrings aside).
FILE_NAMES = ("config.yaml", "manifest.json", "ledger.jsonl", "part-ipc", "grid.png", "losses.png",
              "evaluation.json", "evaluation.png", "writer.lock", "source.json")
PATH_CALLS = {"Path", "PurePath", "open", "glob", "rglob", "joinpath", "with_name", "iglob"}


def _literal(node: ast.AST) -> str | None:
    """The constant text of a string or f-string node (formatted parts left out)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def _is_layout_name(text: str) -> bool:
    parts = {p for p in text.replace("\\", "/").split("/") if p}
    return bool(parts & RUN_ENTRIES) or any(piece in text for piece in NAME_PIECES)


def layout_violations(source: str, where: str = "<source>") -> list[str]:
    """Places in `source` that build a run path by hand: `x / "units"`, `glob("label=*")`,
    `UNITS = "units"`, or a string spelling one of the run's file names."""
    tree = ast.parse(source)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and _literal(n.value) is not None}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                text = _literal(side)
                if text is not None and _is_layout_name(text):
                    found.append(f"{where}:{node.lineno}: path / {text!r}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in PATH_CALLS:
                for arg in node.args:
                    text = _literal(arg)
                    if text is not None and _is_layout_name(text):
                        found.append(f"{where}:{node.lineno}: {name}({text!r})")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            text = _literal(node.value)  # a name for a run entry, to build paths with later
            if text is not None and (text in RUN_ENTRIES or any(piece in text for piece in NAME_PIECES)):
                found.append(f"{where}:{node.lineno}: = {text!r}")
        if isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in docstrings:
            text = _literal(node)
            if text is not None and any(name in text for name in FILE_NAMES):
                found.append(f"{where}:{getattr(node, 'lineno', '?')}: {text!r}")
    return found


def test_the_checker_catches_hand_built_run_paths():
    assert layout_violations('p = run_dir / "checkpoints" / f"{u}.after{s}.pt"')
    assert layout_violations('p = store.run_dir / "ledger.jsonl"')
    assert layout_violations('p = Path(run_dir, "units")')
    assert layout_violations('files = run_dir.glob("label=*/part-*.parquet")')
    assert layout_violations('name = f"part-ipc{a:05d}-{b:05d}.parquet"')
    assert layout_violations('d = folder / f"label={c}"')
    assert layout_violations('REPORT_DIR = "report"')
    assert not layout_violations('out = folder / "teacher.pt"\nkey = result["report"]\n"""Docs name config.yaml."""')


def test_no_module_but_the_layout_builds_a_path_inside_a_run():
    sources = sorted(p for top in ("fadrm_ray", "actors", "bench", "experiments") for p in (ROOT / top).rglob("*.py"))
    assert {ROOT / "actors" / "worker.py", ROOT / "bench" / "fault_inject.py", LAYOUT_MODULE} <= set(sources)
    found = []
    for path in sources:
        if path != LAYOUT_MODULE:
            found += layout_violations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert found == [], "ask fadrm_ray.layout.RunLayout for these paths:\n" + "\n".join(found)


def test_layout_names_are_the_on_disk_format(tmp_path):
    layout = RunLayout(tmp_path / "run1")
    run = tmp_path / "run1"
    assert layout.run_id == "run1"
    assert layout.config == run / "config.yaml"
    assert layout.manifest == run / "manifest.json"
    assert layout.unit("u-ipc0-2") == run / "units" / "u-ipc0-2.json"
    assert layout.part(3, 0, 10) == run / "label=3" / "part-ipc00000-00010.parquet"
    assert layout.checkpoint("u0", 2) == run / "checkpoints" / "u0.after2.safetensors"
    assert layout.legacy_checkpoint("u0", 2) == run / "checkpoints" / "u0.after2.pt"
    assert layout.ledger == run / "ledger.jsonl"
    assert layout.lock == run / "writer.lock"
    assert layout.report_source == run / "report" / "source.json"
    assert layout.soft_labels == run / "soft_labels"
    assert layout.report_files() == {"grid": run / "report" / "grid.png", "losses": run / "report" / "losses.png",
                                     "evaluation": run / "report" / "evaluation.json",
                                     "evaluation_plot": run / "report" / "evaluation.png"}
    assert not run.exists()  # naming paths touches nothing


def test_layout_parses_the_names_it_builds(tmp_path):
    layout = RunLayout(tmp_path)
    part = layout.part(12, 5, 17)
    assert RunLayout.label_of(part) == 12 and RunLayout.ipc_range_of(part) == (5, 17)
    assert RunLayout.ipc_range_of(part.with_name("part-ipc1-2.parquet.tmp")) is None
    assert RunLayout.label_of(tmp_path / "label=x" / part.name) is None
    assert layout.relative(part) == "label=12/part-ipc00005-00017.parquet"
    assert layout.resolve("label=12/part-ipc00005-00017.parquet") == part
    assert layout.resolve("../elsewhere.parquet") is None and layout.resolve("/abs.parquet") is None
    assert RunLayout.checkpoint_stage(layout.checkpoint("u.a-1", 3)) == ("u.a-1", 3)
    assert RunLayout.checkpoint_stage(layout.legacy_checkpoint("u.a-1", 3)) == ("u.a-1", 3)
    assert RunLayout.checkpoint_stage(tmp_path / "u0.afterx.pt") is None
    assert RunLayout.checkpoint_stage(tmp_path / ".u0.after1.safetensors.tmp-1-ab") is None
    assert RunLayout.is_unit_id("u-ipc0-2") and not RunLayout.is_unit_id("../evil")
    assert not RunLayout.is_unit_id(".hidden") and not RunLayout.is_unit_id(3)


def test_layout_lists_units_parts_and_checkpoints(tmp_path):
    layout = RunLayout(tmp_path)
    assert layout.unit_ids() == [] and layout.parts_on_disk() == [] and layout.checkpoints() == []
    for uid in ("b", "a"):
        layout.unit(uid).parent.mkdir(parents=True, exist_ok=True)
        layout.unit(uid).write_text("{}")
    (layout.units_dir / ".a.json.tmp-1-ab").write_text("{}")
    assert layout.unit_ids() == ["a", "b"]
    for label, start, end in ((2, 0, 1), (0, 3, 4), (0, 0, 3)):
        layout.part(label, start, end).parent.mkdir(parents=True, exist_ok=True)
        layout.part(label, start, end).write_bytes(b"")
    assert layout.parts_on_disk() == [layout.part(0, 0, 3), layout.part(0, 3, 4), layout.part(2, 0, 1)]
    for uid, stage in (("u0", 1), ("u0", 2), ("u1", 1)):
        layout.checkpoint(uid, stage).parent.mkdir(parents=True, exist_ok=True)
        layout.checkpoint(uid, stage).write_bytes(b"")
    layout.legacy_checkpoint("u2", 4).write_bytes(b"")  # written by an earlier version
    (layout.checkpoints_dir / "u0.after3.safetensors.tmp-1-ab").write_bytes(b"")  # a write cut short
    assert sorted(p.name for p in layout.checkpoints("u0")) == ["u0.after1.safetensors", "u0.after2.safetensors"]
    assert len(layout.checkpoints()) == 4 and layout.checkpoints("u") == []


def test_the_library_does_not_import_the_ray_layer():
    upper = {"ray", "actors", "api", "tune"}
    found = []
    for path in sorted((ROOT / "fadrm_ray").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in upper]
    assert found == []
