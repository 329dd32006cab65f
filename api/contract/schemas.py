"""The request and response bodies of the REST service (pydantic; FastAPI derives the OpenAPI schema).

A request names everything (dataset, teachers, classes); nothing in it is a path. Its settings are
checked twice: the shapes here (types, names, unknown keys), then against the operator's catalog
and limits and `DistillConfig` itself (`api.planning.requests.plan_request`), each failure a 422
naming the field.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from fadrm_ray.recipes import PRESETS
from fadrm_ray.data.base import OWN_SPLIT
from fadrm_ray.evaluation.scores import Evaluation, Ranking

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
JOB_ID_PATTERN = r"^job-[0-9a-f]{24}$"
CLASS_NAME_MAX = 200
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
FINAL_STATES = ("succeeded", "failed", "cancelled")
MAX_TEACHERS = 8  # teachers of one request (a committee), so `?index=` of GET .../teacher is below it

Name = Field(pattern=NAME_PATTERN, description="a name from GET /v1/datasets or GET /v1/teachers")
# A class index, or a class name: strictly, so that true is not class 1 nor 3.0 class 3.
ClassRef = Annotated[int, Strict()] | Annotated[str, Strict()]


class DistillationRequest(BaseModel):
    """POST /v1/distillations: a dataset, exactly one of `teacher` or `teachers`, the classes."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"dataset": "digits", "teacher": "digits-convnet", "classes": [3, 7], "ipc": 10,
                      "preset": "fadrm"}],
        # Exactly one of `teacher` (a name) or `teachers` (a list): a null one counts as absent.
        "oneOf": [{"required": ["teacher"], "properties": {"teacher": {"type": "string"}}},
                  {"required": ["teachers"], "properties": {"teachers": {"type": "array"}}}]})

    dataset: str = Field(pattern=NAME_PATTERN, description="a dataset name (GET /v1/datasets)")
    teacher: str | None = Field(None, pattern=NAME_PATTERN, description="a teacher name (GET /v1/teachers)")
    teachers: list[str] | None = Field(None, min_length=1, max_length=MAX_TEACHERS,
                                       description="several teachers (preset fadrm+); instead of `teacher`")
    classes: list[ClassRef] = Field(min_length=1, max_length=1000,
                                    description="class indices or class names, each once")
    ipc: int = Field(10, strict=True, ge=1, description="images per class (at most the service's max_ipc)")
    preset: Literal[tuple(PRESETS)] = "fadrm"
    seed: int = Field(0, strict=True, ge=0, le=2**31 - 1)
    overrides: dict[str, Any] = Field(default_factory=dict, max_length=64,
                                      description="DistillConfig settings (GET /v1/presets lists them)")
    evaluate: bool = Field(False, strict=True, description="train students on the images and report their top-1")
    baselines: bool = Field(False, strict=True, description=(
        "with evaluate: also train students, with the same seeds, soft labels and recipe, on random real images "
        "and on the set's starting patches; the report gives the set's gain over each, seed by seed, and a "
        "warning when the set is clearly below random real images"))
    evaluation: dict[str, Any] = Field(default_factory=dict, max_length=32,
                                       description="EvalConfig settings of the evaluation")


class ClassProgress(BaseModel):
    index: int
    name: str
    stages_done: int
    stages_total: int


class Progress(BaseModel):
    stages_done: int = 0
    stages_total: int = 0
    classes: list[ClassProgress] = []
    phase: Literal["queued", "distilling", "evaluating", "done"] | None = Field(
        None, description="what the job is doing: its images are distilled, then (where asked) its students train; "
                          "eta_seconds covers the phase under way and what follows it")
    students_done: int | None = Field(None, description="students of the evaluation trained so far (evaluating)")
    students_total: int | None = Field(None, description="students the evaluation trains (every seed, the hard-label "
                                                         "and baseline students counted)")


class Timings(BaseModel):
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    queued_seconds: float | None = None
    running_seconds: float | None = None


class Links(BaseModel):
    self: str
    dataset: str
    preview: str
    report: str
    teacher: str = Field(description="the teacher checkpoint (`?index=i` for each teacher of a committee)")
    recipe: str = Field(description="the student recipe (EvalConfig) of the report's top-1")


