"""HTTP plumbing of the service that is not an endpoint: the per-token rate limit, HEAD on every
GET endpoint, and uvicorn's logging with query strings left out of the access log."""
from __future__ import annotations

import copy
import hashlib
import logging
import math
import threading
import time


class RateLimiter:
    """A token bucket per bearer token: `rate` requests a second on average, `burst` at once.

    Buckets are keyed by the token's sha256, so the table never holds a token itself; only
    tokens that passed the check reach it, so it holds one bucket per valid token."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens left, when counted)
        self._lock = threading.Lock()

    def retry_after(self, token: str) -> int | None:
        """Take one request from the token's bucket: None when it may go on, else the whole
        seconds (at least 1) until the bucket holds a request again."""
        if self.rate <= 0:
            return None
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            left, then = self._buckets.get(key, (float(self.burst), now))
            left = min(float(self.burst), left + (now - then) * self.rate)
            if left >= 1:
                self._buckets[key] = (left - 1, now)
                return None
            self._buckets[key] = (left, now)
        return max(1, math.ceil((1 - left) / self.rate))


class HeadAsGet:
    """ASGI middleware: answer HEAD as the GET of the same path would, without the body.

    FastAPI routes answer only the methods they name; rewriting the method here gives every GET
    endpoint its HEAD (status and headers, Content-Length included) without a second route or a
    second operation in the schema. uvicorn keeps the request's own method for its log."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] != "http.response.body":
                return await send(message)
            if not message.get("more_body", False):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class NoQueryString(logging.Filter):
    """Drop the query string from uvicorn's access-log lines: a client that put its token there
    (refused, 401) would otherwise leave it in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn logs (client, method, path with query, HTTP version, status) for each request.
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?<query left out>", *args[3:])
        return True


def uvicorn_log_config() -> dict:
    """uvicorn's own logging configuration, with NoQueryString on the access log's handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["no_query_string"] = {"()": NoQueryString}
    config["handlers"]["access"].setdefault("filters", []).append("no_query_string")
    return config
