"""/v1/distillations: submit a request, follow, list and cancel its job, and download what it made
(the dataset, the preview, the report, the recipe, the stored soft labels, the teacher)."""
from __future__ import annotations

import base64
import functools
from typing import Literal

from fastapi import APIRouter, Depends, Header, HTTPException, Query
from fastapi.responses import FileResponse, JSONResponse, Response

from fadrm_ray.config import EvalConfig
from fadrm_ray.evaluation.soft_labels import SoftLabelError
from fadrm_ray.evaluation.verify_files import SoftLabelDamaged

from api.contract.schemas import MAX_TEACHERS, STATES, DistillationRequest, Job, JobList, Problem, Report
from api.contract.service_errors import RETRY_S, Conflict, Unavailable, short_of_space
from api.jobs.job_outputs import (TeacherChanged, job_recipe, open_teacher, report, stored_labels, write_dataset,
                                  write_imagefolder_zip, write_preview, write_soft_labels)
from api.planning.requests import plan_request, run_dir, store_holds
from api.web.downloads import FileAnswer
from api.web.refusals import body_shape, utf8_body
from api.web.routes.dependencies import AUTH, ERRORS, JOB_ERRORS, JobId, ServiceDep, json_response

RETRY_AFTER_S = 30
# What api.web.refusals.body_shape checks of a POST body before pydantic does.
REQUEST_FIELDS = frozenset(DistillationRequest.model_fields)
REQUEST_LISTS = {"classes": (int, str)}
request_shape = body_shape(REQUEST_FIELDS, REQUEST_LISTS)
router = APIRouter()


@router.post("/v1/distillations", status_code=202, tags=["distillations"], dependencies=[*AUTH, Depends(utf8_body), Depends(request_shape)],
          responses={**ERRORS, 200: {"model": Job, "description": "the same request: the job made before"},
                     400: {"model": Problem, "description": "a body that is not UTF-8 JSON text"},
                     409: {"model": Problem, "description": "the Idempotency-Key was used for another request"},
                     413: {"model": Problem},
                     429: {"model": Problem, "description": "too many jobs waiting, or too many requests"},
                     503: {"model": Problem, "description": "the store is full, read-only or failing, or another "
                                                            "process writes the request's run (see Retry-After)"}})
def submit(body: DistillationRequest, service: ServiceDep,
           idempotency_key: str | None = Header(None, pattern=r"^[A-Za-z0-9._:-]{1,200}$")) -> Job:
    plan = plan_request(body, service.catalog, service.limits, service.store, service.device)
    key = plan.fingerprint()
    # The store is read before the lock (a run's manifests, the disk's free space): a submit never
    # waits behind another's disk reads. Under the lock only what must agree with the job made:
    # the records of the same request, and the jobs queued or running.
    full = short_of_space(service.state_dir)
    held = "absent" if plan.evaluate else store_holds(service.store, plan)
    with service.submit_lock:
        if idempotency_key is not None and (same := service.db.by_key(idempotency_key)) is not None:
            if same.fingerprint != key:
                return JSONResponse({"detail": f"Idempotency-Key {idempotency_key} was used for another request "
                                               f"(job {same.id}); use a new key for a new request"},
                                    status_code=409)
            return _job_response(service.view(same), 200)
        existing = service.db.live_with(key)
        if existing is not None:
            if idempotency_key is not None and existing.idempotency_key is None:
                # The key now names this job: the same key with another body is a conflict,
                # not a new job.
                service.db.update(existing.id, idempotency_key=idempotency_key)
            return _job_response(service.view(existing), 200)
        if full is not None:
            raise full
        live = [] if held == "held" else service.db.in_state("queued", "running")
        if held == "held":
            job = service.db.create(key, plan, "succeeded", key=idempotency_key, reused=True)
        elif held == "writing" and not any(j.plan.run_id == plan.run_id for j in live):
            # Another process writes the run (a repair, a distill of the same images): it is not
            # absent, and a job now would only wait for it; the store answers again in a moment.
            raise Unavailable(f"the store's run {plan.run_id} is being written by another process (a `fadrm verify "
                              f"--repair`, or a distill of the same images); retry in {RETRY_S} s")
        elif (busy := sum(j.plan.eval_work for j in live)) + plan.eval_work > \
                (backlog := service.limits.eval_backlog) and plan.eval_work:
            return JSONResponse({"detail": f"the evaluations queued and running already train {busy} image-epochs; "
                                           f"this one's {plan.eval_work} would pass the service's {backlog} "
                                           f"(FADRM_MAX_EVAL_BACKLOG); retry later"},
                                status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})
        else:
            job = service.db.create(key, plan, "queued", key=idempotency_key, max_queued=service.max_queued)
    if job is None:
        return JSONResponse({"detail": f"{service.max_queued} jobs are waiting already; retry later"},
                            status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})
    if service.db.count() > service.max_job_records:  # the oldest finished records go now
        service.sweep()
    return _job_response(service.view(job), 202)

