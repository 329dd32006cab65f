"""What one `fadrm evaluate` reads: run opens, part-file reads and hashes, teacher loads, seconds.

    python -m bench.evaluate_reads --run STORE/RUN_ID [--json] [-- EXTRA EVALUATE ARGS ...]

    # an older version of the code beside this one: a git worktree of it, this file copied into
    # its bench/, the worktree first on the path
    git worktree add /tmp/older REV && cp bench/evaluate_reads.py /tmp/older/bench/
    cd /tmp/older && PYTHONPATH=/tmp/older python -m bench.evaluate_reads --run STORE/RUN_ID -- ...

The measured command is `fadrm evaluate --run RUN EXTRA...`, run once, in this process, through
the package's CLI main (`fadrm_ray.cli.main` where it exists, else `fadrm_ray.commands.main`).
Baselines (random real images, the run's starting patches) and DD-Ranking's scores are on by
default in `fadrm evaluate` (`--no-baselines` / `--no-ranking` turn them off, `--ars` adds ARS),
so with no extra flags the command is "evaluate with baselines and ranking". The command's own
output goes to stderr; stdout holds only the table (or, with --json, one JSON object).

Counted, only while the command runs, by patching points that exist in every version of the
code (no new names), so that two versions of the tree can be compared:

  run opens       constructions of `fadrm_ray.store.reader.RunReader` (its `__init__` is wrapped:
                  modules import `open_run` by name, the class is shared), per run directory
                  (the measured run, and the baselines' own runs in the same store) and per
                  caller (the first frame outside store/reader.py).
  part files      files `<run>/label=<c>/*.parquet` of any run (the measured run, or another
                  run such as a baseline's). Per file:
                    reads   whole-file reads: `pathlib.Path.read_bytes` of it, or
                            `pyarrow.parquet.read_table` on its path;
                    footer  opens that read the footer or a slice (`pyarrow.parquet.read_schema`,
                            `read_metadata`, `ParquetFile(path)`; the outermost call only);
                    hashes  `fadrm_ray.fileio.sha256_file` on its path, `fileio.sha256_bytes`
                            whose digest is the file's sha256 (its bytes, read anywhere), and a
                            one-shot `hashlib.sha256(data)` outside fileio whose digest is the
                            file's (shown apart as "direct");
                  and the distinct part files touched. `fileio.sha256_*` are replaced in fileio
                  and in every module under fadrm_ray, actors, api, tune that imported them by
                  name; `reader.part_bytes` / `reader.load_part` calls are counted too, where
                  they exist.
  teachers        the run's teachers: the paths its part files' provenance records, any
                  `--teacher` of the extra arguments, and any file whose sha256 is one of those.
                  `models.load_teacher` calls per path, `torch.load` calls whose argument is a
                  teacher file or a teacher's bytes (matched by sha256; torch.load itself is
                  patched), whole reads (`Path.read_bytes`), and hashes (as for parts).
                  Other `torch.load` calls are listed by source.
  wall seconds    of `main(argv)` alone: the bench imports the CLI module and scans the run's
                  files (with the original hashlib, nothing of the package) before the clock
                  starts. The process gets the command's OpenMP/allocator environment first
                  (`runtime.ensure_process_env`, which may re-execute this command once).

Not seen: work done in other processes (DataLoader workers, Ray), and incremental hashing with
`hashlib.sha256()` + `update()` outside `fileio.sha256_file`.

With an older copy first on the path, the venv's editable install can still supply a module
only the installed tree has (its finder maps every `fadrm_ray.*` name there): the CLI module is
looked for in the loaded package's own folder only, and any fadrm_ray module loaded from
elsewhere is reported (a WARNING line; `modules_from_elsewhere` in --json).

The figures in docs/benchmarks/evaluate-reads.md are of the 1,000-class rehearsal run
(`python -m bench.rehearsal.imagenet --classes 1000 --no-rest --out DIR`), evaluated once so that
every result is cached, then measured from DIR/runs/1000 with the same arguments:
    python -m bench.evaluate_reads --run store/RUN_ID -- --epochs 1 --seeds 1 --quiet --threads 2 \\
        --set reference_steps=10
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import importlib.machinery
import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

SCANNED = ("fadrm_ray", "actors", "api", "tune")  # packages whose by-name copies are replaced
CLI_MODULES = ("fadrm_ray.cli", "fadrm_ray.commands")

_sha256 = hashlib.sha256  # the original, for the bench's own hashing (never counted)


def _digest_file(path: Path) -> str:
    h = _sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _real(p) -> str:
    return os.path.realpath(os.fspath(p))


# ---------------------------------------------------------------- what the files are

class Files:
    """The run's part files, the other runs' in the same store, and the teachers: paths, sizes
    and sha256, found before the command runs, without calling the package."""

    def __init__(self, run: Path, extra_teachers: list[str]):
        self.run = _real(run)
        from fadrm_ray.layout import RunLayout

        store = Path(self.run).parent
        self.kind: dict[str, str] = {}        # realpath -> "part" | "teacher"
        self.owner: dict[str, str] = {}       # part realpath -> its run dir
        self.by_digest: dict[str, str] = {}   # sha256 -> realpath
        self.sizes: set[int] = set()
        self.run_parts: list[str] = []
        for run_dir in sorted(p for p in store.iterdir() if p.is_dir()):
            for part in RunLayout(run_dir).parts_on_disk():
                self._add(part, "part", owner=_real(run_dir))
                if _real(run_dir) == self.run:
                    self.run_parts.append(_real(part))
        self.recorded_teachers = _recorded_teachers(self.run_parts)
        for t in self.recorded_teachers + [{"path": p} for p in extra_teachers]:
            path = t.get("path")
            if path and Path(path).is_file():
                self._add(Path(path), "teacher")
            if t.get("sha256") and path:
                self.by_digest.setdefault(str(t["sha256"]), _real(path))

    def _add(self, path: Path, kind: str, owner: str | None = None) -> None:
        real = _real(path)
        self.kind[real] = kind
        if owner is not None:
            self.owner[real] = owner
        self.sizes.add(path.stat().st_size)
        self.by_digest[_digest_file(path)] = real

    def classify(self, p) -> tuple[str, str] | None:
        """(kind, realpath) of a path argument: part / teacher / None for anything else."""
        try:
            real = _real(p)
        except TypeError:
            return None
        kind = self.kind.get(real)
        if kind is None and real.endswith(".parquet") and Path(real).parent.name.startswith("label="):
            kind = "part"  # a part written since the scan
            self.owner.setdefault(real, str(Path(real).parent.parent))
        return (kind, real) if kind else None

    def classify_digest(self, digest: str) -> tuple[str, str] | None:
        real = self.by_digest.get(digest)
        if real is None:
            return None
        return (self.kind.get(real, "teacher"), real)

    def short(self, real: str) -> str:
        if real.startswith(self.run + os.sep):
            return os.path.relpath(real, self.run)
        owner = self.owner.get(real)
        if owner:
            return f"{Path(owner).name}/{os.path.relpath(real, owner)}"
        return real


def _recorded_teachers(parts: list[str]) -> list[dict]:
    """The teachers the part files' provenance records (schema metadata key `fadrm`)."""
    import pyarrow.parquet as pq

    for part in parts:
        try:
            raw = (pq.read_schema(part).metadata or {}).get(b"fadrm")
            teachers = json.loads(raw).get("teachers") if raw else None
        except Exception:
            continue
        if isinstance(teachers, list):
            return [t for t in teachers if isinstance(t, dict)]
    return []


