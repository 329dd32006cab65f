"""The REST service: `create_app(settings)` builds the FastAPI application `fadrm serve` runs.

Every endpoint but /healthz requires `Authorization: Bearer <FADRM_API_TOKEN>` (compared in
constant time; 401 without one, 403 for a wrong one), the OpenAPI schema included; Swagger UI
and ReDoc are not served (their pages load from a CDN). Each token may make `rate_limit`
requests a second (429 past it). Bodies over `max_body_bytes` are refused (413) however they are
sent (FastAPI's `max_body_size`); ids and names are checked against their patterns (422) before
anything touches the store, and a 422 quotes little of the request (api.refusals). Requests
without the token are limited per address, and a request naming two body lengths is refused
(api.http). Every GET endpoint answers HEAD too (api.http). Work happens elsewhere: jobs are
records (`api.job_records`), run by driver processes on Ray (`api.drivers`), whose scheduler (with the
retention sweep) and the watch of the local Ray head run in threads of this process.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import logging
import secrets
import shutil
import threading
import time
from typing import Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Path as PathParam, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from fadrm_ray.config import PRESETS, make_config
from fadrm_ray.settings import EvalConfig
from fadrm_ray.soft_label_store import SoftLabelError

from api.catalog import Catalog
from api.config import ServiceSettings, SettingsError
from api.errors import clean_line
from api.drivers import DriverSupervisor
from api.http import AddressLimit, HeadAsGet, OneRequestLength, RateLimiter
from api.job_records import JobDB, JobRecord, UnreadableJob
from api.models import (FINAL_STATES, JOB_ID_PATTERN, MAX_TEACHERS, STATES, DatasetInfo, DistillationRequest, Job,
                        JobAsked, JobList, Problem, Ready, Report, TeacherInfo)
from api.outputs import (TeacherChanged, file_chunks, job_recipe, open_teacher, progress, report, stored_labels,
                         write_dataset, write_imagefolder_zip, write_preview, write_soft_labels)
from api.refusals import body_shape, problems, utf8_body, validation_refused
from api.requests import RequestInvalid, images_in_store, plan_request, run_dir

log = logging.getLogger("fadrm.api")
TICK_S = 0.5
RAY_WATCH_S = 2.0  # how often the local Ray head is checked (and started again when it is gone)
SWEEP_MAX_S = 60.0  # how often, at most, job records past their retention are removed
RETRY_AFTER_S = 30
# What api.refusals.body_shape checks of a POST body before pydantic does.
REQUEST_FIELDS = frozenset(DistillationRequest.model_fields)
REQUEST_LISTS = {"classes": (int, str)}
JobId = PathParam(pattern=JOB_ID_PATTERN, description="a job id, as POST /v1/distillations returned it")
ERRORS = {401: {"model": Problem}, 403: {"model": Problem},
          429: {"model": Problem, "description": "this token's request rate is over the limit (see Retry-After)"}}
JOB_ERRORS = {**ERRORS, 404: {"model": Problem}}


class Scheduler(threading.Thread):
    """Runs `drivers.tick` every TICK_S seconds, and `sweep` (retention) every `sweep_every`."""

    def __init__(self, drivers: DriverSupervisor, sweep, sweep_every: float):
        super().__init__(name="fadrm-scheduler", daemon=True)
        self.drivers, self.stopping = drivers, threading.Event()
        self.sweep, self.sweep_every = sweep, sweep_every

    def run(self) -> None:
        next_sweep = 0.0
        while not self.stopping.wait(TICK_S):
            try:
                self.drivers.tick()
            except Exception:  # keep scheduling; the next tick retries
                log.exception("scheduler tick failed")
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + self.sweep_every
                try:
                    self.sweep()
                except Exception:
                    log.exception("removing expired job records failed")


class RayWatch(threading.Thread):
    """Keeps the service's local Ray head up: starts it at once (not at the first job), checks it
    every RAY_WATCH_S seconds and starts it again when it is gone, waiting longer after each
    start that fails (up to a minute) and logging one line for each."""

    def __init__(self, drivers: DriverSupervisor):
        super().__init__(name="fadrm-ray-watch", daemon=True)
        self.drivers, self.stopping = drivers, threading.Event()
        self.error: str | None = None  # why the last start failed, for /readyz

    def run(self) -> None:
        wait = 0.0
        while not self.stopping.wait(wait):
            try:
                if self.drivers.local is None:
                    return
                self.drivers.keep_ray()
                self.error, wait = None, RAY_WATCH_S
            except Exception as exc:
                self.error = clean_line(str(exc), 200)
                log.warning("the local Ray head could not be started: %s", self.error)
                wait = min(60.0, max(RAY_WATCH_S, 2 * wait))


class Service:
    """What the endpoints share: settings, catalog, job records, the driver supervisor."""

    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        self._server_lock = open(settings.state_dir / "server.lock", "w")
        try:
            fcntl.flock(self._server_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._server_lock.close()
            raise SettingsError(f"another fadrm serve is using the store {settings.store}") from None
        self.catalog = Catalog(settings)
        self.db = JobDB(settings.state_dir)
        self.drivers = DriverSupervisor(settings, self.db)
        self.scheduler = Scheduler(self.drivers, self.sweep,
                                   max(TICK_S, min(SWEEP_MAX_S, settings.job_retention / 4)))
        self.ray_watch = RayWatch(self.drivers)
        self.submit_lock = threading.Lock()
        self.build_locks: dict[str, threading.Lock] = {}
        self.final_progress: dict[str, tuple] = {}

    def start(self) -> None:
        self.ray_watch.start()
        self.scheduler.start()

    def stop(self) -> None:
        self.ray_watch.stopping.set()
        self.scheduler.stopping.set()
        self.scheduler.join(timeout=30)
        self.ray_watch.join(timeout=30)
        self.drivers.shutdown()
        self.db.close()
        self._server_lock.close()

    def view(self, job: JobRecord | UnreadableJob) -> Job:
        if isinstance(job, UnreadableJob):
            return _unreadable_view(job)
        plan = job.plan
        if job.id in self.final_progress:  # a finished job's progress never changes
            prog, eta = self.final_progress[job.id]
        else:
            prog, eta = progress(run_dir(self.settings, plan), plan, job.state, job.started_at)
            if job.state in FINAL_STATES:
                self.final_progress[job.id] = (prog, eta)
        asked = {name: getattr(plan, name) for name in JobAsked.model_fields}
        return Job(id=job.id, state=job.state, run_id=plan.run_id, **asked, reused=job.reused, progress=prog,
                   timings=_timings(job), eta_seconds=eta, error=job.error, links=_links(job.id))

    def sweep(self) -> int:
        """Remove the finished jobs past FADRM_JOB_RETENTION, and the oldest finished ones past
        FADRM_MAX_JOB_RECORDS: their records and their folders (plan, log, outcome, the files
        built for downloads), never a run in the store, which other jobs may share. A job whose
        leftovers are not tidied yet stays until they are. How many went."""
        spare = set(self.drivers.ending.copy())
        gone = self.db.expired(time.time() - self.settings.job_retention, self.settings.max_job_records, spare)
        if not gone:
            return 0
        self.db.delete(gone)
        jobs_dir = self.settings.state_dir / "jobs"
        for job_id in gone:
            folder = self.db.files(job_id).root
            if folder.parent == jobs_dir:
                shutil.rmtree(folder, ignore_errors=True)
            self.final_progress.pop(job_id, None)
            self.build_locks.pop(job_id, None)
        log.info("removed %d finished job record(s) past retention or the record cap", len(gone))
        return len(gone)

    def entry(self, job_id: str) -> JobRecord | UnreadableJob:
        """The job, readable by this version or not; 404 when there is none."""
        job = self.db.entry(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job

    def job(self, job_id: str) -> JobRecord:
        """The job with its plan; 409 for a record this version cannot read (nothing of it is served)."""
        job = self.entry(job_id)
        if isinstance(job, UnreadableJob):
            raise _Conflict(job, f"job {job.id}'s record could not be read after an upgrade of the service "
                                 f"({clean_line(job.why, 200)}): it is only listed; submit the request again")
        return job

    def finished(self, job_id: str) -> JobRecord:
        job = self.job(job_id)
        if job.state in ("queued", "running"):
            raise _Conflict(job, f"job {job.id} is {job.state}: its results are served once it has succeeded")
        if job.state != "succeeded":
            raise _Conflict(job, f"job {job.id} {job.state}: it has no results; submit the request again for a new job")
        return job

    def build(self, job: JobRecord, path, writer):
        """A job's file, written once (one writer at a time) and then served as it is."""
        lock = self.build_locks.setdefault(job.id, threading.Lock())
        with lock:
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                writer(run_dir(self.settings, job.plan), job.plan, path)
        return path


