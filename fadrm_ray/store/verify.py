"""`fadrm verify`: check a whole run, unit by unit, and say which units fail and why.

Readers stop at the first file that fails (`reader.py`); this check goes on, so that a repair
(`fadrm_ray.repair`) knows every unit to recompute. For each unit manifest it checks that every
file it lists is inside the run, exists, has the recorded sha256, parses, holds the recorded
rows (labels and IPC range), and that every image decodes (their content digest, `store.digest`,
is taken as they do); for a complete run, that
manifest.json and the unit manifests agree. Part files no manifest lists are leftovers of
crashed attempts: reported, never read, not a failure.

The run's other files have no manifest entry: each is read whole as what it should be
(`store_file_problems`: config.yaml, the stage checkpoints, the scored patches, the ledger), and
each that is not is a `FileProblem` naming what `--repair` does about it. The evaluation's files
(stored soft labels, cached evaluations, the report) are checked a layer up
(`fadrm_ray.evaluation.verify_files`), and `fadrm_ray.repair.check_run` puts the two together.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel

from fadrm_ray.layout import RunLayout
from fadrm_ray.store import manifests
from fadrm_ray.store.digest import ContentDigest
from fadrm_ray.store.checkpoints import load_checkpoint
from fadrm_ray.store.reader import load_part, unit_parts
from fadrm_ray.store.records import COLUMNS, StoreError, decode_image
from fadrm_ray.store.run_files import ClassSelection


class FileProblem(BaseModel):
    """A file of a run outside its units that is damaged: what is wrong, what `fadrm verify
    --repair` does about it (`mended`: whether it makes the file right), or else what to do."""

    problem: str
    remedy: str
    mended: bool


class RunCheck(BaseModel):
    """What `verify_run` found: the run's units and images, the units that fail and why, the
    part files no manifest lists (leftovers, never read), and the other files that are damaged
    (`files`, by their path in the run)."""

    run_dir: str
    complete: bool
    units: int
    rows: int
    bad_units: list[str]
    problems: dict[str, list[str]]   # unit_id -> what is wrong
    unlisted: list[str]
    report_stale: dict[str, str] = {}  # report files that no longer describe the run (the caller adds them)
    # What the run holds (store.digest: equal for equal runs wherever they are); None where a
    # unit fails or the images were not decoded.
    content_digest: str | None = None
    files: dict[str, FileProblem] = {}

    @property
    def ok(self) -> bool:
        return not self.bad_units and not self.files


def verify_run(run_dir: str | os.PathLike, *, decode: bool = True) -> RunCheck:
    """Check every unit of a run (`RunCheck`). `decode=False` skips decoding the images (the
    hashes already vouch for them)."""
    layout = RunLayout(run_dir)
    if not layout.run_dir.is_dir():
        raise StoreError(f"not a FADRM run directory: {layout.run_dir} does not exist or is not a directory")
    units = manifests.unit_manifests(layout)
    problems: dict[str, list[str]] = defaultdict(list)
    for uid in layout.unit_ids():
        if uid not in units:
            problems[uid].append(f"{layout.unit(uid)} is unreadable or malformed")
    run_manifest = manifests.run_manifest(layout)
    if run_manifest is not None:
        for uid, message in manifests.run_manifest_problems(layout, run_manifest, units).items():
            problems[uid].append(message)
    if not units and not problems and layout.parts_on_disk():
        raise StoreError(f"{layout.run_dir} has part files but no manifests: there is nothing to verify them against")
    rows, listed, digest = 0, set(), ContentDigest()
    for uid, manifest in units.items():
        try:
            parts = unit_parts(layout, manifest)
        except StoreError as exc:
            problems[uid].append(str(exc))
            continue
        for part in parts:
            listed.add(part.path)
            try:
                table = load_part(layout, part, COLUMNS if decode else ["label", "ipc_index"])
            except StoreError as exc:
                problems[uid].append(str(exc))
                continue
            rows += table.num_rows
            if decode:
                labels, ipcs = table.column("label").to_pylist(), table.column("ipc_index").to_pylist()
                for i, image in enumerate(table.column("image").to_pylist()):
                    try:
                        digest.add(labels[i], ipcs[i], decode_image(image["bytes"], f"{part.path} row {i}"))
                    except StoreError as exc:
                        problems[uid].append(str(exc))
                        break
    return RunCheck(run_dir=str(layout.run_dir), complete=run_manifest is not None,
                    units=len(set(units) | set(problems)), rows=rows, bad_units=sorted(problems),
                    problems={uid: problems[uid] for uid in sorted(problems)},
                    unlisted=[layout.relative(p) for p in layout.parts_on_disk() if p not in listed],
                    content_digest=digest.hexdigest() if decode and not problems else None,
                    files=store_file_problems(layout))


def store_file_problems(layout: RunLayout) -> dict[str, FileProblem]:
    """The run's own files outside its units that do not read whole as what they are (module
    docstring), by their path in the run."""
    found: dict[str, FileProblem] = {}
    try:
        manifests.read_config(layout)
    except StoreError as exc:
        found[layout.relative(layout.config)] = FileProblem(
            problem=f"does not parse as the run's settings ({str(exc).splitlines()[0][-120:]})",
            remedy="--repair writes it again from the copy every part file carries", mended=True)
    for path in layout.checkpoints():
        where = layout.checkpoint_stage(path)
        try:
            if where is None:
                raise StoreError("not a stage checkpoint's name")
            load_checkpoint(layout, *where)
        except StoreError as exc:
            found[layout.relative(path)] = FileProblem(
                problem=f"does not read as a stage checkpoint ({str(exc)[-120:]})",
                remedy="--repair removes it: the unit's stages from there are computed again", mended=True)
    for path in layout.patch_selections():
        try:
            readable = ClassSelection.from_json(path.read_bytes()) is not None
        except OSError:
            readable = False
        if not readable:
            found[layout.relative(path)] = FileProblem(
                problem="does not read as the class's scored patches",
                remedy="--repair removes it: the class's patches are scored again where a run needs them", mended=True)
    if (bad := ledger_damage(layout.ledger)) is not None:
        found[layout.relative(layout.ledger)] = FileProblem(
            problem=bad, remedy="--repair keeps the lines that read and drops the others (a record of what ran: "
                                "nothing of the run's images or scores is read from it)", mended=True)
    return found


def ledger_damage(path) -> str | None:
    """What is wrong with a ledger (lines that are not JSON objects), else None. A last line without
    its newline is one being written (or cut by a crash), not damage; an event this version does
    not know is not damage either."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    lines = text.split(b"\n")
    lines = lines[:-1]  # what follows the last newline: empty, or a line still being written
    bad = [i + 1 for i, line in enumerate(lines) if not json_object(line)]
    if bad:
        return f"{len(bad)} of its {len(lines)} lines are not JSON (line {bad[0]} the first)"
    return None