# ---------------------------------------------------------------- counting

class Tally:
    def __init__(self, files: Files):
        self.files = files
        self.lock = threading.Lock()
        self.local = threading.local()
        self.opens: Counter = Counter()            # (run dir, caller)
        self.reads: Counter = Counter()            # (kind, path)
        self.footer: Counter = Counter()           # part path
        self.hashes: Counter = Counter()           # (kind, path, via)
        self.reader_calls: Counter = Counter()     # "part_bytes" / "load_part" -> calls
        self.teacher_loads: Counter = Counter()    # load_teacher path
        self.torch_loads: Counter = Counter()      # (kind, source)

    # a thread-local depth per channel, so nested calls are counted once (outermost)
    @contextlib.contextmanager
    def inside(self, channel: str):
        depth = getattr(self.local, channel, 0)
        setattr(self.local, channel, depth + 1)
        try:
            yield depth == 0
        finally:
            setattr(self.local, channel, depth)

    def busy(self, channel: str) -> bool:
        return getattr(self.local, channel, 0) > 0

    def add(self, counter: Counter, key) -> None:
        with self.lock:
            counter[key] += 1


def _caller() -> str:
    """module:function of the first frame outside the reader module (who opened the run)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").endswith("store.reader"):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}"


class Patches:
    """Attribute replacements, undone in reverse order."""

    def __init__(self):
        self.undo: list[tuple[object, str, object]] = []

    def set(self, owner, name: str, value) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def everywhere(self, module, name: str, make) -> bool:
        """Replace `module.name` with `make(original)`, and every by-name copy of it in the
        scanned packages' loaded modules; False if the module has no such attribute."""
        original = getattr(module, name, None)
        if original is None:
            return False
        wrapper = make(original)
        self.set(module, name, wrapper)
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or mod is module or mod_name.split(".")[0] not in SCANNED:
                continue
            for attr, value in list(vars(mod).items()):
                if value is original:
                    self.set(mod, attr, wrapper)
        return True

    def restore(self) -> None:
        for owner, name, value in reversed(self.undo):
            setattr(owner, name, value)
        self.undo.clear()


