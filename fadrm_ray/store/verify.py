"""`fadrm verify`: check a whole run, unit by unit, and say which units fail and why.

Readers stop at the first file that fails (`reader.py`); this check goes on, so that a repair
(`fadrm_ray.repair`) knows every unit to recompute. For each unit manifest it checks that every
file it lists is inside the run, exists, has the recorded sha256, parses, holds the recorded
rows (labels and IPC range), and that every image decodes (their content digest, `store.digest`,
is taken as they do); for a complete run, that
manifest.json and the unit manifests agree. Part files no manifest lists are leftovers of
crashed attempts: reported, never read, not a failure.
"""
from __future__ import annotations

import os
from collections import defaultdict

from pydantic import BaseModel

from fadrm_ray.layout import RunLayout
from fadrm_ray.store import manifests
from fadrm_ray.store.digest import ContentDigest
from fadrm_ray.store.reader import load_part, unit_parts
from fadrm_ray.store.records import COLUMNS, StoreError, decode_image


class RunCheck(BaseModel):
    """What `verify_run` found: the run's units and images, the units that fail and why, and the
    part files no manifest lists (leftovers, never read)."""

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
                    content_digest=digest.hexdigest() if decode and not problems else None)


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
    if check.report_stale:
        lines.append(f"report/ no longer describes the run ({', '.join(check.report_stale)}): "
                     f"rerun `fadrm evaluate`")
    if check.bad_units:
        lines.append(f"FAILED: {len(check.bad_units)} unit(s); `fadrm verify --run {run} --repair` recomputes them")
    else:
        lines.append("verified: every file matches its manifest")
    if check.content_digest is not None:
        lines.append(f"content digest: {check.content_digest} (its images and labels: equal for equal runs "
                     f"wherever they are stored)")
    return lines
