"""Request bodies a hostile client sends, against the shared real server (`api_service`): each is
refused at little cost and never with a 5xx, and none makes a job. The 422 of the largest body
quotes little and counts the rest; a non-finite or huge number in any field, and any string a JSON
body can hold in any typed field (lone surrogates, non-characters, control bytes), are a 4xx; a
body in UTF-16 is a 400 in one line; bodies nested past any parser's depth, of any content type,
are a 4xx; a body announced too large is a JSON 413 that arrives whole; and the token is checked
before the body is read."""
from __future__ import annotations

import json
import socket

import pytest

from tests.api_helpers import TOKEN, request

pytestmark = [pytest.mark.ray]


def _compact(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"))


def _post_raw(http, text: str | bytes):
    return http.post("/v1/distillations", content=text, headers={"Content-Type": "application/json"})


def _newest_job(http) -> str | None:
    """The id of the newest job (the shared server has others'): a refused body leaves it the newest."""
    jobs = http.get("/v1/distillations", params={"limit": 1}).json()["jobs"]
    return jobs[0]["id"] if jobs else None


def test_the_422_of_the_largest_body_quotes_little_and_counts_the_rest(api_service):
    base = request()
    with api_service.client() as http:
        before = _newest_job(http)
        # As many unknown keys as fit under the 64 KiB limit, and 999 empty objects as classes.
        unknown = {**base, **{f"k{i}": 0 for i in range(6500)}}
        assert 60_000 < len(_compact(unknown)) < 65_536
        empties = {**base, "classes": [{}] * 999}
        long_key = {**base, "overrides": {"x" * 60_000: 1}}
        for body, count in ((unknown, 6500), (empties, 999), (long_key, 1)):
            response = _post_raw(http, _compact(body))
            assert response.status_code == 422, response.text[:300]
            problem = response.json()
            assert problem["error_count"] >= count and len(problem["detail"]) <= 10
            assert len(response.content) < 6_000, len(response.content)
        assert _newest_job(http) == before


@pytest.mark.parametrize("field", ["ipc", "seed", "evaluate", "classes", "teacher", "preset", "dataset"])
@pytest.mark.parametrize("word", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1" + "0" * 4000])
def test_a_non_finite_or_huge_number_in_any_field_is_a_422_never_a_500(api_service, field, word):
    body = {**request(), field: ["@@"] if field == "classes" else "@@"}
    text = json.dumps(body).replace('"@@"', word)
    with api_service.client() as http:
        response = _post_raw(http, text)
    assert response.status_code == 422, response.text[:300]
    json.loads(response.text, parse_constant=lambda c: pytest.fail(f"the answer holds a bare {c}"))
    assert len(response.content) < 2_000


# What a client can put in a JSON string: escaped lone surrogates (not encodable as UTF-8),
# non-characters, control bytes and a NUL.
NASTY = ["\\ud800", "\\udfff", "a\\ud83d", "\\ufffe", "\\uffff", "\\u0000", "\\u001b[31m", "x\\u202e"]


def _bodies() -> list[tuple[str, bytes]]:
    """(where, raw JSON body) with each nasty string in each typed field, an unknown key, a class
    name, a student_kwargs key and the ipc. The escapes go into the JSON text as they are: a lone
    surrogate cannot be encoded any other way."""
    mark = "@@nasty@@"
    out = []
    for text in NASTY:
        cases = {field: {**request(), field: mark} for field in ("dataset", "teacher", "preset", "ipc")}
        cases["unknown key"] = {**request(), mark: 1}
        cases["classes"] = {**request(), "classes": [mark]}
        cases["student_kwargs"] = {**request(), "evaluate": True, "evaluation": {"student_kwargs": {mark: 1}}}
        for where, body in cases.items():
            out.append((where, json.dumps(body).replace(mark, text).encode()))
    return out


def test_no_string_in_any_typed_field_answers_5xx(api_service):
    with api_service.client() as http:
        for where, body in _bodies():
            r = http.post("/v1/distillations", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code in (400, 422), (where, body[:120], r.status_code, r.text[:300])
            r.json()  # valid JSON, encodable as it was sent


def test_a_body_in_utf16_is_refused_with_one_line(api_service):
    with api_service.client() as http:
        before = _newest_job(http)
        for encoding in ("utf-16", "utf-16-le", "utf-32"):
            response = _post_raw(http, json.dumps(request()).encode(encoding))
            assert response.status_code == 400, (encoding, response.text)
            assert response.json()["detail"] == "the request body must be JSON text in UTF-8"
        assert _newest_job(http) == before


def test_bodies_nested_past_any_parser_are_a_4xx_whatever_their_content_type(api_service):
    nested = [b"[" * 60_000, b'{"a":' * 12_000, b'{"dataset": "digits", "classes": ' + b"[" * 30_000]
    types = [None, "text/plain", "application/x-www-form-urlencoded", "application/json", "application/merge+json",
             "multipart/form-data; boundary=x"]
    with api_service.client() as http:
        for body in nested:
            for kind in types:
                r = http.post("/v1/distillations", content=body, headers={"Content-Type": kind} if kind else {})
                assert 400 <= r.status_code < 500, (kind, body[:20], r.status_code, r.text[:300])
                assert len(r.content) < 4096 and "Traceback" not in r.text
                r.json()
        assert http.get("/healthz").status_code == 200


def test_a_body_announced_too_large_is_a_json_413_that_arrives_whole(api_service):
    """Sent whole before the answer is read (as most clients do): the 413 in the JSON problem
    shape reaches the client, and the connection closes after it, not with a reset."""
    body = b" " * 200_000
    head = (f"POST /v1/distillations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", api_service.port), timeout=30) as s:
        s.sendall(head + body)
        got = b""
        while chunk := s.recv(65536):  # a reset would raise here
            got += chunk
    status, _, rest = got.partition(b"\r\n")
    headers, _, answer = rest.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), got[:200]
    assert b"content-type: application/json" in headers.lower()
    assert "65536 bytes" in json.loads(answer)["detail"]
    with api_service.client(token=None) as anonymous:  # without the token, the token is what is refused
        assert anonymous.post("/v1/distillations", content=body).status_code == 401


def test_the_token_is_checked_before_the_body_is_read(api_service):
    with api_service.client(token=None) as anonymous:
        for body in (b"not json", b"\xff\xfe", b'{"dataset": "\\ud800"}'):
            r = anonymous.post("/v1/distillations", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (body, r.status_code)
    with api_service.client(token="not-the-token-" + "x" * 40) as wrong:
        assert wrong.post("/v1/distillations", content=b"not json").status_code == 403
