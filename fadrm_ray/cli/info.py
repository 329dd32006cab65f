"""`fadrm info`: describe a run (config, classes, rows, timings, the recipe and pilot it came from,
the content digest of its images and labels).

`run_recipe` reads what a run records about its recipe (its saved config and its provenance)."""
from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING

from fadrm_ray.cli.common import IPC_HELP, common_parser

if TYPE_CHECKING:
    from fadrm_ray.store.reader import RunReader

NAME = "info"
HEAVY = False


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser()], help="describe a run: config, classes, rows, timings")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--ipc", type=int, default=None, help=IPC_HELP)
    return p


def run_recipe(reader: RunReader) -> str:
    """The recipe a run's "auto" values came from, with why (`recipes.recipe_reason`), from its
    saved config and what its provenance records: the image size and channels, the pilot, whether
    the recipe was named."""
    from fadrm_ray.recipes import recipe_reason

    recorded = reader.provenance
    data = recorded.dataset
    size, channels = (data.image_size, data.channels) if data is not None else (None, None)
    known = size is not None and channels is not None
    recipe = reader.config.recipe if reader.config is not None else ""
    return recipe_reason(recipe, size if known else None, channels if known else 1,
                         piloted=recorded.pilot is not None, given=recorded.recipe_given)


def run(args) -> None:
    """Describe the run, checked against its manifests; a run still being written (or left
    unfinished) is described too, marked `complete: False`, with the process writing it."""
    from fadrm_ray.evaluation.report import report_files, stale_reports
    from fadrm_ray.store import open_run
    from fadrm_ray.store.digest import content_digest

    reader = open_run(args.run, incomplete=True, ipc=args.ipc)
    info = reader.info()
    # What the run holds, whatever its path, unit cuts or file times: equal for equal runs.
    info["content_digest"] = content_digest(*reader.read())
    data = reader.provenance.dataset
    # The spec `fadrm evaluate` and `fadrm verify --repair` reopen it by.
    info["dataset"] = {"spec": data.spec if data else None, "fingerprint": data.fingerprint if data else None}
    info["recipe"] = run_recipe(reader)
    pilot = reader.provenance.pilot  # the pilot whose choice the run's recipe is
    if pilot is not None:
        info["pilot"] = pilot.summary()
        if pilot.below_random is not None:
            info["pilot_warning"] = pilot.below_random
    if reader.config is not None and reader.config.committee == "prior":  # CV-DD: each teacher's say in every step
        from fadrm_ray.committee import committee_weights
        priors = [t.test_accuracy for t in reader.provenance.teachers]
        with contextlib.suppress(ValueError):
            info["committee_votes"] = [round(w, 4) for w in
                                       committee_weights(priors, reader.config.committee_temperature).tolist()]
    info["report"] = report_files(args.run)
    info["report_stale"] = stale_reports(args.run)
    if args.json:
        print(json.dumps(info, default=str, ensure_ascii=False))
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value, default=str, ensure_ascii=False)
            value = value if len(value) < 200 else value[:197] + "..."
        print(f"{key:<{width}}  {value}")
