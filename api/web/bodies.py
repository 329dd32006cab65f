"""Request bodies, bounded and parsed without surprises: the size limit (`BodyLimit`, a 413 in the
service's JSON problem shape however the body is sent) and the one parse the refusal layer makes
of a body (`request_json`: never raises, whatever the content type, depth or size).

Starlette's own limit answered a body announced over it with a `text/plain` "Content Too Large"
(and replaced any other answer to such a request with it, the 401 of a request without a token
included), often closing the connection with the body unread, which a client sees as a reset.
Here a body announced over the limit is refused before anything reads it, after reading and
dropping what the client sends of it up to DRAIN_BYTES (so the answer reaches a client that
sends its whole body before it reads), with `Connection: close`; one sent chunked is counted as
it is read and refused as soon as it passes the limit.
"""
from __future__ import annotations

import json

from starlette.exceptions import HTTPException

DRAIN_BYTES = 1 << 20  # of a body announced too large, read and dropped before answering (else: closed)
JSON_TYPES = ("application/json",)


def too_large(limit: int) -> str:
    return f"request body larger than {limit} bytes (FADRM_MAX_BODY_BYTES)"


class BodyLimit:
    """ASGI middleware: bodies of at most `limit` bytes (413 in the JSON problem shape past it)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        announced, expects = None, False
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                announced = int(value)
            elif name == b"expect":
                expects = value.lower() == b"100-continue"
        if announced is not None and announced > self.limit:
            return await self._refuse(receive, send, drain=not expects and announced <= DRAIN_BYTES)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # raised inside the endpoint: its handler answers in JSON
                    raise HTTPException(413, too_large(self.limit))
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, receive, send, drain: bool) -> None:
        """413 before the body is read. A client that announced a body within DRAIN_BYTES, and
        did not ask to be told first (Expect: 100-continue), has it read and dropped, so the
        connection closes with nothing unread (no reset in place of the answer)."""
        if drain:
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        body = json.dumps({"detail": too_large(self.limit)}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def is_json_type(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON: application/json or
    application/*+json; a body without a content type is not (FastAPI's strict content type)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


async def request_json(request):
    """The body as JSON, or None where FastAPI would not read it as JSON (another content type) or
    it is not JSON: not UTF-8, malformed, nested deeper than the parser goes (RecursionError), or
    anything else a parser may raise. The refusal of those is FastAPI's (400 or 422). Parsed once
    a request: FastAPI parses an endpoint's JSON body before its dependencies run, and Starlette
    keeps that parse on the request (`Request.json`), which this reads."""
    if not is_json_type(request.headers.get("content-type")) or not await request.body():
        return None
    try:
        return await request.json()
    except (ValueError, RecursionError, MemoryError):
        return None
