"""A request, checked and turned into the plan its driver runs.

Everything a request names is checked against what the operator offers (datasets, teachers,
classes by index or name) and the service's limits (api.planning.limits: every count compared as
it was sent, before anything is built from it), then its settings are built the way the CLI builds
them (`make_config`: preset -> overrides -> ipc/classes/seed) and built into the job the driver
will run (`build_job`: resolved for the dataset, run id computed), so a bad value fails here as a
422 naming the field, before any job record exists. The run id makes a repeated request find its
images: a run that holds them at the same or a larger IPC is served at once.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from fadrm_ray.config import ConfigError, EvalConfig, make_config
from fadrm_ray.pilot_record import pilot_reason
from fadrm_ray.runs.job import DistillJob, build_job
from fadrm_ray.models import ModelError, check_teacher_fits
from fadrm_ray.store import StoreError, open_run
from fadrm_ray.store.records import RunIncomplete

from api.contract.schemas import CLASS_NAME_MAX, DistillationRequest
from api.contract.service_errors import RequestInvalid
from api.planning.catalog import Catalog, UnknownName, UnusableTeacher
from api.planning.limits import OverLimit, RequestLimits, check_evaluation, check_overrides, check_totals

# Set by the request's own fields, never through `overrides`.
_TOP_LEVEL = ("ipc", "classes", "seed", "preset")
# What a plan reads from its job's settings (earlier versions also stored them beside the job).
_FROM_CONFIG = frozenset(_TOP_LEVEL)
WRITER_GAP_S = 0.3  # how long `store_holds` waits before it takes a run without manifest nor writer as absent


class JobPlan(BaseModel):
    """What the service records for a job and its driver runs: the job (built once, here), what
    the request asked for in its own terms (catalog names, class names) and its evaluation
    settings. The request's ipc, classes, seed and preset are the job's settings (`job.config`),
    read from there; a plan stored by an earlier version with them beside the job as well is
    read as if they were not (`_drop_repeats`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    dataset: str
    teachers: list[str]
    class_names: list[str]
    evaluate: bool
    baselines: bool = False
    job: DistillJob
    evaluation: EvalConfig | None = None
    # Set where the recipe is left to `auto` on colour data no one measured and the store holds
    # no pilot for it: the recipe is then the image size's, unmeasured here (pilot_record.py).
    pilot_note: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_repeats(cls, data):
        """Earlier versions stored ipc, classes, seed and preset twice: beside the job and in its
        config. Where they agree with the config they go; where not, extra="forbid" refuses them."""
        if not isinstance(data, dict) or not _FROM_CONFIG & set(data):
            return data
        job = data.get("job")
        config = job.get("config") if isinstance(job, dict) else getattr(job, "config", None)
        if isinstance(config, BaseModel):
            config = config.model_dump(mode="json")
        if not isinstance(config, dict):
            return data
        same = {k for k in _FROM_CONFIG & set(data)
                if k in config and _json_value(data[k]) == _json_value(config[k])}
        return {k: v for k, v in data.items() if k not in same}

    @property
    def ipc(self) -> int:
        return self.job.config.ipc

    @property
    def classes(self) -> list[int]:
        return list(self.job.config.classes or range(self.job.num_classes))

    @property
    def seed(self) -> int:
        return self.job.config.seed

    @property
    def preset(self) -> str:
        return self.job.config.preset

    @property
    def run_id(self) -> str:
        return self.job.run_id

    @property
    def stages(self) -> int:
        return self.job.config.k + 1

    @property
    def classes_per_batch(self) -> int:
        return self.job.config.classes_per_batch or len(self.classes)

    @property
    def eval_work(self) -> int:
        """The image-epochs its evaluation trains: images x epochs x seeds for every student it
        trains (`eval_students`); 0 without an evaluation."""
        students, each = self.eval_students
        return students * each

    @property
    def eval_students(self) -> tuple[int, int]:
        """The students its evaluation trains (`eval_students` a seed, every seed), and the
        image-epochs of each; (0, 0) without an evaluation."""
        if not self.evaluate or self.evaluation is None:
            return 0, 0
        from fadrm_ray.evaluation.training import resolve_protocol

        images = self.ipc * len(self.classes)
        resolved = resolve_protocol(self.evaluation, images, self.ipc)
        return eval_students(self.baselines) * len(resolved.seed_list), images * resolved.epochs

    @property
    def recipe_notes(self) -> tuple[str | None, list[str]]:
        """The pilot behind the recipe in one line (or why there was none, where one was due; or
        that it cannot tell at this IPC whether its choice beats random real images), and the
        warnings: the pilot's choice below random real images."""
        pilot = self.job.pilot
        if pilot is None:
            return self.pilot_note, []
        note = pilot.summary() + (f"; {pilot.cannot_tell}" if pilot.cannot_tell is not None else "")
        return note, [pilot.below_random] if pilot.below_random is not None else []

    def fingerprint(self) -> str:
        """Same images and same evaluation -> same job."""
        key = {"run_id": self.run_id, "ipc": self.ipc, "classes": self.classes, "evaluate": self.evaluate,
               "evaluation": None if self.evaluation is None else self.evaluation.model_dump(mode="json")}
        if self.baselines:  # absent when false: the jobs recorded before baselines keep their fingerprints
            key["baselines"] = True
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def plan_request(body: DistillationRequest, catalog: Catalog, limits: RequestLimits, store: Path,
                 device: str) -> JobPlan:
    """The plan of a request, or RequestInvalid: the limits checked on the values as sent, the
    settings validated once (`make_config`), resolved once and the run id computed once
    (`build_job`: its run in `store`, for `device`), then the totals of the resolved job checked
    against the limits."""
    try:
        return _plan(body, catalog, limits, store, device)
    except OverLimit as exc:
        raise RequestInvalid(exc.loc, str(exc)) from None


def _plan(body: DistillationRequest, catalog: Catalog, limits: RequestLimits, store: Path, device: str) -> JobPlan:
    try:
        dataset = catalog.dataset(body.dataset)
    except UnknownName as exc:
        raise RequestInvalid("dataset", str(exc)) from None
    names = _teacher_names(body)
    teachers = []
    for i, name in enumerate(names):
        where = "teacher" if body.teacher is not None else ("teachers", i)
        try:
            teacher = catalog.teacher(name)
            check_teacher_fits(teacher.info, dataset)
        except (UnknownName, UnusableTeacher) as exc:
            raise RequestInvalid(where, str(exc)) from None
        except ModelError as exc:
            raise RequestInvalid(where, f"teacher {name!r} does not fit dataset {body.dataset!r}: {exc}") from None
        teachers.append(teacher)
    classes = _class_indices(body.classes, dataset.class_names)
    if body.ipc > limits.ipc:
        raise RequestInvalid("ipc", f"ipc must be at most {limits.ipc} on this service, got {body.ipc}")
    images = body.ipc * len(classes)
    if images > limits.images:
        raise RequestInvalid("ipc", f"{len(classes)} classes x ipc {body.ipc} = {images} images; "
                                    f"this service makes at most {limits.images} per request")
    for key in body.overrides:
        if key in _TOP_LEVEL:
            raise RequestInvalid(("overrides", key), f"overrides.{key}: set {key} as a field of the request itself")
    check_overrides(body.overrides, limits)
    if body.evaluation and not body.evaluate:
        raise RequestInvalid("evaluation", "evaluation settings are given but evaluate is false")
    if body.baselines and not body.evaluate:
        raise RequestInvalid("baselines", "baselines are students trained beside the evaluation's: set evaluate "
                                          "to true")
    check_evaluation(body.evaluation, limits)
    if body.preset == "fadrm+" and len(teachers) < 2:
        raise RequestInvalid("teachers", "preset fadrm+ needs at least two teachers (teachers: [a, b])")
    try:
        cfg = make_config(body.preset, overrides=dict(body.overrides), ipc=body.ipc, classes=classes, seed=body.seed)
        job = build_job(cfg, dataset, catalog.dataset_specs[body.dataset], [t.info for t in teachers], store,
                        device)
    except ConfigError as exc:
        raise RequestInvalid(("overrides", *(exc.loc or ("__root__",))), f"overrides: {exc}") from None
    try:
        evaluation = EvalConfig.model_validate(dict(body.evaluation)) if body.evaluate else None
    except ConfigError as exc:
        raise RequestInvalid(("evaluation", *(exc.loc or ("__root__",))), f"evaluation: {exc}") from None
    _check_totals(job, evaluation, images, body.ipc, limits, sets=3 if body.baselines else 1)
    note = None
    if job.pilot is None and pilot_reason(cfg, dataset) is None:
        note = (f"no pilot has measured the recipes on {body.dataset} with these teachers at IPC {body.ipc}: the "
                f"recipe is the image size's ({job.config.recipe}), unmeasured on this data; a `fadrm distill` of "
                f"this dataset, teachers and IPC into the service's store measures one, which later requests take")
    return JobPlan(job=job, dataset=body.dataset, teachers=[t.name for t in teachers],
                   class_names=[str(dataset.class_names[c]) for c in classes], evaluate=body.evaluate,
                   baselines=body.baselines, evaluation=evaluation, pilot_note=note)


def eval_students(baselines: bool) -> int:
    """Students an evaluation of the service trains per seed, each on as many images for as many
    epochs as the set's: one on the set with the teachers' soft labels, one more on random real
    images and one on the starting patches with baselines, and one on the set with its hard
    labels alone (the ranking's `hard_top1_per_seed`, actors.evaluation). The budget
    (FADRM_MAX_EVAL_WORK, FADRM_MAX_EVAL_BACKLOG) counts them all."""
    return (3 if baselines else 1) + 1


def _check_totals(job: DistillJob, evaluation: EvalConfig | None, images: int, ipc: int, limits,
                  sets: int = 1) -> None:
    """The resolved job's recover work, and its evaluation's work (every student it trains:
    `sets` sets of `images` images with soft labels, the job's and with baselines random real
    images and the starting patches, and the hard-label students) and stored soft labels (of the
    soft-label students only)."""
    from fadrm_ray.evaluation.training import resolve_protocol

    epochs, seeds, label_bytes = None, 1, 0
    if evaluation is not None:
        resolved = resolve_protocol(evaluation, images, ipc)
        epochs, seeds = resolved.epochs, len(resolved.seed_list)
        if resolved.soft_labels == "stored":
            per_logit = 2 if resolved.soft_label_dtype == "float16" else 4
            storage = resolved.label_storage()
            kept = storage.kept(job.num_classes)
            # Each stored view holds its logits (top-k: values, their classes, one value for the
            # rest) and its crop plan (a few dozen bytes); only the epochs kept are stored.
            per_view = (job.num_classes * per_logit if kept is None else kept * (per_logit + 4) + per_logit) + 64
            label_bytes = sets * images * min(epochs, storage.epochs or epochs) * seeds * per_view
    check_totals(images, job.config.iterations, images if evaluation is not None else None, epochs, seeds,
                 label_bytes, limits, students=eval_students(sets > 1))


def run_dir(store: Path, plan: JobPlan) -> Path:
    """The plan's run in the store at `store`."""
    return store / plan.run_id


def store_holds(store: Path, plan: JobPlan) -> Literal["held", "absent", "writing"]:
    """"held" when the store's run is complete and holds IPC indices 0..ipc-1 of every class asked
    for (checked against its manifests as it is read); "writing" when the run has no manifest
    because a live process is writing it (a `fadrm verify --repair`, a distill): it is not absent,
    only not readable yet; else "absent"."""
    path = run_dir(store, plan)
    if not path.is_dir():
        return "absent"
    for attempt in range(2):
        try:
            held = open_run(path, ipc=plan.ipc).info()["images_per_class"]
        except RunIncomplete as exc:
            if exc.writer is not None:
                return "writing"
            if attempt == 0:
                # `fadrm verify --repair` removes the manifest under the run's lock, lets go of
                # it, and takes it again to recompute: a moment without either. A repair is
                # writing again by now; a run left incomplete is still so.
                time.sleep(WRITER_GAP_S)
                continue
            return "absent"
        except StoreError:
            return "absent"
        return "held" if all(held.get(c, 0) >= plan.ipc for c in plan.classes) else "absent"


def images_in_store(store: Path, plan: JobPlan) -> bool:
    """True when the store's run holds what `plan` asks for, complete (`store_holds`)."""
    return store_holds(store, plan) == "held"


def _json_value(value):
    """A value as JSON has it (a tuple is a list), to compare a stored value with a model's."""
    return json.loads(json.dumps(value, default=str))


def _teacher_names(body: DistillationRequest) -> list[str]:
    if (body.teacher is None) == (body.teachers is None):
        raise RequestInvalid("teacher", "give exactly one of teacher (a name) or teachers (a list of names)")
    names = [body.teacher] if body.teacher is not None else list(body.teachers)
    if len(set(names)) != len(names):
        raise RequestInvalid("teachers", f"teachers names a teacher more than once: {names}")
    return names


def _class_indices(refs: list, class_names: list[str]) -> list[int]:
    by_name = {str(n): i for i, n in enumerate(class_names)}
    out = []
    for pos, ref in enumerate(refs):
        if isinstance(ref, bool):
            raise RequestInvalid(("classes", pos), f"classes[{pos}] must be a class index or name, got {ref!r}")
        if isinstance(ref, int):
            if not 0 <= ref < len(class_names):
                raise RequestInvalid(("classes", pos), f"classes[{pos}]: no class {ref}; the dataset has classes "
                                                       f"0..{len(class_names) - 1}")
            out.append(ref)
        elif ref in by_name:
            out.append(by_name[ref])
        else:
            shown = ref if len(ref) <= CLASS_NAME_MAX else ref[:CLASS_NAME_MAX] + "..."
            raise RequestInvalid(("classes", pos), f"classes[{pos}]: no class named {shown!r} in this dataset")
    repeated = sorted({c for c in out if out.count(c) > 1})
    if repeated:
        raise RequestInvalid("classes", f"classes names class {repeated[0]} more than once")
    # In index order: a class set is one distillation whichever order a request lists it in
    # (the order of a config's classes is part of its run id, since it decides the batches).
    return sorted(out)