def install(tally: Tally, patches: Patches) -> list[str]:
    """Install every counter; returns the names of the points found."""
    files = tally.files
    found = []

    # 1. run opens
    reader_mod = importlib.import_module("fadrm_ray.store.reader")
    reader_cls = getattr(reader_mod, "RunReader")
    init = reader_cls.__init__

    @functools.wraps(init)
    def counted_init(self, layout, *args, **kwargs):
        run_dir = getattr(layout, "run_dir", layout)
        tally.add(tally.opens, (_real(run_dir), _caller()))
        return init(self, layout, *args, **kwargs)

    patches.set(reader_cls, "__init__", counted_init)
    found.append("RunReader.__init__")

    # 2. hashes: fileio's functions and their by-name copies
    fileio = importlib.import_module("fadrm_ray.fileio")

    def wrap_sha256_file(original):
        @functools.wraps(original)
        def sha256_file(path, *args, **kwargs):
            with tally.inside("fileio"):
                digest = original(path, *args, **kwargs)
            hit = files.classify(path) or files.classify_digest(digest)
            if hit:
                tally.add(tally.hashes, (hit[0], hit[1], "sha256_file"))
            return digest
        return sha256_file

    def wrap_sha256_bytes(original):
        @functools.wraps(original)
        def sha256_bytes(data, *args, **kwargs):
            with tally.inside("fileio"):
                digest = original(data, *args, **kwargs)
            hit = files.classify_digest(digest)
            if hit:
                tally.add(tally.hashes, (hit[0], hit[1], "sha256_bytes"))
            return digest
        return sha256_bytes

    for name, make in (("sha256_file", wrap_sha256_file), ("sha256_bytes", wrap_sha256_bytes)):
        if patches.everywhere(fileio, name, make):
            found.append(f"fileio.{name}")

    # one-shot hashlib.sha256(data) of a known file's bytes, outside fileio (e.g. a teacher's blob)
    def direct_sha256(*args, **kwargs):
        h = _sha256(*args, **kwargs)
        data = args[0] if args else kwargs.get("string", kwargs.get("data"))
        if data is not None and not tally.busy("fileio"):
            try:
                size = memoryview(data).nbytes
            except TypeError:
                size = -1
            if size in files.sizes:
                hit = files.classify_digest(h.copy().hexdigest())
                if hit:
                    tally.add(tally.hashes, (hit[0], hit[1], "hashlib"))
        return h

    patches.set(hashlib, "sha256", direct_sha256)
    found.append("hashlib.sha256(data)")

    # 3. whole-file reads through pathlib
    read_bytes = Path.read_bytes

    def counted_read_bytes(self):
        data = read_bytes(self)
        hit = files.classify(self)
        if hit:
            tally.add(tally.reads, (hit[0], hit[1]))
        return data

    patches.set(Path, "read_bytes", counted_read_bytes)
    found.append("Path.read_bytes")

    # pyarrow opens of a part file by path (outermost call only: read_schema opens a ParquetFile)
    import pyarrow.parquet as pq

    def wrap_pq(original, whole: bool):
        @functools.wraps(original)
        def opened(source, *args, **kwargs):
            with tally.inside("pyarrow") as outermost:
                if outermost and isinstance(source, (str, os.PathLike)):
                    hit = files.classify(source)
                    if hit and hit[0] == "part":
                        if whole:
                            tally.add(tally.reads, ("part", hit[1]))
                        else:
                            tally.add(tally.footer, hit[1])
                return original(source, *args, **kwargs)
        return opened

    for name, whole in (("read_table", True), ("read_schema", False), ("read_metadata", False)):
        if patches.everywhere(pq, name, functools.partial(wrap_pq, whole=whole)):
            found.append(f"pyarrow.parquet.{name}")
    pf_init = pq.ParquetFile.__init__

    @functools.wraps(pf_init)
    def counted_pf_init(self, source, *args, **kwargs):
        with tally.inside("pyarrow") as outermost:
            if outermost and isinstance(source, (str, os.PathLike)):
                hit = files.classify(source)
                if hit and hit[0] == "part":
                    tally.add(tally.footer, hit[1])
            return pf_init(self, source, *args, **kwargs)

    patches.set(pq.ParquetFile, "__init__", counted_pf_init)
    found.append("pyarrow.parquet.ParquetFile")

    # the reader's own entry points, where this version has them
    for name in ("part_bytes", "load_part"):
        def make(original, name=name):
            @functools.wraps(original)
            def call(*args, **kwargs):
                tally.add(tally.reader_calls, name)
                return original(*args, **kwargs)
            return call
        if patches.everywhere(reader_mod, name, make):
            found.append(f"reader.{name}")

    # 4. teachers: models.load_teacher and torch.load
    models = importlib.import_module("fadrm_ray.models")

    def wrap_load_teacher(original):
        @functools.wraps(original)
        def load_teacher(path, *args, **kwargs):
            tally.add(tally.teacher_loads, _real(path))
            return original(path, *args, **kwargs)
        return load_teacher

    if patches.everywhere(models, "load_teacher", wrap_load_teacher):
        found.append("models.load_teacher")

    import torch

    torch_load = torch.load

    @functools.wraps(torch_load)
    def counted_torch_load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            hit = files.classify(f)
            key = hit or ("other", _real(f))
        elif hasattr(f, "getvalue"):
            hit = files.classify_digest(_sha256(f.getvalue()).hexdigest())
            key = (hit[0], hit[1] + " (bytes)") if hit else ("other", f"<{type(f).__name__}>")
        else:
            key = ("other", f"<{type(f).__name__}>")
        tally.add(tally.torch_loads, key)
        return torch_load(f, *args, **kwargs)

    patches.set(torch, "load", counted_torch_load)
    found.append("torch.load")
    return found


