"""What every router uses: the service (`ServiceDep`, from `app.state.service`), the token check
(`AUTH`: the bearer token of `app.state.token_check` compared in constant time, then the token's
request rate, then the query string as strict as a body), the error responses the schema names, and the job id path parameter."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, HTTPException, Path as PathParam, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.contract.schemas import JOB_ID_PATTERN, Problem
from api.web.http import RateLimiter
from api.web.refusals import strict_query
from api.web.service import Service

JobId = PathParam(pattern=JOB_ID_PATTERN, description="a job id, as POST /v1/distillations returned it")
ERRORS = {401: {"model": Problem}, 403: {"model": Problem},
          429: {"model": Problem, "description": "this token's request rate is over the limit (see Retry-After)"}}
JOB_ERRORS = {**ERRORS, 404: {"model": Problem}}
_bearer = HTTPBearer(auto_error=False)


@dataclass(frozen=True)
class TokenCheck:
    """The service's bearer token (FADRM_API_TOKEN) and the request rate of a token (`limiter`:
    FADRM_RATE_LIMIT, FADRM_RATE_BURST), on `app.state.token_check`."""

    token: str = field(repr=False)
    limiter: RateLimiter


async def service_of(request: Request) -> Service:
    """The app's service (on the event loop: a dependency of sync endpoints costs no thread)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(service_of)]


async def token_only(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str:
    """401 without a bearer token, 403 for a wrong one (no rate limit: the probes'); the token."""
    check: TokenCheck = request.app.state.token_check
    if credentials is None:
        raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)",
                            headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(credentials.credentials.encode(), check.token.encode()):
        raise HTTPException(403, "the bearer token is not valid for this service")
    return credentials.credentials


async def authorized(request: Request, token: str = Depends(token_only)) -> None:
    """`token_only`, then 429 past the token's request rate."""
    limiter = request.app.state.token_check.limiter
    if (wait := limiter.retry_after(token)) is not None:
        raise HTTPException(429, f"more than {limiter.rate:g} requests a second with this token; "
                                 f"retry in {wait} s", headers={"Retry-After": str(wait)})


# The query string is checked after the token and its rate (a refused one is not free of the rate).
AUTH = [Depends(authorized), Depends(strict_query)]
TOKEN_ONLY = [Depends(token_only), Depends(strict_query)]


def json_response(model) -> Response:
    """A model serialized once (what the polled endpoints answer)."""
    return Response(model.model_dump_json(), media_type="application/json")
