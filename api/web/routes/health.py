"""/healthz (open: what probes and balancers ask) and /readyz (Ray reachable, the store writable,
the catalog read; the token, no rate limit). Both are answered from the readiness the service
checks in a thread of its own (api.web.probes): `api.web.probes.Probes` answers GET and HEAD
before routing; these routes are what the schema shows of them, and answer the same bytes."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from api.contract.schemas import Ready
from api.web.probes import ALIVE
from api.web.refusals import strict_query
from api.web.routes.dependencies import ERRORS, TOKEN_ONLY, ServiceDep

router = APIRouter(tags=["service"])
_NOT_LIMITED = {k: v for k, v in ERRORS.items() if k != 429}


@router.get("/healthz", dependencies=[Depends(strict_query)], response_model=dict[str, bool])  # no token, no rate limit
async def healthz() -> Response:
    return Response(ALIVE, media_type="application/json")


@router.get("/readyz", dependencies=TOKEN_ONLY, response_model=Ready, responses={**_NOT_LIMITED, 503: {"model": Ready}})
async def readyz(service: ServiceDep) -> Response:
    status, body = service.readiness.answer
    return Response(body, status_code=status, media_type="application/json")