# ---------------------------------------------------------------- the command

def _in_package(name: str) -> bool:
    """Whether module `name` is a file of its parent package's own folder. The venv's editable
    install adds a finder that maps every `fadrm_ray.*` name to the installed tree, so with an
    older copy first on the path a name only the installed tree has would come from there."""
    parent = importlib.import_module(name.rpartition(".")[0])
    return importlib.machinery.PathFinder.find_spec(name, list(parent.__path__)) is not None


def cli_main():
    """(module name, main) of the package's CLI: fadrm_ray.cli where it exists, else commands."""
    for name in CLI_MODULES:
        if not _in_package(name):
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # this module is not there; a missing import inside it is raised
            raise
        if callable(getattr(module, "main", None)):
            return name, module.main
    raise SystemExit(f"none of {', '.join(CLI_MODULES)} has a main()")


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _teacher_args(extra: list[str]) -> list[str]:
    out = []
    for i, a in enumerate(extra):
        if a == "--teacher" and i + 1 < len(extra):
            out.append(extra[i + 1])
        elif a.startswith("--teacher="):
            out.append(a.split("=", 1)[1])
    return out


def measure(run: Path, extra: list[str]) -> dict:
    try:  # the command's process environment, before torch loads (may re-execute once)
        from fadrm_ray.runtime import ensure_process_env
    except ImportError:
        pass
    else:
        ensure_process_env()
    cli_name, main = cli_main()
    files = Files(run, _teacher_args(extra))
    tally = Tally(files)
    patches = Patches()
    argv = ["evaluate", "--run", str(run), *extra]
    try:
        found = install(tally, patches)
        with contextlib.redirect_stdout(sys.stderr):
            start = time.perf_counter()
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
            seconds = time.perf_counter() - start
    finally:
        patches.restore()
    return summarize(tally, files, cli_name, argv, rc, seconds, found)


