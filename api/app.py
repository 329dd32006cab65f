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
retention sweep) and the watch of the local Ray head run in threads of this process (`api.service`).
The endpoints are routers by resource (`api.routes`: health, distillations, catalog); this module
puts them together with what every request passes through (middleware, the exception handlers).
"""
from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.config import ServiceSettings
from api.http import AddressLimit, HeadAsGet, OneRequestLength, RateLimiter
from api.refusals import problems, validation_refused
from api.requests import RequestInvalid
from api.routes import catalog, distillations, health
from api.routes.common import AUTH
from api.service import Conflict, Service

ROUTERS = (health.router, distillations.router, catalog.router)


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
    app.state.token_limiter = RateLimiter(settings.rate_limit, settings.rate_burst)  # api.routes.common.authorized
    app.add_middleware(HeadAsGet)
    # Outermost first: a request without the token is counted against its address before anything
    # else is done for it; then a request naming two lengths is refused.
    app.add_middleware(OneRequestLength)
    app.add_middleware(AddressLimit, token=settings.api_token, exempt=frozenset({"/healthz"}),
                       limiter=RateLimiter(settings.anon_rate_limit, settings.anon_rate_burst))

    app.add_exception_handler(RequestValidationError, validation_refused)

    @app.exception_handler(RequestInvalid)
    async def _invalid(request: Request, exc: RequestInvalid):
        return JSONResponse(problems([{"loc": exc.loc, "msg": str(exc), "type": "value_error"}]), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:  # name every method of the path, not only those of the first route
            allowed = {m for route in served if route.matches(request.scope)[0] != Match.NONE
                       for m in getattr(route, "methods", None) or ()}
            allowed |= {"HEAD"} if "GET" in allowed else set()  # HeadAsGet answers HEAD for each GET
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(sorted(allowed))}
        if exc.status_code == 413:  # Starlette's limit says "Content Too Large"; say which limit
            exc = StarletteHTTPException(413, f"request body larger than {settings.max_body_bytes} bytes")
        return await http_exception_handler(request, exc)

    @app.exception_handler(Conflict)
    async def _conflict(request: Request, exc: Conflict):
        return JSONResponse({"detail": exc.message, "state": exc.job.state}, status_code=409)

    @app.get("/openapi.json", include_in_schema=False, dependencies=AUTH)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    for router in ROUTERS:
        app.include_router(router)
    # Every endpoint, for the 405's Allow header: the app's own and each router's (an included
    # router is one entry of app.router.routes, not its endpoints).
    served = [r for r in app.router.routes if getattr(r, "methods", None)] + [r for router in ROUTERS
                                                                              for r in router.routes]
    return app