# The two endpoints clients poll run on the event loop (a few SQLite reads and a small file
# read each), and answer with the model serialized once.
@router.get("/v1/distillations", tags=["distillations"], dependencies=AUTH, responses=ERRORS,
         response_model=JobList)
async def list_jobs(service: ServiceDep, state: Literal[STATES] | None = None, limit: int = Query(20, ge=1, le=100),
                    cursor: str | None = Query(None, pattern=r"^[0-9]{1,18}$")):
    page = service.db.page_entries(state, limit + 1, int(cursor) if cursor else None)
    more = len(page) > limit
    page = page[:limit]
    return json_response(JobList(jobs=[service.view(j) for j in page], next_cursor=str(page[-1].seq) if more else None))

@router.get("/v1/distillations/{job_id}", tags=["distillations"], dependencies=AUTH, responses=JOB_ERRORS,
         response_model=Job)
async def get_job(service: ServiceDep, job_id: str = JobId):
    return json_response(service.view(service.entry(job_id)))

@router.delete("/v1/distillations/{job_id}", tags=["distillations"], dependencies=AUTH,
            responses={**JOB_ERRORS, 409: {"model": Problem}})
def cancel(service: ServiceDep, job_id: str = JobId) -> Job:
    job = service.job(job_id)
    if not service.drivers.cancel(job):
        job = service.job(job_id)
        raise Conflict(job.state, f"job {job.id} has already finished ({job.state}); only queued or running "
                                  "jobs can be cancelled")
    return service.view(service.job(job_id))

# What every download may answer beside 200 (api.web.downloads: RFC 9110's conditional and range requests).
DOWNLOAD = {**JOB_ERRORS,
            206: {"description": "the byte range asked for (Range; If-Range that matches)"},
            304: {"description": "not modified: If-None-Match matches the ETag, or If-Modified-Since is not older"},
            409: {"model": Problem, "description": "not succeeded, or its store files cannot be served (damaged, "
                                                   "incomplete); one line"},
            412: {"model": Problem, "description": "If-Match or If-Unmodified-Since does not hold"},
            416: {"model": Problem, "description": "the range lies past the end of the file"},
            503: {"model": Problem, "description": "the store is full, read-only or failing, or its run is being "
                                                   "repaired (see Retry-After)"}}


def _served(path, media_type: str, filename: str | None = None) -> FileAnswer:
    """The answer over `path`, opened now: inside `Service.serving`, so it is the job's file."""
    return FileAnswer(open(path, "rb"), media_type, filename=filename)


@router.get("/v1/distillations/{job_id}/dataset", tags=["results"], dependencies=AUTH, response_class=FileResponse,
         responses={**DOWNLOAD, 200: {"content": {"application/vnd.apache.parquet": {}, "application/zip": {}},
                                      "description": "the dataset file (Range requests resume it)"}})
def dataset(service: ServiceDep, job_id: str = JobId, format: Literal["parquet", "imagefolder"] = "parquet"):
    with service.serving(job_id) as job:
        files = service.db.files(job.id)
        if format == "imagefolder":
            path = service.build(job, files.imagefolder, write_imagefolder_zip)
            return _served(path, "application/zip", f"{job.id}-imagefolder.zip")
        path = service.build(job, files.dataset, functools.partial(write_dataset, job_id=job.id,
                                                                   evaluation_file=files.evaluation))
        return _served(path, "application/vnd.apache.parquet", f"{job.id}.parquet")


@router.get("/v1/distillations/{job_id}/preview.png", tags=["results"], dependencies=AUTH,
         response_class=FileResponse, responses={**DOWNLOAD, 200: {"content": {"image/png": {}}}})
def preview(service: ServiceDep, job_id: str = JobId):
    with service.serving(job_id) as job:
        return _served(service.build(job, service.db.files(job.id).preview, write_preview), "image/png")


@router.get("/v1/distillations/{job_id}/report", tags=["results"], dependencies=AUTH,
         responses={**JOB_ERRORS, 409: {"model": Problem}, 503: {"model": Problem}})
def job_report(service: ServiceDep, job_id: str = JobId) -> Report:
    with service.serving(job_id) as job:
        return Report(**report(run_dir(service.store, job.plan), job.plan, service.db.files(job.id).evaluation))


@router.get("/v1/distillations/{job_id}/recipe", tags=["results"], dependencies=AUTH, response_model=EvalConfig,
         responses={**JOB_ERRORS, 409: {"model": Problem}, 503: {"model": Problem}})