class _Conflict(Exception):
    """409: the job is not in a state the request needs; `message` says which and why."""

    def __init__(self, job: JobRecord | UnreadableJob, message: str):
        super().__init__(message)
        self.job, self.message = job, message


def _timings(job: JobRecord | UnreadableJob) -> dict:
    end = job.finished_at
    return {"created_at": _iso(job.created_at), "started_at": _iso(job.started_at), "finished_at": _iso(end),
            "queued_seconds": _span(job.created_at, job.started_at or end),
            "running_seconds": _span(job.started_at, end) if job.started_at else None}


def _links(job_id: str) -> dict:
    base = f"/v1/distillations/{job_id}"
    return {"self": base, "dataset": f"{base}/dataset", "preview": f"{base}/preview.png", "report": f"{base}/report",
            "teacher": f"{base}/teacher", "recipe": f"{base}/recipe"}


# What a record this version cannot read shows for each field of the request it cannot read.
_UNKNOWN_ASKED = {"dataset": "", "teachers": [], "classes": [], "class_names": [], "ipc": 0, "preset": "", "seed": 0,
                  "evaluate": False, "baselines": False}


def _unreadable_view(job: UnreadableJob) -> Job:
    """A job whose record this version cannot read: what can be read of its request, each field
    where it has the type the field needs, else empty; its error says why nothing else is."""
    raw = job.asked()
    asked = {}
    for name, empty in _UNKNOWN_ASKED.items():
        try:
            asked[name] = TypeAdapter(JobAsked.model_fields[name].annotation).validate_python(raw.get(name, empty))
        except ValueError:
            asked[name] = empty
    run_id = raw.get("run_id") if isinstance(raw.get("run_id"), str) else ""
    error = job.error or (f"this job's record could not be read after an upgrade of the service "
                          f"({clean_line(job.why, 200)}); it is only listed")
    return Job(id=job.id, state=job.state, run_id=run_id, **asked, reused=job.reused, progress={},
               timings=_timings(job), error=error, links=_links(job.id))