class TeacherFile(BaseModel):
    """One teacher of a job, as its dataset file names it."""

    name: str
    sha256: str
    url: str


class DatasetLabels(BaseModel):
    """What a job's dataset file says about its labels (`labels` in its `fadrm` schema metadata):
    the reported top-1 needs the teachers' soft labels, and where they and the recipe are."""

    note: str
    kd_temperature: float
    teachers: list[TeacherFile]
    recipe: str
    soft_labels: str | None = None   # where the evaluation stored its students' soft labels, packed


class JobAsked(BaseModel):
    """What a job's request asked for, in the request's terms (catalog names, class order): the
    service records it (`api.planning.requests.JobPlan`, where ipc, classes, seed and preset are read from
    the job's settings) and reports it (`Job`)."""

    dataset: str
    teachers: list[str]
    classes: list[int]
    class_names: list[str]
    ipc: int
    preset: str
    seed: int
    evaluate: bool
    baselines: bool = False


class Job(JobAsked):
    """A distillation job as the service reports it."""

    id: str
    state: Literal[STATES]
    run_id: str
    reused: bool = Field(description="true when the images were already in the store (nothing was computed)")
    progress: Progress
    timings: Timings
    eta_seconds: float | None = None
    error: str | None = None
    links: Links


class JobList(BaseModel):
    jobs: list[Job]
    next_cursor: str | None = None


class DatasetInfo(BaseModel):
    name: str
    num_classes: int
    class_names: list[str]
    image_size: int
    channels: int
    train_size: int
    test_size: int
    test_split: str = OWN_SPLIT          # how its test split was made where the data brings none


class TeacherListed(BaseModel):
    """A teacher the service offers (`GET /v1/teachers`): what a client needs to choose it."""

    name: str
    model: str
    dataset: str
    num_classes: int
    class_names: list[str]
    image_size: int
    in_chans: int
    test_accuracy: float | None


class BaselineReported(BaseModel):
    """A baseline's students in brief (`fadrm_ray.evaluation.scores.BaselineScore`, less where it lives)."""

    run_id: str | None = None
    preset: str | None = None
    top1_mean: float | None = None
    top1_std: float | None = None
    top1_per_seed: list[float] = []
    error: str | None = None


class EvaluationReported(BaseModel):
    """The students of a job's evaluation (`fadrm_ray.evaluation.scores.Evaluation`, less the server's paths)."""

    student: str
    top1_mean: float
    top1_std: float
    top1_per_seed: list[float]
    seeds: list[int]
    epochs: int
    classes: list[int] | None = Field(None, description="the classes the students were tested on (null: all)")
    test_size: int = Field(description="test images the students were scored on")
    config: dict[str, Any]
    baselines: dict[str, BaselineReported] = {}
    gains: dict[str, float] = {}
    paired_gains: dict[str, dict[str, Any]] = {}
    ranking: Ranking | None = Field(None, description="DD-Ranking's scores, where they were measured")
    warnings: list[str] = Field([], description="one line each: the set clearly below random real images, and "
                                                "what to try")

    @classmethod
    def of(cls, evaluation: Evaluation) -> "EvaluationReported":
        """The fields above of `evaluation` (pydantic ignores the others: run folders, curves)."""
        return cls.model_validate(evaluation.model_dump(mode="json"))


class Report(BaseModel):
    run_id: str
    ipc: int
    recipe: str = Field("", description="the recipe the set's recover settings came from (recipes.RECIPES)")
    pilot: str | None = Field(None, description="the pilot that chose the recipe on this data, in one line, or "
                                                "why none was measured where one was due")
    warnings: list[str] = Field([], description="one line each: the pilot found no recipe level with random "
                                                "real images")
    losses: dict[str, Any]
    evaluation: EvaluationReported | None = None


class Ready(BaseModel):
    """/readyz: ready when Ray is reachable, the store writable and the catalog read; `detail`
    says what is not."""

    ready: bool
    ray: bool
    store: bool
    catalog: bool = Field(True, description="the operator's datasets have been read (once, as the service starts)")
    detail: str | None = None


class Problem(BaseModel):
    """Every error other than a 422: what went wrong, in one line."""

    detail: str
    state: str | None = None
