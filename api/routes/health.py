"""/healthz (open: what probes and balancers ask) and /readyz (Ray reachable, store writable)."""
from __future__ import annotations

import secrets

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.models import Ready
from api.routes.common import AUTH, ERRORS, ServiceDep

router = APIRouter(tags=["service"])


@router.get("/healthz")  # no token, no rate limit; on the event loop, never waiting for a worker thread
async def healthz() -> dict[str, bool]:
    return {"ok": True}


@router.get("/readyz", dependencies=AUTH, responses={**ERRORS, 503: {"model": Ready}})
def readyz(service: ServiceDep) -> Ready:
    ray_ok = service.drivers.ray_reachable()
    store_ok = _writable(service.settings.state_dir)
    why = service.ray_watch.error
    ready = Ready(ready=ray_ok and store_ok, ray=ray_ok, store=store_ok,
                  detail=None if ray_ok else f"Ray is not reachable: {why}" if why else "Ray is not reachable (yet)")
    return ready if ready.ready else JSONResponse(ready.model_dump(), status_code=503)


def _writable(folder) -> bool:
    try:
        probe = folder / f".probe-{secrets.token_hex(4)}"
        probe.write_bytes(b"ok")
        probe.unlink()
        return True
    except OSError:
        return False