def recipe(service: ServiceDep, job_id: str = JobId):
    """The student recipe of the report's top-1: students trained on the images with the
    teachers' soft labels under these EvalConfig settings (those the job's evaluation ran
    with, else the defaults resolved for its images)."""
    with service.serving(job_id) as job:
        return json_response(job_recipe(job.plan, service.db.files(job.id).evaluation))


@router.get("/v1/distillations/{job_id}/soft-labels", tags=["results"], dependencies=AUTH,
         response_class=FileResponse,
         responses={**DOWNLOAD, 409: {"model": Problem,
                                      "description": "not finished, or its evaluation stored no soft labels"},
                    200: {"content": {"application/vnd.apache.parquet": {}},
                          "description": "the soft labels the job's students learnt from, one part per seed "
                                         "(`fadrm train-student --soft-labels`)"}})
def soft_labels(service: ServiceDep, job_id: str = JobId):
    """The soft labels the job's evaluation stored (a request with `evaluate: true` and
    `evaluation.soft_labels: stored`, with `soft_label_topk` and `soft_label_epochs` to keep
    them small): what a client trains from where the teacher stays on the server. Packed from
    the store's folders into one file at the first request, in bounded memory (api.jobs.job_outputs)."""
    with service.serving(job_id) as job:
        files = service.db.files(job.id)
        if not stored_labels(job.plan, files.evaluation):
            raise Conflict(job.state, f"job {job.id} stored no soft labels: submit with evaluate: true and "
                                      "evaluation {soft_labels: stored} (soft_label_topk and soft_label_epochs keep "
                                      "them small)")
        try:
            path = service.build(job, files.soft_labels,
                                 functools.partial(write_soft_labels, evaluation_file=files.evaluation))
        except SoftLabelDamaged:  # a 409 naming the file and the repair (service_errors), said once in the record
            raise
        except SoftLabelError:
            raise Conflict(job.state, f"the soft labels of job {job.id} are no longer in the store (its run "
                                      "was evaluated again or cleaned); submit the request again") from None
        return _served(path, "application/vnd.apache.parquet", f"{job.id}.soft-labels.parquet")


@router.get("/v1/distillations/{job_id}/teacher", tags=["results"], dependencies=AUTH, response_class=Response,
         responses={**DOWNLOAD,
                    200: {"content": {"application/octet-stream": {}},
                          "description": "the teacher checkpoint as it is (loads with torch.load(weights_only=True)"
                                         "); ETag and Repr-Digest carry its sha256"},
                    403: {"model": Problem, "description": "a wrong token, or the operator keeps teachers "
                                                           "private (FADRM_PRIVATE_TEACHERS)"},
                    404: {"model": Problem, "description": "no such job, or no teacher of that index"},
                    410: {"model": Problem, "description": "the teacher file changed or went away"}})
def teacher(service: ServiceDep, job_id: str = JobId,
            index: int = Query(0, ge=0, le=MAX_TEACHERS - 1, description="which teacher of a committee")):
    job = service.job(job_id)
    if service.private_teachers:
        base = f"/v1/distillations/{job.id}"
        raise HTTPException(403, "the operator of this service keeps teachers private (FADRM_PRIVATE_TEACHERS): "
                                 f"the teacher of job {job.id} is not served; GET {base}/recipe still gives the "
                                 "student recipe, and a request with evaluate: true reports the top-1 of students "
                                 f"trained here with the teacher (GET {base}/report) and, with evaluation "
                                 f"{{soft_labels: stored}}, the soft labels they learnt from (GET {base}/soft-labels)"
                                 "; the dataset's hard labels alone reach less")
    job = service.finished(job_id)
    names, refs = job.plan.teachers, job.plan.job.teachers
    if index >= len(refs):
        raise HTTPException(404, f"job {job.id} has {len(refs)} teacher{'s' if len(refs) > 1 else ''} "
                                 f"(index 0..{len(refs) - 1}); no teacher {index}")
    name, ref = names[index], refs[index]
    try:
        f, _ = open_teacher(ref.path, ref.sha256)
    except TeacherChanged:
        raise HTTPException(410, f"teacher {name} of job {job.id} is no longer the file the job was distilled "
                                 f"with (sha256 {ref.sha256[:12]}...): the operator changed or removed it") from None
    digest = base64.b64encode(bytes.fromhex(ref.sha256)).decode()
    # The bytes served are those whose sha256 was checked through this open file: the tag is theirs.
    return FileAnswer(f, "application/octet-stream", etag=f'"{ref.sha256}"', filename=f"{name}.pt",
                      headers={"Repr-Digest": f"sha-256=:{digest}:"})


def _job_response(job: Job, status: int) -> JSONResponse:
    return JSONResponse(job.model_dump(mode="json"), status_code=status, headers={"Location": job.links.self})
