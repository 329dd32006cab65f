"""The REST service: `create_app(settings)` builds the FastAPI application `fadrm serve` runs.

Every endpoint but /healthz requires `Authorization: Bearer <FADRM_API_TOKEN>` (compared in
constant time; 401 without one, 403 for a wrong one), the OpenAPI schema included; Swagger UI
and ReDoc are not served (their pages load from a CDN). Each token may make `rate_limit`
requests a second (429 past it); the probes (/healthz, /readyz) are answered before any rate
limit, from the readiness a thread checks (api.web.probes). A query string is as strict as a
body: a parameter the endpoint does not take, one given twice, or an integer not in plain digits
is a 422 naming it, checked after the token and its rate (api.web.refusals.strict_query). Bodies over `max_body_bytes` are refused
(413, in JSON) however they are sent (api.web.bodies); no path is redirected (a trailing slash is
a 404); ids and names are checked against their patterns (422) before anything touches the
store, and a 422 quotes little of the request (api.web.refusals). Requests without the token are
limited per address, and a request naming two body lengths is refused (api.web.http). Every GET
endpoint answers HEAD too (api.web.http). Work happens elsewhere: jobs are records
(`api.jobs.job_records`), run by driver processes on Ray (`api.jobs.drivers`), whose scheduler
(with the retention sweep) and the watch of the local Ray head run in threads of this process
(`api.web.service`). The endpoints are routers by resource (`api.web.routes`: health,
distillations, offered); this module puts them together with what every request passes through
(middleware, the exception handlers: every refusal is the JSON problem shape, the service's
errors each their status (api.contract.service_errors), a store that failed a request a 503 in
one line, and anything else a 500 whose traceback stays in the log).
"""
from __future__ import annotations

import contextlib
import logging
import sqlite3

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.contract.service_errors import Conflict, RequestInvalid, Unavailable, scrub, unavailable
from api.planning.service_settings import ServiceSettings
from api.web.bodies import BodyLimit, too_large
from api.web.http import AddressLimit, HeadAsGet, OneRequestLength, RateLimiter
from api.web.probes import Probes
from api.web.proxies import TrustedProxies
from api.web.refusals import problems, validation_refused
from api.web.routes import distillations, health, offered
from api.web.routes.dependencies import AUTH, TokenCheck
from api.web.service import Service

log = logging.getLogger("fadrm.api")
ROUTERS = (health.router, distillations.router, offered.router)


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
    # No slash redirects: `/v1/teachers/` is a 404, never a redirect whose Location a client's
    # Host header would build. The body limit is the service's own (api.web.bodies: a 413 in JSON).
    # Every endpoint's query string is checked as strictly as a body, after its token and the
    # token's rate (api.web.routes.dependencies.AUTH, api.web.refusals.strict_query).
    app = FastAPI(title="fadrm-ray", version="1", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None, redirect_slashes=False,
                  description="Request a FADRM-distilled dataset for a class subset; jobs run on Ray.")
    app.state.service = service
    # The token and its request rate (api.web.routes.dependencies.authorized).
    app.state.token_check = TokenCheck(settings.api_token, RateLimiter(settings.rate_limit, settings.rate_burst))
    app.add_middleware(HeadAsGet)
    # Outermost first: a request without the token is counted against its address before anything
    # else is done for it; then a request naming two lengths is refused; then the probes are
    # answered (api.web.probes: no rate limit, nothing else done for them); then a body too large
    # refused.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(Probes, readiness=service.readiness)
    app.add_middleware(OneRequestLength)
    app.add_middleware(AddressLimit, token=settings.api_token, exempt=frozenset({"/healthz"}),
                       limiter=RateLimiter(settings.anon_rate_limit, settings.anon_rate_burst))
    # Outermost: the client's address, from X-Forwarded-For where the peer is a named proxy.
    app.add_middleware(TrustedProxies, trusted=settings.trusted_proxies)

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
        if exc.status_code == 413:  # whichever layer refused it, say which limit
            exc = StarletteHTTPException(413, too_large(settings.max_body_bytes), headers={"Connection": "close"})
        return await http_exception_handler(request, exc)

    @app.exception_handler(Conflict)
    async def _conflict(request: Request, exc: Conflict):
        return JSONResponse({"detail": exc.message, "state": exc.state}, status_code=409)

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, exc: Unavailable):
        return JSONResponse({"detail": exc.message, "state": exc.state}, status_code=503,
                            headers={"Retry-After": str(exc.retry_after)})

    async def _store_failed(request: Request, exc: Exception):
        """A disk or the job records that failed a request outside a download (a submit, a
        listing): 503 in one line; the whole error goes to the service's log."""
        log.error("%s %s: %s", request.method, request.url.path, scrub(f"{type(exc).__name__}: {exc}")[:300])
        answer = unavailable(exc) or Unavailable("the service's store or its job records failed; retry later")
        return await _unavailable(request, answer)

    app.add_exception_handler(OSError, _store_failed)
    app.add_exception_handler(sqlite3.Error, _store_failed)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # the traceback goes to the log, not the client
        return JSONResponse({"detail": "internal error; the service's log has the details"}, status_code=500)

    @app.get("/openapi.json", include_in_schema=False, dependencies=AUTH)
    def openapi() -> JSONResponse:
        return JSONResponse(plain_tuples(app.openapi()))

    for router in ROUTERS:
        app.include_router(router)
    # Every endpoint, for the 405's Allow header: the app's own and each router's (an included
    # router is one entry of app.router.routes, not its endpoints).
    served = [r for r in app.router.routes if getattr(r, "methods", None)] + [r for router in ROUTERS
                                                                              for r in router.routes]
    return app


def plain_tuples(schema):
    """The schema with each fixed-length tuple of one item type (`prefixItems` of equal schemas,
    as pydantic writes `tuple[float, float]`) said as `items` with its length: the same values,
    in the words every OpenAPI tool reads (some still take `prefixItems` for a 3.0 list of `items`)."""
    if isinstance(schema, list):
        return [plain_tuples(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: plain_tuples(value) for key, value in schema.items()}
    prefix = out.get("prefixItems")
    if isinstance(prefix, list) and prefix and all(item == prefix[0] for item in prefix) and "items" not in out:
        del out["prefixItems"]
        out["items"] = prefix[0]
        out["minItems"] = out.get("minItems", len(prefix))
        out["maxItems"] = out.get("maxItems", len(prefix))
    return out
