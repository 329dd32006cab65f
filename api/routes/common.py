"""What every router uses: the service (`ServiceDep`, from `app.state.service`), the token check
(`AUTH`: bearer token compared in constant time, then the token's request rate), the error
responses the schema names, and the job id path parameter."""
from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Path as PathParam, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.http import RateLimiter
from api.models import JOB_ID_PATTERN, Problem
from api.service import Service

JobId = PathParam(pattern=JOB_ID_PATTERN, description="a job id, as POST /v1/distillations returned it")
ERRORS = {401: {"model": Problem}, 403: {"model": Problem},
          429: {"model": Problem, "description": "this token's request rate is over the limit (see Retry-After)"}}
JOB_ERRORS = {**ERRORS, 404: {"model": Problem}}
_bearer = HTTPBearer(auto_error=False)


async def service_of(request: Request) -> Service:
    """The app's service (on the event loop: a dependency of sync endpoints costs no thread)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(service_of)]


async def token_only(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str:
    """401 without a bearer token, 403 for a wrong one (no rate limit: the probes'); the token."""
    settings = request.app.state.service.settings
    if credentials is None:
        raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)",
                            headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(credentials.credentials.encode(), settings.api_token.encode()):
        raise HTTPException(403, "the bearer token is not valid for this service")
    return credentials.credentials


async def authorized(request: Request, token: str = Depends(token_only)) -> None:
    """`token_only`, then 429 past the token's request rate."""
    settings = request.app.state.service.settings
    limiter: RateLimiter = request.app.state.token_limiter
    if (wait := limiter.retry_after(token)) is not None:
        raise HTTPException(429, f"more than {settings.rate_limit:g} requests a second with this token; "
                                 f"retry in {wait} s", headers={"Retry-After": str(wait)})


AUTH = [Depends(authorized)]
TOKEN_ONLY = [Depends(token_only)]


def json_response(model) -> Response:
    """A model serialized once (what the polled endpoints answer)."""
    return Response(model.model_dump_json(), media_type="application/json")
