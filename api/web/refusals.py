"""Refusals that cost the service little: the 422 of a body that fails validation, the 422 of a
query string that is not exactly what its endpoint takes, and the 400 of a body that is not UTF-8.

The cost is in building the errors as much as in sending them: `body_shape` refuses the shapes
whose errors grow with the body (unknown keys, list items of the wrong type) before pydantic
builds one error object for each, and `validation_refused` answers any other RequestValidationError.

FastAPI's own 422 echoes every error with the whole value it was about (`input`) and its
context, so a 64 KiB body of thousands of unknown keys became a 600 KB answer, and a value the
JSON encoder refuses (1e400 read as inf, NaN) turned the 422 into a 500. The answer here holds at
most `MAX_ERRORS` errors (and how many there were), each with its location, message and type,
every string cut to a few dozen characters, and of the value only a short excerpt: its text for
a number or a string, its kind for anything else.
"""
from __future__ import annotations

import json
import math
import re
import typing
from collections import Counter
from types import UnionType
from urllib.parse import parse_qsl

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.web.bodies import is_json_type, request_json

MAX_ERRORS = 10
MAX_LOC = 6  # parts of one error's location
MAX_TEXT = 64  # characters of one location part or one value excerpt
MAX_MSG = 300  # characters of one message


def cut(text: str, limit: int = MAX_TEXT) -> str:
    """`text` at most `limit` characters, marked when it was cut, and always encodable as UTF-8:
    what a client sent may hold lone surrogates (JSON's `\\ud800`), which are written escaped."""
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# The fields that name something the operator offers, and the list that names them.
NAMED_IN = {"dataset": "GET /v1/datasets", "teacher": "GET /v1/teachers", "teachers": "GET /v1/teachers"}


def _message(err: dict) -> str:
    """The error's message; a name that is not one (a path, say) is told where the names are."""
    if err.get("type") == "string_pattern_mismatch":
        for part in err.get("loc", ()):
            if part in NAMED_IN:
                return (f"not a {part.rstrip('s')} name: name one of {NAMED_IN[part]} (the service reads only "
                        f"what its operator offers, never a path)")
    return str(err.get("msg", ""))


def excerpt(value) -> str | int | float | bool | None:
    """A value of a request as an error may quote it: short, and always valid JSON."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) < 10**15 else f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # inf and nan as text: JSON has no word for them
    if isinstance(value, str):
        return cut(value)
    if isinstance(value, dict):
        return f"<an object of {len(value)} keys>"
    if isinstance(value, (list, tuple)):
        return f"<a list of {len(value)} items>"
    return f"<{type(value).__name__}>"


def _loc_part(part) -> str | int:
    return part if isinstance(part, int) and not isinstance(part, bool) else cut(str(part))


def problems(errors: list[dict], total: int | None = None) -> dict:
    """The body of a 422: at most MAX_ERRORS bounded errors, and how many there were."""
    total = len(errors) if total is None else total
    shown = []
    for err in errors[:MAX_ERRORS]:
        loc = [_loc_part(p) for p in tuple(err.get("loc", ()))[:MAX_LOC]]
        item = {"loc": loc, "msg": cut(_message(err), MAX_MSG), "type": cut(str(err.get("type", "")))}
        if "input" in err and err.get("type") != "json_invalid":
            item["input"] = excerpt(err["input"])
        shown.append(item)
    body = {"detail": shown, "error_count": total}
    if total > len(shown):
        body["note"] = f"{total} errors; the first {len(shown)} are shown"
    return body


class ManyErrors(RequestValidationError):
    """A body refused before pydantic validates it (`body_shape`): the first errors, and how many."""

    def __init__(self, errors: list[dict], total: int):
        super().__init__(errors)
        self.total = total


async def validation_refused(request: Request, exc: RequestValidationError) -> JSONResponse:
    """The service's handler of RequestValidationError (see the module docstring)."""
    if isinstance(exc, QueryRefused):
        return JSONResponse(exc.body, status_code=422)
    errors = exc.errors()
    return JSONResponse(problems(list(errors[:MAX_ERRORS]), getattr(exc, "total", len(errors))), status_code=422)


def shape_errors(body, fields: frozenset[str], listed: dict[str, tuple]) -> tuple[list[dict], int]:
    """The first MAX_ERRORS errors of the shapes `body_shape` refuses, and how many there are."""
    errors, total = [], 0
    if not isinstance(body, dict):
        return errors, total
    for key in body:
        if key not in fields:
            total += 1
            if len(errors) < MAX_ERRORS:
                errors.append({"type": "extra_forbidden", "loc": ("body", key),
                               "msg": "Extra inputs are not permitted", "input": body[key]})
    for name, types in listed.items():
        items = body.get(name)
        if not isinstance(items, list):
            continue
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, types):
                total += 1
                if len(errors) < MAX_ERRORS:
                    errors.append({"type": "type_error", "loc": ("body", name, i), "input": item,
                                   "msg": f"must be one of: {', '.join(t.__name__ for t in types)}"})
    return errors, total