def json_object(line: bytes) -> bool:
    """Whether `line` is the JSON text of an object."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def describe_check(check: RunCheck, repaired: list[str] | None = None) -> list[str]:
    """`fadrm verify`'s lines for a `verify_run` result (with `report_stale` and what a repair
    recomputed, when there was one)."""
    run = check.run_dir
    lines = [f"{run}: {check.units} units, {check.rows} images, "
             f"{'complete' if check.complete else 'incomplete (not finished)'}"]
    if repaired is not None:
        lines.append(f"recomputed {len(repaired)} unit(s): {', '.join(repaired) or '-'}")
    for uid, problems in check.problems.items():
        lines += [f"unit {uid}: {problem}" for problem in problems]
    if check.unlisted:
        lines.append(f"{len(check.unlisted)} part file(s) no manifest lists (leftovers, never read)")
    for path, damaged in check.files.items():
        lines.append(f"{path}: {damaged.problem}; {damaged.remedy}")
    if check.report_stale:
        lines.append(f"report/ no longer describes the run ({', '.join(check.report_stale)}): "
                     f"rerun `fadrm evaluate`")
    if check.content_digest is not None:
        lines.append(f"content digest: {check.content_digest} (its images and labels: equal for equal runs "
                     f"wherever they are stored)")
    if check.bad_units or check.files:
        what = [f"{len(check.bad_units)} unit(s)"] if check.bad_units else []
        what += [f"{len(check.files)} other file(s)"] if check.files else []
        unmended = [path for path, damaged in check.files.items() if not damaged.mended]
        lines.append(f"FAILED: {' and '.join(what)}; `fadrm verify --run {run} --repair` "
                     + ("mends them" if not unmended else
                        f"mends what it can; not {', '.join(unmended)} (see above)"))
    else:
        lines.append("verified: every file matches its manifest or reads whole as what it is")
    return lines