def _foreign_modules() -> list[str]:
    """fadrm_ray modules loaded from outside the fadrm_ray package's folder (the editable
    install's finder can mix trees when an older copy is first on the path)."""
    home = str(Path(sys.modules["fadrm_ray"].__file__).parent) + os.sep
    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith("fadrm_ray.") and getattr(mod, "__file__", None)
                  and not mod.__file__.startswith(home))


def summarize(tally: Tally, files: Files, cli_name, argv, rc, seconds, found) -> dict:
    short = files.short
    run = files.run

    def where(real: str) -> str:
        owner = files.owner.get(real)
        return "run" if owner == run else "other runs"

    opens_by_run = Counter()
    opens_by_caller = Counter()
    for (run_dir, caller), n in tally.opens.items():
        label = "run" if run_dir == run else Path(run_dir).name
        opens_by_run[label] += n
        opens_by_caller[f"{label} <- {caller}"] += n

    parts: dict[str, dict] = defaultdict(lambda: {"reads": 0, "footer": 0, "hashes": 0, "direct_hashes": 0})
    teachers: dict[str, dict] = defaultdict(lambda: {"load_teacher": 0, "torch_load": 0, "reads": 0,
                                                     "hashes": 0, "direct_hashes": 0})
    for (kind, real), n in tally.reads.items():
        (parts if kind == "part" else teachers)[real]["reads"] += n
    for real, n in tally.footer.items():
        parts[real]["footer"] += n
    for (kind, real, via), n in tally.hashes.items():
        table = parts if kind == "part" else teachers
        table[real]["direct_hashes" if via == "hashlib" else "hashes"] += n
    for real, n in tally.teacher_loads.items():
        teachers[real]["load_teacher"] += n
    other_loads = Counter()
    for (kind, source), n in tally.torch_loads.items():
        if kind == "other" or kind == "part":
            other_loads[source] += n
        else:
            teachers[source.removesuffix(" (bytes)")]["torch_load"] += n

    def totals(group: str) -> dict:
        chosen = {p: c for p, c in parts.items() if where(p) == group}
        return {
            "files": len(files.run_parts) if group == "run" else
                     sum(1 for p in files.owner if files.owner[p] != run),
            "distinct_touched": sum(1 for c in chosen.values() if any(c.values())),
            "reads": sum(c["reads"] for c in chosen.values()),
            "footer_opens": sum(c["footer"] for c in chosen.values()),
            "hashes": sum(c["hashes"] for c in chosen.values()),
            "direct_hashes": sum(c["direct_hashes"] for c in chosen.values()),
            "hashes_by_function": dict(sum((Counter({via: n}) for (kind, real, via), n in tally.hashes.items()
                                            if kind == "part" and where(real) == group), Counter())),
        }

    return {
        "cli": f"{cli_name}.main",
        "package": str(Path(sys.modules["fadrm_ray"].__file__).parent),
        "modules_from_elsewhere": _foreign_modules(),
        "argv": argv,
        "exit_code": rc,
        "wall_seconds": round(seconds, 3),
        "run": run,
        "run_opens": sum(opens_by_run.values()),
        "run_opens_of_this_run": opens_by_run.get("run", 0),
        "run_opens_by_run": dict(opens_by_run),
        "run_opens_by_caller": dict(opens_by_caller.most_common()),
        "parts_of_run": totals("run"),
        "parts_of_other_runs": totals("other runs"),
        "reader_calls": dict(tally.reader_calls),
        "part_files": {short(p): dict(c) for p, c in sorted(parts.items(), key=lambda kv: (where(kv[0]) != "run", kv[0]))},
        "teachers_recorded": [t.get("path") for t in files.recorded_teachers],
        "teachers": {p: dict(c) for p, c in sorted(teachers.items())},
        "teacher_totals": {k: sum(c[k] for c in teachers.values())
                           for k in ("load_teacher", "torch_load", "reads", "hashes", "direct_hashes")},
        "teacher_hashes_by_function": dict(sum((Counter({via: n}) for (kind, real, via), n in tally.hashes.items()
                                                if kind == "teacher"), Counter())),
        "other_torch_loads": dict(other_loads),
        "patched": found,
    }