def body_shape(fields: frozenset[str], listed: dict[str, tuple]):
    """A dependency that refuses, before pydantic validates the body, the two shapes whose errors
    grow with the body: unknown keys (one error each) and list items of the wrong type (one error
    per item and per alternative type). pydantic would build every one of those errors as Python
    objects (tens of milliseconds for a 64 KiB body) before a handler could drop them; here the
    first MAX_ERRORS are built and the rest counted. `listed` maps a list field to the types
    its items may have (strictly: a bool is not an int)."""

    async def check(request: Request) -> None:
        # FastAPI's own parse of the body (none where it does not read the body as JSON), never
        # raising: a body that is not JSON (another content type, malformed, nested past the
        # parser's depth) is FastAPI's to refuse.
        body = await request_json(request)
        errors, total = shape_errors(body, fields, listed)
        if total:
            raise ManyErrors(errors, total)

    return check


async def utf8_body(request: Request) -> None:
    """A dependency of endpoints that take a JSON body: a body sent without a JSON content type
    (none, text/plain, a form: FastAPI reads none of them as JSON) is a 422 saying which to send;
    one that is JSON in UTF-16 or UTF-32 (which Python's parser reads too) a 400, as invalid UTF-8 is."""
    body = await request.body()
    if body and not is_json_type(kind := request.headers.get("content-type")):
        raise RequestValidationError([{"type": "content_type", "loc": ("body",), "input": kind or "",
                                       "msg": "a body is read as JSON only when sent with Content-Type: application/"
                                              f"json (or application/*+json); this one was sent "
                                              f"{'as ' + cut(kind) if kind else 'without a content type'}"}])
    if body and json.detect_encoding(body[:4]) not in ("utf-8", "utf-8-sig"):
        raise HTTPException(400, "the request body must be JSON text in UTF-8")


# --------------------------------------------------------------------------- query strings
PLAIN_INTEGER = re.compile(r"-?[0-9]{1,18}")


def query_problems(query: str, fields: dict[str, bool]) -> dict | None:
    """The 422 body of a query string that is not exactly what an endpoint takes, else None.
    `fields` maps each parameter the endpoint takes to whether it is an integer. The rule, one for
    every endpoint (`strict_query`, and the probes of api.web.probes): a parameter the endpoint does
    not take is refused by name (a query string is as strict as a body: `?dry_run=1`, `?Format=`,
    `?format[]=`), its value never quoted (a token put there is not sent back), so is one given
    twice (no value silently wins), and an integer is plain digits (` 1`, `+1`, `1.0`, `1_0` are
    refused; a sign only for a negative number)."""
    pairs = parse_qsl(query, keep_blank_values=True)
    counts = Counter(name for name, _ in pairs)
    takes = ", ".join(sorted(fields)) or "none"
    errors, total, seen = [], 0, Counter()
    for name, value in pairs:
        seen[name] += 1
        if name not in fields:  # its value is not quoted back: a client may have put its token there
            error = {"type": "extra_forbidden", "loc": ("query", name),
                     "msg": f"unknown query parameter; this endpoint takes: {takes}"}
        elif seen[name] == 2:
            error = {"type": "repeated", "loc": ("query", name),
                     "msg": f"given {counts[name]} times; give each query parameter once"}
        elif seen[name] == 1 and fields[name] and not PLAIN_INTEGER.fullmatch(value):
            error = {"type": "int_parsing", "loc": ("query", name), "input": value,
                     "msg": "must be an integer in plain digits (as 20): no spaces, sign, decimal point "
                            "or underscores"}
        else:
            continue
        total += 1
        if len(errors) < MAX_ERRORS:  # only the ones shown are built
            errors.append(error)
    return problems(errors, total) if errors else None


# Kept on the route itself, not by its id: a route collected in a process that builds several apps
# (tests) could leave its id to a new route with other parameters.
_FIELDS = "_fadrm_query_fields"


def _is_integer(annotation) -> bool:
    """`int`, or an optional one."""
    if annotation is int:
        return True
    return typing.get_origin(annotation) in (typing.Union, UnionType) and int in typing.get_args(annotation)


def route_query_fields(route) -> dict[str, bool]:
    """The query parameters a route takes (its own and its dependencies'), each with whether it
    is an integer; worked out once per route."""
    if route is None:
        return {}
    fields = getattr(route, _FIELDS, None)
    if fields is None:
        fields, todo = {}, [getattr(route, "dependant", None)]
        while todo:
            dependant = todo.pop()
            if dependant is None:
                continue
            fields.update({p.alias: _is_integer(p.field_info.annotation) for p in dependant.query_params})
            todo += dependant.dependencies
        setattr(route, _FIELDS, fields)
    return fields


async def strict_query(request: Request) -> None:
    """A dependency of every endpoint, after its token check and the token's rate limit
    (api.web.routes.dependencies.AUTH): its query string as `query_problems` wants it."""
    query = request.scope.get("query_string", b"")
    if not query:
        return
    refused = query_problems(query.decode("latin-1"), route_query_fields(request.scope.get("route")))
    if refused is not None:
        raise QueryRefused(refused)


class QueryRefused(RequestValidationError):
    """A query string `query_problems` refuses: its 422 body, made already."""

    def __init__(self, body: dict):
        super().__init__(body["detail"])
        self.body = body
