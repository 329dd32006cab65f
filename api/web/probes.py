"""The probes: `/healthz` (alive: no token) and `/readyz` (ready: Ray reachable, the store
writable, the catalog read; the token, never a rate limit), answered from the process, never
from a client's budget nor behind the request path's work.

`Readiness` checks readiness in a thread of its own every READY_EVERY_S seconds and keeps the
answer as bytes; `Probes`, an ASGI middleware inside the token check (api.web.http.AddressLimit:
/readyz needs the token like every path but /healthz), answers both probes with those bytes
before routing, the body limit, the endpoints or any rate limit: a probe costs the parsing of its
request and one lookup, whatever the load, so a busy client never takes the pod out of its
Service. A query string is refused as every endpoint refuses an unknown parameter
(api.web.refusals.query_problems: a probe takes none).
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable

from api.contract.schemas import Ready
from api.web.refusals import query_problems

log = logging.getLogger("fadrm.api")
READY_EVERY_S = 1.0  # how often readiness is checked (an answer is at most this old)
HEALTHZ, READYZ = "/healthz", "/readyz"
_JSON = [(b"content-type", b"application/json")]
ALIVE = b'{"ok":true}'  # /healthz


class Readiness(threading.Thread):
    """`check()` (a `Ready`) every READY_EVERY_S seconds, kept as the status and bytes of /readyz."""

    def __init__(self, check: Callable[[], Ready]):
        super().__init__(name="fadrm-readiness", daemon=True)
        self.check, self.stopping = check, threading.Event()
        self._answer = self._encode(Ready(ready=False, ray=False, store=False, catalog=False,
                                          detail="the service is starting"))

    @staticmethod
    def _encode(ready: Ready) -> tuple[int, bytes]:
        return (200 if ready.ready else 503), ready.model_dump_json().encode()

    @property
    def answer(self) -> tuple[int, bytes]:
        """(status, JSON body) of /readyz as last checked."""
        return self._answer

    def refresh(self) -> None:
        try:
            ready = self.check()
        except Exception as exc:  # a check that fails is an answer too: not ready, saying why
            log.exception("the readiness check failed")
            ready = Ready(ready=False, ray=False, store=False, catalog=False,
                          detail=f"the readiness check failed ({type(exc).__name__})")
        self._answer = self._encode(ready)  # one assignment: a probe reads the old answer or the new

    def run(self) -> None:
        while True:
            self.refresh()
            if self.stopping.wait(READY_EVERY_S):
                return


class Probes:
    """ASGI middleware: GET and HEAD of /healthz and /readyz answered here (module docstring);
    every other request, another method of those paths included (a 405), goes on to the app."""

    def __init__(self, app, readiness: Readiness):
        self.app, self.readiness = app, readiness

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in (HEALTHZ, READYZ) or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        path = scope["path"]
        refused = query_problems(scope.get("query_string", b"").decode("latin-1"), {})
        if refused is not None:  # a probe takes no parameter
            status, body = 422, json.dumps(refused).encode()
        elif path == HEALTHZ:
            status, body = 200, ALIVE
        else:
            status, body = self.readiness.answer
        headers = [*_JSON, (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
