"""Injected faults against what every read and write path of the store does.

    python -m bench.faults [--no-ray] [--json] [--keep DIR]

A small run (digits, IPC 3 in two units) is distilled once. Each data fault is injected into a
fresh copy of it (with the part files' modification times kept, as bit rot keeps them), then
every path runs on the copy and its outcome is classified against the undamaged run:

- detected: refused in one line that names the damaged file or unit;
- refused: refused in one line before doing anything (an unfinished run, a bad output location,
  a full disk), leaving nothing half-written behind;
- flagged: worked, and said the run is not finished;
- recovered: the run ended verified and bit-identical to the undamaged one;
- unaffected: worked, with output identical to the undamaged run's;
- SILENTLY WRONG: worked, with other output than the undamaged run's. The table must have none,
  and the command exits 1 if it does.

Process and environment faults (killed workers and drivers, a full or read-only disk, two
writers, a stale lock) run the real commands in subprocesses; `during` is what the command under
fault did, and the other columns what each path then does with the state it left.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from fadrm_ray.cli import main as cli_main
from fadrm_ray.events import StageDone, WorkerStarted, read_ledger
from fadrm_ray.layout import RunLayout
from fadrm_ray.store import open_run
from bench import fault_inject

COLUMNS = ["during", "info", "export folder", "export pt", "read()", "evaluate", "parquet:", "verify",
           "rerun distill", "verify --repair"]
READS = COLUMNS[1:7]
CONFIG = ["--ipc", "3", "--set", "ipc_per_unit=2", "--set", "precision=fp32"]
SHORT, LONG = ["--set", "iterations=8"], ["--set", "iterations=400"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def fadrm(*argv, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "actors.cli", *map(str, argv)], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def same(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


class Bench:
    def __init__(self, work: Path, ray: bool):
        self.work, self.ray, self.n, self.outputs = work, ray, 0, 0
        code, _, err = cli("squeeze", "--dataset", "digits", "--epochs", "2", "--out", work / "teacher", "--quiet",
                           "--threads", "1")
        assert code == 0, err
        self.teacher = work / "teacher" / "teacher.pt"
        self.pristine = self.distill(work / "pristine", SHORT)
        self.expected: dict[Path, dict] = {}
        self.long_reference = None

    def expected_of(self, reference: Path) -> dict:
        """What each read path gives on an undamaged run (the evaluation is cached in it, and so
        in every copy made afterwards)."""
        if reference not in self.expected:
            self.expected[reference] = {p: self.read_path(p, reference)[1] for p in READS}
        return self.expected[reference]

    def distill(self, store: Path, budget: list[str], *extra) -> Path:
        code, out, err = cli("distill", "--local", "--dataset", "digits", "--teacher", self.teacher, *CONFIG, *budget,
                             "--out", store, "--quiet", "--json", "--threads", "1", *extra)
        assert code == 0, err
        return Path(json.loads(out)["run_dir"])

    def fresh(self, source: Path | None = None) -> Path:
        """A copy of `source` (the undamaged run) in a store of its own, under the same run id."""
        source = source or self.pristine
        self.expected_of(self.pristine)  # before the first copy, so that copies carry the cached evaluation
        self.n += 1
        target = self.work / f"case{self.n}" / source.name
        shutil.copytree(source, target)
        return target

    # ------------------------------------------------------------------ one path
    def read_path(self, path: str, run: Path):
        """(succeeded, output, message) of one read path on `run`."""
        self.outputs += 1
        out_dir = self.work / f"out{self.outputs}"
        if path == "read()":
            try:
                return True, open_run(run).read(), ""
            except Exception as exc:
                return False, None, str(exc)
        if path == "parquet:":
            from fadrm_ray.data import get_dataset
            try:
                data = get_dataset(f"parquet:{run}")
                return True, (data.fingerprint(), data.train.labels.tolist()), ""
            except Exception as exc:
                return False, None, str(exc)
        argv = {"info": ["info", "--run", run, "--json"],
                "export folder": ["export", "--run", run, "--out", out_dir],
                "export pt": ["export", "--run", run, "--format", "pt", "--out", out_dir.with_suffix(".pt")],
                "evaluate": ["evaluate", "--run", run, "--epochs", "1", "--seeds", "1", "--no-baselines", "--quiet",
                             "--threads", "1", "--json"]}[path]
        code, out, err = cli(*argv)
        if code != 0:
            return False, None, err
        if path == "info":
            info = json.loads(out)
            return True, (info["rows"], info["classes"], info["image_shape"], info["complete"]), ""
        if path == "export folder":
            files = {p.relative_to(out_dir).as_posix(): p.read_bytes() for p in out_dir.rglob("*") if p.is_file()}
            return True, files, ""
        if path == "export pt":
            data = torch.load(out_dir.with_suffix(".pt"))
            return True, (data["images"], data["labels"], data["ipc_index"]), ""
        return True, json.loads(out)["top1_per_seed"], ""

    def classify_read(self, path: str, run: Path, damaged: list[str], reference: Path) -> str:
        ok, output, message = self.read_path(path, run)
        if not ok:
            lines = [line for line in message.splitlines() if line.strip()]
            named = any(name in message for name in damaged)
            return ("detected" if named else "refused") + ("" if len(lines) <= 1 else f" ({len(lines)} lines!)")
        if path == "info" and output[3] is False:
            return "flagged"
        return "unaffected" if same(output, self.expected_of(reference)[path]) else "SILENTLY WRONG"

    def verify(self, run: Path, damaged: list[str]) -> str:
        code, out, _ = cli("verify", "--run", run, "--json")
        check = json.loads(out) if out.strip() else {}
        if code == 1 and check.get("bad_units"):
            named = any(name in json.dumps(check["problems"]) for name in damaged)
            return "detected" if named else "detected (other unit)"
        if code == 0 and not check.get("complete", True):
            return "flagged"
        return "unaffected" if code == 0 else f"failed ({code})"

    def recovered(self, run: Path, reference: Path) -> str:
        code, _, _ = cli("verify", "--run", run)
        if code != 0:
            return "not repaired"
        return "recovered" if same(open_run(run).read(), open_run(reference).read()) else "SILENTLY WRONG"

    def rerun(self, run: Path, reference: Path, budget: list[str]) -> str:
        self.distill(run.parent, budget)
        return self.recovered(run, reference)

    def repair(self, run: Path, reference: Path, *given) -> str:
        code, _, err = cli("verify", "--run", run, "--repair", "--quiet", "--threads", "1", *given)
        if code != 0:
            return f"failed: {err.strip()[:80]}"
        return self.recovered(run, reference)

    def row(self, run: Path, damaged: list[str], reference: Path | None = None, budget=SHORT, during="n/a",
            given=()) -> dict:
        reference = reference or self.pristine
        cells = {"during": during}
        cells.update({p: self.classify_read(p, run, damaged, reference) for p in READS})
        cells["verify"] = self.verify(run, damaged)
        again = self.fresh(run)  # repair and rerun each start from the same damaged state
        cells["rerun distill"] = self.rerun(run, reference, budget)
        cells["verify --repair"] = self.repair(again, reference, *given)
        if given:
            cells["verify --repair"] += " (given --dataset, --teacher)"
        return cells

    # ------------------------------------------------------------------ faults
    def data_fault(self, inject) -> dict:
        run = self.fresh()
        damaged = inject(run)
        names = [str(damaged)]
        if damaged.parent.name == RunLayout(run).units_dir.name:  # a unit's manifest: named by its unit id too
            names.append(damaged.stem)
        return self.row(run, names)

    def long_run(self) -> Path:
        if self.long_reference is None:
            self.long_reference = self.distill(self.work / "long-reference", LONG)
        return self.long_reference

    def killed_driver(self, ray: bool) -> dict:
        reference = self.long_run()
        store = self.work / f"killed-{'ray' if ray else 'local'}"
        extra = ["--workers", "2"] if ray else ["--local", "--threads", "1"]
        driver = fadrm("distill", "--dataset", "digits", "--teacher", self.teacher, *CONFIG, *LONG, *extra,
                       "--out", store, "--quiet")
        run = store / reference.name
        layout = RunLayout(run)
        cluster: dict = {}
        try:
            while driver.poll() is None and not (layout.unit_ids() if not ray else layout.checkpoints()):
                time.sleep(0.05)
            if ray:
                from actors.lifeline import processes
                tree = processes()
                cluster = _descendants(driver.pid, tree)
        finally:
            driver.send_signal(signal.SIGKILL)
            driver.communicate()
        during, given = "n/a", ()
        if ray:
            deadline = time.time() + 10
            while _alive(cluster) and time.time() < deadline:
                time.sleep(0.2)
            during = f"{len(_alive(cluster))} of {len(cluster)} Ray processes left after 10 s"
            if not layout.parts_on_disk():  # only stage checkpoints: nothing records the teachers
                given = ("--dataset", "digits", "--teacher", self.teacher)
        return self.row(run, [], reference, LONG, during, given)

    def killed_worker(self) -> dict:
        from actors import coordinator
        from fadrm_ray.config import make_config
        from fadrm_ray.data import get_dataset
        from fadrm_ray.runs.job import ExecutionSpec, prepare_job

        reference = self.long_run()
        store = self.work / "killed-worker"
        cfg = make_config("fadrm", overrides={"ipc": 3, "ipc_per_unit": 2, "precision": "fp32", "iterations": 400})
        spec = ExecutionSpec(workers=2, progress=False)
        job, parts = prepare_job(cfg, get_dataset("digits"), "digits", [str(self.teacher)], store,
                                 device_type=coordinator.device_type(spec))
        box = {}
        thread = threading.Thread(target=lambda: box.update(r=coordinator.run(job, spec, parts)))
        thread.start()
        run = store / reference.name
        ledger = RunLayout(run).ledger
        while thread.is_alive() and not any(read_ledger(ledger, StageDone)):
            time.sleep(0.05)
        os.kill(next(read_ledger(ledger, WorkerStarted)).pid, signal.SIGKILL)
        thread.join()
        during = "recovered" if "r" in box and same(open_run(run).read(), open_run(reference).read()) else "FAILED"
        return self.row(run, [], reference, LONG, during)

    def concurrent_writers(self) -> dict:
        store = self.work / "concurrent"
        runs = [fadrm("distill", "--local", "--dataset", "digits", "--teacher", self.teacher, *CONFIG, *LONG,
                      "--out", store, "--quiet", "--json", "--threads", "1") for _ in range(2)]
        results = [json.loads(r.communicate()[0]) for r in runs]
        ran = sorted(len(r["units_run"]) for r in results)
        during = "waited: each unit computed once" if ran == [0, 2] else f"units computed {ran}"
        return self.row(Path(results[0]["run_dir"]), [], self.long_run(), LONG, during)

    def stale_lock(self) -> dict:
        run = self.fresh()
        RunLayout(run).manifest.unlink()
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        RunLayout(run).lock.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "token": "x"}))
        return self.row(run, [])

    def on_tmpfs(self, options: str, argv) -> tuple[int, str, str]:
        """A command writing to a private tmpfs (read-only, or nearly full); what it left there."""
        target = self.work / f"tmpfs{self.n}"
        self.n += 1
        target.mkdir()
        argv = [str(a).replace("TMPFS", str(target)) for a in argv]
        command = " ".join([sys.executable, "-m", "actors.cli", *[f"'{a}'" for a in argv]])
        script = f"mount -t tmpfs -o {options} tmpfs {target} && {{ {command}; rc=$?; ls -A {target} >&2; exit $rc; }}"
        done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=ENV)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return done.returncode, lines[0] if lines else "", " ".join(lines[1:])

    def environment(self, options: str, argv, label: str) -> dict:
        code, message, left = self.on_tmpfs(options, argv)
        one_line = message.startswith("fadrm") and message.count("error") == 1
        verdict = (f"refused, exit {code}" if code and one_line else f"exit {code}: {message[:60]}")
        verdict += ", nothing left" if not left else f", left: {left[:60]}"
        return {"during": verdict, **{c: "n/a" for c in COLUMNS[1:]}}


def _descendants(root: int, tree: dict) -> dict[int, str]:
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, (ppid, start) in tree.items():
            if ppid == pid and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def _alive(cluster: dict[int, str]) -> dict[int, str]:
    from actors.lifeline import processes

    now = processes()
    return {pid: start for pid, start in cluster.items() if pid in now and now[pid][1] == start}


def _namespaces() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def run(ray: bool = True, keep: Path | None = None) -> dict[str, dict]:
    work = Path(tempfile.mkdtemp(prefix="fadrm-faults-", dir=keep))
    bench = Bench(work, ray)
    table: dict[str, dict] = {}
    data = [("bit flip in a stored PNG", fault_inject.flip_png_bit),
            ("bit flip in a Parquet footer", fault_inject.flip_footer_bit),
            ("truncated part file", fault_inject.truncate_part),
            ("two rows' images swapped", fault_inject.swap_rows),
            ("a PNG replaced by another valid PNG", fault_inject.replace_png),
            ("part file deleted", fault_inject.delete_part),
            ("unit manifest sha256 set to zeros", fault_inject.zero_unit_sha),
            ("unit manifest deleted", fault_inject.delete_unit_manifest),
            ("run manifest deleted (unfinished run)", fault_inject.delete_run_manifest),
            ("run manifest cut short", fault_inject.garble_run_manifest)]
    for name, inject in data:
        table[name] = bench.data_fault(inject)
    table["writer lock of a dead process"] = bench.stale_lock()
    table["driver killed (--local)"] = bench.killed_driver(ray=False)
    table["two writers of the same run"] = bench.concurrent_writers()
    if ray:
        table["worker killed mid-stage (Ray)"] = bench.killed_worker()
        table["driver killed (Ray, 2 workers)"] = bench.killed_driver(ray=True)
    if _namespaces():
        distill = ["distill", "--local", "--dataset", "digits", "--teacher", bench.teacher, *CONFIG, *LONG,
                   "--out", "TMPFS/store", "--quiet", "--threads", "1"]
        export = ["export", "--run", bench.pristine, "--out", "TMPFS/folder"]
        squeeze = ["squeeze", "--dataset", "digits", "--epochs", "30", "--out", "TMPFS/teacher", "--quiet"]
        table["full disk during distill (16 KiB tmpfs)"] = bench.environment("size=16k", distill, "distill")
        table["full disk during export (16 KiB tmpfs)"] = bench.environment("size=16k", export, "export")
        for what, argv in (("distill", distill), ("export", export), ("squeeze", squeeze)):
            table[f"read-only output ({what})"] = bench.environment("ro,size=1m", argv, what)
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return table


def markdown(table: dict[str, dict]) -> str:
    lines = ["| fault | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(row.get(c, "n/a") for c in COLUMNS) + " |" for name, row in table.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-ray", action="store_true", help="skip the faults that need a local Ray")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", type=Path, default=None, help="keep the damaged runs under this folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table = run(ray=not args.no_ray, keep=args.keep)
    print("\n" + (json.dumps(table, indent=2) if args.json else markdown(table)))  # after any noise of Ray's
    wrong = sum("SILENTLY WRONG" in cell for row in table.values() for cell in row.values())
    print(f"\n{wrong} silently wrong", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
