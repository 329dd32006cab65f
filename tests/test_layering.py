"""Imports point down: the library (fadrm_ray) never imports Ray or the layers built on it, and
the research code (experiments) sits above actors, tune and api: nothing shipped imports it."""
import ast
from pathlib import Path

import pytest

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
    assert ROOT / "actors" / "worker.py" in sources and ROOT / "api" / "web" / "app.py" in sources
    for path in sources:
        for name in top_level_imports(path):
            assert name.split(".")[0] != "experiments", f"{path.relative_to(ROOT)} imports {name}"


def import_graph(package: str = "fadrm_ray", type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of `package` (a top-level folder of the repository: fadrm_ray, actors,
    tune, api, ...) it imports, at the top or inside a function (an import in a function is still
    a dependency: it only moves the cycle to run time); imports for type checking alone (`if
    TYPE_CHECKING:`) only with `type_checking` (a name a module's signatures use is a dependency
    of its meaning, if not of its loading)."""
    root = ROOT / package
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package_name = name if is_package else name.rpartition(".")[0]
        edges = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = set() if type_checking else {
            id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
            and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package_name.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def library_import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """The import graph of the library, fadrm_ray (`import_graph`)."""
    return import_graph("fadrm_ray", type_checking)


def private_names_crossing(package: str) -> list[str]:
    """`file: name` for every private name (`_name`, not a dunder) of a module of `package` that
    another module of it imports, or reads as an attribute of the module it imported."""
    root = ROOT / package

    def ours(module: str | None, level: int = 0) -> bool:
        return level > 0 or (module or "").split(".")[0] == package

    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names if ours(alias.name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and ours(node.module, node.level):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute) and ast.unparse(node.value) in modules:
                names = [node.attr]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("_") and not n.startswith("__")]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_library_has_no_import_cycle():
    graph = library_import_graph()
    assert {"fadrm_ray.data.base", "fadrm_ray.data.common"} <= graph["fadrm_ray.data.builtin"]  # relative imports
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    assert cycles(graph) == []


def test_the_library_has_no_import_cycle_even_through_type_checking_imports():
    """A cycle closed only under `if TYPE_CHECKING:` is still a cycle of meaning: two modules that
    each need the other's types (a module that writes onto the objects of a module that uses it)."""
    graph, typed = library_import_graph(), library_import_graph(type_checking=True)
    assert "fadrm_ray.data.base" in typed["fadrm_ray.runs.job"] - graph["fadrm_ray.runs.job"]  # typing-only
    assert cycles(typed) == []


def test_nothing_imports_the_tests():
    """The tests sit on top: what they share with a benchmark lives in bench/ (fault_inject.py,
    rehearsal/deploy.py), never the other way round."""
    sources = sorted(p for top in (*BELOW_EXPERIMENTS, "bench", "experiments") for p in (ROOT / top).rglob("*.py"))
    assert ROOT / "bench" / "rehearsal" / "submit_repeat.py" in sources
    for path in sources:
        for name in top_level_imports(path):
            assert name.split(".")[0] != "tests", f"{path.relative_to(ROOT)} imports {name}"


# The store sits under every phase: it keeps runs and reads them back, and knows nothing of how
# they are made, evaluated, reopened or shown.
ABOVE_THE_STORE = ("fadrm_ray.evaluation", "fadrm_ray.runs", "fadrm_ray.cli", "fadrm_ray.pilot", "fadrm_ray.repair",
                   "fadrm_ray.demo", "fadrm_ray.recover", "fadrm_ray.squeeze", "fadrm_ray.patches")


def test_the_store_imports_nothing_above_it():
    graph = library_import_graph()
    store = sorted(name for name in graph if name.startswith("fadrm_ray.store"))
    assert "fadrm_ray.store.reader" in store and "fadrm_ray.evaluation.evaluate" in graph  # the graph is the package's
    for name in store:
        above = sorted(t for t in graph[name] if any(t == up or t.startswith(up + ".") for up in ABOVE_THE_STORE))
        assert above == [], f"{name} imports {above}: the store must not depend on the layers that use it"
    # What used to join the store to the evaluation (the teacher and recipe beside an export) is evaluation's.
    assert "fadrm_ray.evaluation.product" in graph and "fadrm_ray.store.product" not in graph


# The evaluation trains students on what the method made; the method and the store never need it.
# Above it only the compositions that measure with it: demo (distill, then evaluate) and pilot
# (students that choose auto's recipe), beside cli/.
ABOVE_THE_EVALUATION = ("fadrm_ray.evaluation", "fadrm_ray.cli", "fadrm_ray.demo", "fadrm_ray.pilot")


def test_nothing_below_the_evaluation_imports_it():
    graph = library_import_graph(type_checking=True)
    below = sorted(name for name in graph if not any(name == up or name.startswith(up + ".")
                                                      for up in ABOVE_THE_EVALUATION))
    assert {"fadrm_ray.pilot_record", "fadrm_ray.recover", "fadrm_ray.store.reader", "fadrm_ray.runs.job"} <= set(below)
    for name in below:
        up = sorted(t for t in graph[name] if t == "fadrm_ray.evaluation" or t.startswith("fadrm_ray.evaluation."))
        assert up == [], f"{name} imports {up}: the evaluation sits above the method and the store"
    # demo and pilot sit above the evaluation, never beside it.
    evaluation = [name for name in graph if name.startswith("fadrm_ray.evaluation")]
    assert not {"fadrm_ray.demo", "fadrm_ray.pilot"} & set().union(*(graph[name] for name in evaluation))


MAX_LINES = 500


def test_no_library_module_is_over_500_lines():
    root = Path(fadrm_ray.__file__).parent
    sizes = {str(path.relative_to(root)): len(path.read_text().splitlines()) for path in sorted(root.rglob("*.py"))}
    assert sizes["recover.py"] > 100  # the files are read
    long = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert long == {}, f"split these modules: {long}"


def test_tune_has_no_import_cycle_even_through_function_level_and_type_checking_imports():
    """tune/ from its bottom (settings: the sweep's constants and shared records) to its top (sweep,
    the driver, which only the command imports)."""
    graph, typed = import_graph("tune"), import_graph("tune", type_checking=True)
    assert "tune.trainable" in graph["tune.sweep"]  # imports inside functions are edges
    assert "tune.prepare" in typed["tune.results"] - graph["tune.results"]  # typing-only, counted too
    assert cycles(typed) == []
    assert typed["tune.settings"] == set(), "tune.settings is the bottom: it imports no other module of tune/"
    importers = sorted(name for name, edges in typed.items() if "tune.sweep" in edges)
    assert importers == ["tune.sweep_command"], f"only the command imports the sweep's driver: {importers}"


@pytest.mark.parametrize("package", ["fadrm_ray", "actors", "tune", "api", "bench"])
def test_no_private_name_crosses_the_modules_of_a_package(package):
    assert private_names_crossing(package) == []


# The service's floors, from the bottom: what it says to a client, what a request may ask and the
# plan it becomes, the jobs run as driver processes, HTTP; then the command. The client stands
# beside them all and imports none of them.
API_FLOORS = ("api.contract", "api.planning", "api.jobs", "api.web", "api.serve_command")


def api_floor(module: str) -> int | None:
    """The index of the floor of API_FLOORS `module` is in, or None."""
    for i, floor in enumerate(API_FLOORS):
        if module == floor or module.startswith(floor + "."):
            return i
    return None


def test_api_has_no_import_cycle_even_through_function_level_and_type_checking_imports():
    graph, typed = import_graph("api"), import_graph("api", type_checking=True)
    assert "api.jobs.runner" in graph["api.jobs.drivers"] and "api.web.app" in graph["api.serve_command"]
    assert "api.jobs.soft_label_packing" in graph["api.jobs.job_outputs"]  # a function-level import
    assert "api.planning.requests" in typed["api.jobs.job_outputs"] - graph["api.jobs.job_outputs"]  # typing-only
    assert cycles(typed) == []


def test_api_floors_import_only_downward():
    graph = import_graph("api", type_checking=True)
    loose = sorted(m for m in graph if api_floor(m) is None and m not in ("api", "api.client", *API_FLOORS))
    assert loose == [], f"every module of api/ sits on a floor (a sub-package): {loose}"
    assert graph["api"] == set() and graph["api.client"] == set(), "the face and the client import nothing of api/"
    assert {api_floor(m) for m in graph} - {None} == set(range(len(API_FLOORS)))  # every floor is read
    for module, edges in sorted(graph.items()):
        here = api_floor(module)
        if here is None:
            continue
        up = sorted(t for t in edges if api_floor(t) is None or api_floor(t) > here)
        assert up == [], f"{module} (floor {API_FLOORS[here]}) imports {up}, on a floor above it or on none"


# --------------------------------------------------------------------------- rooms and floors
def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the library's rooms: each top-level module and each sub-package
    (`fadrm_ray.store.reader` is in the room `fadrm_ray.store`), the package face a room of its own."""
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    return out


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each room's floor in a graph without a circle: 0 for one that imports no other, else one
    above the highest room it imports."""
    found: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in found:
            found[node] = 1 + max((floor(t) for t in graph[node]), default=-1)
        return found[node]

    return {node: floor(node) for node in graph}


def test_no_import_in_the_library_points_up_a_floor():
    """The library's rooms stand on floors, every import (at the top, in a function, or for type
    checking alone) pointing to a lower one: no circle of rooms, where one import of a circle would
    point up. The data sources read a stored run through the store's reader, a floor below them;
    the store keeps the pilot's record, which asks of a dataset only its name and channels."""
    house = rooms(library_import_graph(type_checking=True))
    assert len(house) > 30 and "fadrm_ray.store" in house["fadrm_ray.data"]  # the rooms are the package's
    upward = [" -> ".join(circle) for circle in cycles(house)]
    assert upward == [], f"a circle of rooms (one of its imports points up): {upward}"
    floor = floors(house)
    assert floor["fadrm_ray.pilot_record"] < floor["fadrm_ray.store"] < floor["fadrm_ray.data"] < floor["fadrm_ray.runs"]
    assert floor["fadrm_ray.cli"] == max(floor.values())
    # The check itself: the record's old annotation of an ImageDataset would close a circle.
    before = {name: set(targets) for name, targets in house.items()}
    before["fadrm_ray.pilot_record"].add("fadrm_ray.data")
    assert ["fadrm_ray.data", "fadrm_ray.pilot_record", "fadrm_ray.store"] in cycles(before)


# --------------------------------------------------------------------------- one meaning per name
PACKAGES = ("fadrm_ray", "api", "tune", "actors")
# Module names that today mean different things in different places. Each is to be renamed so
# that one name has one meaning across the packages; remove an entry once its rename is done
# (the test fails on an entry that no longer clashes, and on any clash not listed here).
TO_RENAME = {
    "common.py": "fadrm_ray/cli/common.py, the subcommands' parser and flags; fadrm_ray/data/common.py, the "
                 "dataset sources' helpers",
    "job.py": "fadrm_ray/runs/job.py, the frozen job of a run; actors/job.py, the `ray job submit` entry point",
    "settings.py": "fadrm_ray/settings.py, the settings models' base; tune/settings.py, a trial's settings",
}


def module_names() -> dict[str, list[str]]:
    """Basename -> the modules of that name in the four packages, leaving out package files
    (`__init__`, `__main__`) and `cli/` modules named for their `fadrm` subcommand."""
    from fadrm_ray.cli import SUBCOMMANDS

    commands = {command.NAME.replace("-", "_") + ".py" for command in SUBCOMMANDS}
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py") or (path.parent.name == "cli" and path.name in commands):
                continue
            found.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    return found


def test_one_module_name_has_one_meaning_across_the_packages():
    names = module_names()
    assert "fadrm_ray/cli/verify.py" not in names["verify.py"] and "fadrm_ray/store/verify.py" in names["verify.py"]
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    new = {name: paths for name, paths in clashes.items() if name not in TO_RENAME}
    assert new == {}, f"modules of one name with different roles (rename one): {new}"
    renamed = sorted(set(TO_RENAME) - set(clashes))
    assert renamed == [], f"no longer clash: remove {renamed} from TO_RENAME"