def table(r: dict) -> str:
    pr, po = r["parts_of_run"], r["parts_of_other_runs"]
    lines = [
        f"fadrm {' '.join(r['argv'])}",
        f"  via {r['cli']} of {r['package']}, exit code {r['exit_code']}, {r['wall_seconds']:.2f} s",
        *(["  THE COMMAND FAILED (its error is on stderr): the counts below are of what it did before"]
          if r["exit_code"] != 0 else []),
        *([f"  WARNING: modules from another tree: {', '.join(r['modules_from_elsewhere'])}"]
          if r["modules_from_elsewhere"] else []),
        "",
        f"{'':34}{'this run':>10}{'other runs':>12}",
        f"{'run opens (RunReader)':34}{r['run_opens_of_this_run']:>10}"
        f"{r['run_opens'] - r['run_opens_of_this_run']:>12}",
        f"{'part files':34}{pr['files']:>10}{po['files']:>12}",
        f"{'  distinct touched':34}{pr['distinct_touched']:>10}{po['distinct_touched']:>12}",
        f"{'  whole-file reads':34}{pr['reads']:>10}{po['reads']:>12}",
        f"{'  footer/slice opens (pyarrow)':34}{pr['footer_opens']:>10}{po['footer_opens']:>12}",
        f"{'  hashes (fileio)':34}{pr['hashes']:>10}{po['hashes']:>12}",
        f"{'  hashes (direct hashlib)':34}{pr['direct_hashes']:>10}{po['direct_hashes']:>12}",
        "",
        f"{'teachers':34}{'loads':>7}{'torch.load':>11}{'reads':>7}{'hashes':>8}{'direct':>8}",
    ]
    for path, c in r["teachers"].items():
        lines.append(f"  {path[-32:]:32}{c['load_teacher']:>7}{c['torch_load']:>11}{c['reads']:>7}"
                     f"{c['hashes']:>8}{c['direct_hashes']:>8}")
    if not r["teachers"]:
        lines.append("  (none touched)")
    lines.append("")
    lines.append("run opens by caller:")
    lines.extend(f"  {n:>3}  {who}" for who, n in r["run_opens_by_caller"].items())
    def via(d: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

    lines.append(f"hashes by function: this run's parts: {via(pr['hashes_by_function'])}; other runs' parts: "
                 f"{via(po['hashes_by_function'])}; teachers: {via(r['teacher_hashes_by_function'])}")
    if r["reader_calls"]:
        lines.append("reader calls: " + ", ".join(f"{k} {v}" for k, v in sorted(r["reader_calls"].items())))
    if r["other_torch_loads"]:
        lines.append("other torch.load: " + ", ".join(f"{k} x{v}" for k, v in r["other_torch_loads"].items()))
    lines.append("per part file (reads/footer/hashes/direct):")
    lines.extend(f"  {p}: {c['reads']}/{c['footer']}/{c['hashes']}/{c['direct_hashes']}"
                 for p, c in r["part_files"].items())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    own, extra = _split(sys.argv[1:] if argv is None else list(argv))
    parser = argparse.ArgumentParser(prog="python -m bench.evaluate_reads",
                                     description="count what one `fadrm evaluate` reads (see the module docstring); "
                                                 "arguments after -- go to `fadrm evaluate`")
    parser.add_argument("--run", required=True, help="the run directory, STORE/RUN_ID")
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = parser.parse_args(own)
    run = Path(args.run)
    if not run.is_dir():
        parser.error(f"{run} is not a directory")
    result = measure(run, extra)
    print(json.dumps(result, indent=2) if args.json else table(result), flush=True)
    return 0 if result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