def _iso(t: float | None) -> str | None:
    import datetime as dt

    return None if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")


def _span(a: float | None, b: float | None) -> float | None:
    import time

    return None if a is None else round((b or time.time()) - a, 3)


def create_app(settings: ServiceSettings) -> FastAPI:
    service = Service(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            service.stop()

    # The schema is served below, behind the token; the interactive docs are off because their
    # pages load Swagger UI and ReDoc from a CDN (nothing in the installed packages ships them).
    app = FastAPI(title="fadrm-ray", version="1", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None, max_body_size=settings.max_body_bytes,
                  description="Request a FADRM-distilled dataset for a class subset; jobs run on Ray.")
    app.state.service = service
    app.add_middleware(HeadAsGet)
    # Outermost first: a request without the token is counted against its address before anything
    # else is done for it; then a request naming two lengths is refused.
    app.add_middleware(OneRequestLength)
    app.add_middleware(AddressLimit, token=settings.api_token, exempt=frozenset({"/healthz"}),
                       limiter=RateLimiter(settings.anon_rate_limit, settings.anon_rate_burst))
    bearer = HTTPBearer(auto_error=False)
    limiter = RateLimiter(settings.rate_limit, settings.rate_burst)

    async def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if credentials is None:
            raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)",
                                headers={"WWW-Authenticate": "Bearer"})
        if not secrets.compare_digest(credentials.credentials.encode(), settings.api_token.encode()):
            raise HTTPException(403, "the bearer token is not valid for this service")
        if (wait := limiter.retry_after(credentials.credentials)) is not None:
            raise HTTPException(429, f"more than {settings.rate_limit:g} requests a second with this token; "
                                     f"retry in {wait} s", headers={"Retry-After": str(wait)})

    app.add_exception_handler(RequestValidationError, validation_refused)

    @app.exception_handler(RequestInvalid)
    async def _invalid(request: Request, exc: RequestInvalid):
        return JSONResponse(problems([{"loc": exc.loc, "msg": str(exc), "type": "value_error"}]), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:  # name every method of the path, not only those of the first route
            allowed = {m for route in app.router.routes if route.matches(request.scope)[0] != Match.NONE
                       for m in getattr(route, "methods", None) or ()}
            allowed |= {"HEAD"} if "GET" in allowed else set()  # HeadAsGet answers HEAD for each GET
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(sorted(allowed))}
        if exc.status_code == 413:  # Starlette's limit says "Content Too Large"; say which limit
            exc = StarletteHTTPException(413, f"request body larger than {settings.max_body_bytes} bytes")
        return await http_exception_handler(request, exc)

    @app.exception_handler(_Conflict)
    async def _conflict(request: Request, exc: _Conflict):
        return JSONResponse({"detail": exc.message, "state": exc.job.state}, status_code=409)

    auth = [Depends(authorized)]
    request_shape = body_shape(REQUEST_FIELDS, REQUEST_LISTS)

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/healthz", tags=["service"])  # no token, no rate limit: what probes and balancers ask
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/readyz", tags=["service"], dependencies=auth, responses={**ERRORS, 503: {"model": Ready}})
    def readyz() -> Ready:
        ray_ok = service.drivers.ray_reachable()
        store_ok = _writable(settings.state_dir)
        why = service.ray_watch.error
        ready = Ready(ready=ray_ok and store_ok, ray=ray_ok, store=store_ok,
                      detail=None if ray_ok else f"Ray is not reachable: {why}" if why else "Ray is not reachable (yet)")
        return ready if ready.ready else JSONResponse(ready.model_dump(), status_code=503)

    @app.post("/v1/distillations", status_code=202, tags=["distillations"], dependencies=[*auth, Depends(utf8_body), Depends(request_shape)],
              responses={**ERRORS, 200: {"model": Job, "description": "the same request: the job made before"},
                         400: {"model": Problem, "description": "a body that is not UTF-8 JSON text"},
                         409: {"model": Problem, "description": "the Idempotency-Key was used for another request"},
                         413: {"model": Problem},
                         429: {"model": Problem, "description": "too many jobs waiting, or too many requests"}})
    def submit(body: DistillationRequest,
               idempotency_key: str | None = Header(None, pattern=r"^[A-Za-z0-9._:-]{1,200}$")) -> Job:
        plan = plan_request(body, service.catalog, settings)
        key = plan.fingerprint()
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
            if not plan.evaluate and images_in_store(settings, plan):
                job = service.db.create(key, plan, "succeeded", key=idempotency_key, reused=True)
            else:
                job = service.db.create(key, plan, "queued", key=idempotency_key, max_queued=settings.max_queued)
        if job is None:
            return JSONResponse({"detail": f"{settings.max_queued} jobs are waiting already; retry later"},
                                status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})
        if service.db.count() > settings.max_job_records:  # the oldest finished records go now
            service.sweep()
        return _job_response(service.view(job), 202)

    # The two endpoints clients poll run on the event loop (a few SQLite reads and a small file
    # read each), and answer with the model serialized once.
    @app.get("/v1/distillations", tags=["distillations"], dependencies=auth, responses=ERRORS,
             response_model=JobList)
    async def list_jobs(state: Literal[STATES] | None = None, limit: int = Query(20, ge=1, le=100),
                        cursor: str | None = Query(None, pattern=r"^[0-9]{1,18}$")):
        page = service.db.page_entries(state, limit + 1, int(cursor) if cursor else None)
        more = len(page) > limit
        page = page[:limit]
        return _json(JobList(jobs=[service.view(j) for j in page], next_cursor=str(page[-1].seq) if more else None))

    @app.get("/v1/distillations/{job_id}", tags=["distillations"], dependencies=auth, responses=JOB_ERRORS,
             response_model=Job)
    async def get_job(job_id: str = JobId):
        return _json(service.view(service.entry(job_id)))

    @app.delete("/v1/distillations/{job_id}", tags=["distillations"], dependencies=auth,
                responses={**JOB_ERRORS, 409: {"model": Problem}})
    def cancel(job_id: str = JobId) -> Job:
        job = service.job(job_id)
        if not service.drivers.cancel(job):
            job = service.job(job_id)
            raise _Conflict(job, f"job {job.id} has already finished ({job.state}); only queued or running jobs "
                                 "can be cancelled")
        return service.view(service.job(job_id))

    @app.get("/v1/distillations/{job_id}/dataset", tags=["results"], dependencies=auth, response_class=FileResponse,
             responses={**JOB_ERRORS, 409: {"model": Problem},
                        200: {"content": {"application/vnd.apache.parquet": {}, "application/zip": {}},
                              "description": "the dataset file (Range requests resume it)"}})
    def dataset(job_id: str = JobId, format: Literal["parquet", "imagefolder"] = "parquet"):
        job = service.finished(job_id)
        files = service.db.files(job.id)
        if format == "imagefolder":
            path = service.build(job, files.imagefolder, write_imagefolder_zip)
            return FileResponse(path, media_type="application/zip", filename=f"{job.id}-imagefolder.zip")
        path = service.build(job, files.dataset, functools.partial(write_dataset, job_id=job.id,
                                                                   evaluation_file=files.evaluation))
        return FileResponse(path, media_type="application/vnd.apache.parquet", filename=f"{job.id}.parquet")

    @app.get("/v1/distillations/{job_id}/preview.png", tags=["results"], dependencies=auth,
             response_class=FileResponse,
             responses={**JOB_ERRORS, 409: {"model": Problem}, 200: {"content": {"image/png": {}}}})
    def preview(job_id: str = JobId):
        job = service.finished(job_id)
        return FileResponse(service.build(job, service.db.files(job.id).preview, write_preview), media_type="image/png")

    @app.get("/v1/distillations/{job_id}/report", tags=["results"], dependencies=auth,
             responses={**JOB_ERRORS, 409: {"model": Problem}})
    def job_report(job_id: str = JobId) -> Report:
        job = service.finished(job_id)
        return Report(**report(run_dir(settings, job.plan), job.plan, service.db.files(job.id).evaluation))

    @app.get("/v1/distillations/{job_id}/recipe", tags=["results"], dependencies=auth, response_model=EvalConfig,
             responses={**JOB_ERRORS, 409: {"model": Problem}})
    def recipe(job_id: str = JobId):
        """The student recipe of the report's top-1: students trained on the images with the
        teachers' soft labels under these EvalConfig settings (those the job's evaluation ran
        with, else the defaults resolved for its images)."""
        job = service.finished(job_id)
        return _json(job_recipe(job.plan, service.db.files(job.id).evaluation))

    @app.get("/v1/distillations/{job_id}/soft-labels", tags=["results"], dependencies=auth,
             response_class=FileResponse,
             responses={**JOB_ERRORS, 409: {"model": Problem,
                                            "description": "not finished, or its evaluation stored no soft labels"},
                        200: {"content": {"application/vnd.apache.parquet": {}},
                              "description": "the soft labels the job's students learnt from, one part per seed "
                                             "(`fadrm train-student --soft-labels`)"}})
    def soft_labels(job_id: str = JobId):
        """The soft labels the job's evaluation stored (a request with `evaluate: true` and
        `evaluation.soft_labels: stored`, with `soft_label_topk` and `soft_label_epochs` to keep
        them small): what a client trains from where the teacher stays on the server."""
        job = service.finished(job_id)
        files = service.db.files(job.id)
        if not stored_labels(job.plan, files.evaluation):
            raise _Conflict(job, f"job {job.id} stored no soft labels: submit with evaluate: true and evaluation "
                                 "{soft_labels: stored} (soft_label_topk and soft_label_epochs keep them small)")
        try:
            path = service.build(job, files.soft_labels,
                                 functools.partial(write_soft_labels, evaluation_file=files.evaluation))
        except SoftLabelError:
            raise _Conflict(job, f"the soft labels of job {job.id} are no longer in the store (its run was "
                                 "evaluated again or cleaned); submit the request again") from None
        return FileResponse(path, media_type="application/vnd.apache.parquet", filename=f"{job.id}.soft-labels.parquet")

    @app.get("/v1/distillations/{job_id}/teacher", tags=["results"], dependencies=auth, response_class=Response,
             responses={**JOB_ERRORS,
                        200: {"content": {"application/octet-stream": {}},
                              "description": "the teacher checkpoint as it is (loads with torch.load(weights_only=True)"
                                             "); ETag and Repr-Digest carry its sha256"},
                        403: {"model": Problem, "description": "a wrong token, or the operator keeps teachers "
                                                               "private (FADRM_PRIVATE_TEACHERS)"},
                        404: {"model": Problem, "description": "no such job, or no teacher of that index"},
                        409: {"model": Problem}, 410: {"model": Problem,
                                                       "description": "the teacher file changed or went away"}})
    def teacher(job_id: str = JobId,
                index: int = Query(0, ge=0, le=MAX_TEACHERS - 1, description="which teacher of a committee")):
        job = service.job(job_id)
        if settings.private_teachers:
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
            f, size = open_teacher(ref.path, ref.sha256)
        except TeacherChanged:
            raise HTTPException(410, f"teacher {name} of job {job.id} is no longer the file the job was distilled "
                                     f"with (sha256 {ref.sha256[:12]}...): the operator changed or removed it") from None
        digest = base64.b64encode(bytes.fromhex(ref.sha256)).decode()
        return StreamingResponse(file_chunks(f), media_type="application/octet-stream",
                                 headers={"Content-Length": str(size), "ETag": f'"{ref.sha256}"',
                                          "Repr-Digest": f"sha-256=:{digest}:",
                                          "Content-Disposition": f'attachment; filename="{name}.pt"'})

    @app.get("/v1/datasets", tags=["catalog"], dependencies=auth, responses=ERRORS)
    def datasets() -> list[DatasetInfo]:
        out = []
        for name in service.catalog.dataset_names():
            try:
                d = service.catalog.dataset(name).describe()
            except Exception as exc:  # an operator's dataset that cannot be read now: listed by name only
                log.warning("dataset %s: %s", name, exc)
                continue
            out.append(DatasetInfo(**{**d, "name": name}))
        return out

    @app.get("/v1/teachers", tags=["catalog"], dependencies=auth, responses=ERRORS)
    def teachers() -> list[TeacherInfo]:
        out = []
        for name in service.catalog.teacher_names():
            try:
                info = service.catalog.teacher(name).info
            except Exception as exc:  # not a readable fadrm checkpoint: not offered
                log.warning("teacher %s: %s", name, exc)
                continue
            accuracy = info.test_accuracy if info.test_accuracy == info.test_accuracy else None
            out.append(TeacherInfo(name=name, model=info.model_name, dataset=info.dataset, num_classes=info.num_classes,
                                   class_names=list(info.class_names), image_size=info.image_size,
                                   in_chans=info.in_chans, test_accuracy=accuracy))
        return out

    @app.get("/v1/presets", tags=["catalog"], dependencies=auth, responses=ERRORS)
    def presets() -> dict[str, dict]:
        return {name: make_config(name).to_dict() for name in PRESETS}

    return app


def _json(model) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _job_response(job: Job, status: int) -> JSONResponse:
    return JSONResponse(job.model_dump(mode="json"), status_code=status, headers={"Location": job.links.self})


def _writable(folder) -> bool:
    try:
        probe = folder / f".probe-{secrets.token_hex(4)}"
        probe.write_bytes(b"ok")
        probe.unlink()
        return True
    except OSError:
        return False
