"""HTTP plumbing of the service that is not an endpoint: the rate limits (per token, and per
address for requests without a valid token), HEAD on every GET endpoint, the refusal of a request
that names both Transfer-Encoding and Content-Length, the connection guard (a time limit on
reading each request, a cap on open connections) and uvicorn's logging (each field of an access-log line checked, query strings
left out, long paths cut; size-rotated files when the operator names one)."""
from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import logging
import math
import re
import threading
import time
from contextvars import ContextVar
from pathlib import Path

# Characters of a request's path as the access log writes it.
LOG_PATH_CHARS = 200


class RateLimiter:
    """A token bucket per bearer token: `rate` requests a second on average, `burst` at once.

    Buckets are keyed by the key's sha256, so the table never holds a token itself. Keyed by
    valid tokens it holds one bucket per token; keyed by client addresses (requests without a
    valid token) it is pruned of full buckets once it holds `max_keys`, so it stays bounded."""

    def __init__(self, rate: float, burst: int, max_keys: int = 10_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens left, when counted)
        self._lock = threading.Lock()

    def _prune(self, now: float) -> None:
        """Forget the buckets that have filled up again (a new one starts full: nothing is lost)."""
        full_after = self.burst / self.rate
        self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < full_after}
        if len(self._buckets) >= self.max_keys:  # all of them busy: the oldest go
            keep = sorted(self._buckets.items(), key=lambda kv: kv[1][1])[len(self._buckets) // 2:]
            self._buckets = dict(keep)

    def retry_after(self, token: str) -> int | None:
        """Take one request from the token's bucket: None when it may go on, else the whole
        seconds (at least 1) until the bucket holds a request again."""
        if self.rate <= 0:
            return None
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            if key not in self._buckets and len(self._buckets) >= self.max_keys:
                self._prune(now)
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

        # `fadrm.head` tells a file answer (api.web.downloads) to read nothing of its file.
        await self.app({**scope, "method": "GET", "fadrm.head": True}, receive, headers_only)


# Set while a response is sent that the access log leaves out (AddressLimit counts those instead).
QUIET: ContextVar[bool] = ContextVar("fadrm_quiet_access", default=False)
SUMMARY_S = 60.0


class AddressLimit:
    """ASGI middleware: the token check of every request but the `exempt` paths, before anything
    else runs (routing, the body, the endpoint): 401 (no token) or 403 (a wrong one), answered
    here, so a body that is not JSON is refused for its missing token, not for its JSON. Past the
    per-address rate limit of such requests the answer adds Retry-After and is left out of the
    access log: one line a minute per address counts them instead. So a flood of them costs a dictionary lookup each and a bounded
    amount of log. Requests with the token, and `exempt` paths (/healthz), are not counted.
    The address is the socket's peer; behind a proxy the operator names in FADRM_TRUSTED_PROXIES
    it is the client that proxy names (api.web.proxies.TrustedProxies), else the proxy's."""

    def __init__(self, app, token: str, limiter: RateLimiter, exempt: frozenset[str] = frozenset()):
        self.app, self.limiter, self.exempt = app, limiter, exempt
        self.expected = b"bearer " + token.encode()
        self._refused: dict[str, tuple[int, float]] = {}  # address -> (refused since, when last said)
        self._log = logging.getLogger("fadrm.api")

    def _token(self, scope) -> bool | None:
        """True: the service's token; False: another; None: no Authorization header."""
        import secrets

        for name, value in scope["headers"]:
            if name == b"authorization":
                if value[:7].lower() != b"bearer ":  # another scheme: no bearer token (401)
                    return None
                return secrets.compare_digest(b"bearer " + value[7:], self.expected)
        return None

    def _count(self, address: str) -> None:
        now = time.monotonic()
        count, said = self._refused.get(address, (0, now))
        if now - said >= SUMMARY_S:
            self._log.warning("refused %d requests without a valid token from %s in %.0f s (FADRM_ANON_RATE_LIMIT)",
                              count + 1, logged_address(f"{address}:0").rsplit(":", 1)[0], now - said)
            count, said = -1, now
        if len(self._refused) >= self.limiter.max_keys and address not in self._refused:
            self._refused.clear()
        self._refused[address] = (count + 1, said)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        token = self._token(scope)
        if token:
            return await self.app(scope, receive, send)
        # Without the token nothing of the request is read: no route, no body, no endpoint.
        status, detail = ((403, b"the bearer token is not valid for this service") if token is False else
                          (401, b"missing bearer token (Authorization: Bearer <token>)"))
        address = str((scope.get("client") or ("", 0))[0])
        wait = self.limiter.retry_after(address)
        headers = [(b"content-type", b"application/json")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if wait is None:
            body = b'{"detail":"%s"}' % detail
        else:
            self._count(address)
            body = b'{"detail":"%s; too many such requests from this address, retry in %d s"}' % (detail, wait)
            headers.append((b"retry-after", str(wait).encode()))
            QUIET.set(True)  # this task's context: the access log line of this answer is dropped
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class OneRequestLength:
    """ASGI middleware: refuse (400, connection closed) a request that names both
    Transfer-Encoding and Content-Length. RFC 9112 (6.3) says such a message may be an attempt at
    request smuggling and the connection must be closed after it: a proxy in front that trusts
    Content-Length would read the following bytes as another request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"transfer-encoding" in names and b"content-length" in names:
                body = b'{"detail":"a request may name Transfer-Encoding or Content-Length, not both"}'
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _raw_response(status: int, reason: str, detail: str) -> bytes:
    body = ('{"detail":"%s"}' % detail).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def guarded_protocol(read_timeout: float, max_connections: int):
    """uvicorn's h11 protocol with two guards uvicorn lacks.

    - A request must arrive whole (head and body) within `read_timeout` seconds of its first
      byte, or of the connection's opening: a connection that sends part of a request, one byte
      at a time or nothing at all, is answered 408 (when no answer has started) and closed.
      uvicorn's own timeout covers only idle keep-alive connections.
    - At most `max_connections` connections are open at once: one more is answered 503 and
      closed as soon as it is accepted, so idle or slow sockets cannot use up the process's file
      descriptors (uvicorn's `limit_concurrency` answers 503 only once a request has arrived).
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timed_out = _raw_response(408, "Request Timeout", f"the request did not arrive within {read_timeout:g} s")
    too_many = _raw_response(503, "Service Unavailable", "too many open connections; retry later")

    class GuardedH11Protocol(H11Protocol):
        _read_timer = None
        _refused = False

        def connection_made(self, transport) -> None:
            if len(self.server_state.connections) >= max_connections:
                self._refused, self.transport = True, transport
                transport.write(too_many)
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse: the 400 in the service's JSON shape (uvicorn's is text)."""
            body = json.dumps({"detail": msg[:200]}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._refused:
                return
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def _watch(self) -> None:
            """Time the request being read: one that has begun (bytes buffered or its body under
            way) and has not all arrived."""
            state = self.conn.their_state
            if state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0]):
                self._arm()
            else:
                self._disarm()

        def _arm(self) -> None:
            if self._read_timer is None:
                self._read_timer = self.loop.call_later(read_timeout, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(timed_out)
            self.transport.close()

    return GuardedH11Protocol


_METHOD = re.compile(r"[A-Z]{1,16}")
_VERSIONS = frozenset({"1.0", "1.1", "2", "2.0", "3"})


def logged_address(client: str) -> str:
    """`client` ("host:port", as uvicorn writes it) when its host is an IP address and its port a
    number, else a placeholder: an address an X-Forwarded-For header set is written only once it
    is one."""
    host, sep, port = client.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return "<not an address>"
    return client if sep and port.isdigit() and len(port) <= 5 else "<not an address>"


def logged_path(path: str) -> str:
    """The path as the access log writes it: no query string, printable ASCII, cut."""
    if "?" in path:
        path = path.split("?", 1)[0] + "?<query left out>"
    if not (path.isascii() and path.isprintable()):  # uvicorn quotes it; anything else is escaped
        path = path.encode("unicode_escape").decode("ascii")
    if len(path) > LOG_PATH_CHARS:
        path = f"{path[:LOG_PATH_CHARS]}...<{len(path) - LOG_PATH_CHARS} more characters>"
    return path


class BoundedAccessLine(logging.Filter):
    """What uvicorn's access log writes of a request, each field checked: the client an IP address
    and port (`logged_address`), the method a word of capitals, the HTTP version one h11 speaks, the
    path without its query string (a client that put its token there, refused with a 401, would
    otherwise leave it in the log) and cut to LOG_PATH_CHARS characters, so one line is a few
    hundred bytes whatever the request and holds nothing a client wrote unchecked."""

    def filter(self, record: logging.LogRecord) -> bool:
        if QUIET.get():
            return False
        args = record.args
        # uvicorn logs (client, method, path with query, HTTP version, status) for each request.
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            client, method, path, version = (str(a) for a in args[:4])
            method = method if _METHOD.fullmatch(method) else "<method>"
            version = version if version in _VERSIONS else "?"
            status = args[4] if isinstance(args[4], int) else 0
            record.args = (logged_address(client), method, logged_path(path), version, status)
        return True


def uvicorn_log_config(log_file: Path | None = None, max_bytes: int = 10 * 2**20, backups: int = 3) -> dict:
    """uvicorn's own logging configuration, with BoundedAccessLine on the access log's handler and
    the service's own logger (`fadrm`) beside uvicorn's. With `log_file`, everything goes to that
    file (the access log to `<log_file>.access`), each rotated at `max_bytes` with `backups` old
    files kept: at most (1 + backups) x max_bytes bytes of each."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["bounded_access_line"] = {"()": BoundedAccessLine}
    config["handlers"]["access"].setdefault("filters", []).append("bounded_access_line")
    config["loggers"]["fadrm"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    if log_file is not None:
        for name, path in (("default", Path(log_file)), ("access", Path(f"{log_file}.access"))):
            handler = config["handlers"][name]
            handler.pop("stream", None)
            handler.update({"class": "logging.handlers.RotatingFileHandler", "filename": str(path),
                            "maxBytes": max_bytes, "backupCount": backups, "encoding": "utf-8"})
        for formatter in config["formatters"].values():
            formatter["use_colors"] = False
    return config
