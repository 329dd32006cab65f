"""The files the service serves, answered as RFC 9110 says: validators, conditional requests and
byte ranges, over a file that is already open.

Every download (the dataset, its ImageFolder zip, the preview, the stored soft labels, the
teacher) is a `FileAnswer`: the endpoint opens the file while it holds the job (api.jobs.retention),
and the answer streams from that open descriptor, so a file removed after it was opened (its job
swept past retention) is still served whole, and the answer never opens a path again.

- Validators: `ETag` (the teacher's sha256; for a job's file, a digest of its inode, size and
  modification time: a job's files are written once and replaced, never changed in place) and
  `Last-Modified`.
- Preconditions (section 13.2.2, in its order): `If-Match` that matches no current tag, or
  `If-Unmodified-Since` older than the file, is a `412`; `If-None-Match` that matches (weak
  comparison), or `If-Modified-Since` not older than the file, is a `304` with no body.
- `Range: bytes=...` of one range is a `206` with `Content-Range` (a range past the end is a `416`
  with `Content-Range: bytes */SIZE`); several ranges, another unit or a malformed header are
  answered with the whole file, as the RFC allows; `If-Range` that does not match (a tag, compared
  strongly, or the date of the file) sends the whole file too.
"""
from __future__ import annotations

import email.utils
import hashlib
import json
import os
import re
from typing import BinaryIO

import anyio
from starlette.responses import Response

CHUNK = 1 << 20
_TAG = re.compile(r'\s*(W/)?"([^"]*)"\s*(?:,|$)')
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def file_tag(f: BinaryIO) -> str:
    """A strong ETag of a job's file from what identifies this version of it (module docstring)."""
    st = os.fstat(f.fileno())
    digest = hashlib.sha256(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return f'"{digest[:32]}"'


def _tags(value: str) -> list[tuple[bool, str]] | None:
    """(weak, opaque) of each entity tag of a list; ['*'] as [(False, '*')]; None when malformed."""
    value = value.strip()
    if value == "*":
        return [(False, "*")]
    out, pos = [], 0
    while pos < len(value):
        match = _TAG.match(value, pos)
        if match is None:
            return None
        out.append((bool(match.group(1)), match.group(2)))
        pos = match.end()
    return out


def _date(value: str | None) -> int | None:
    if not value:
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return int(parsed.timestamp()) if parsed.tzinfo is not None else None


def precondition(headers: dict[str, str], etag: str, modified: int) -> int | None:
    """304 or 412 where the request's preconditions say so (RFC 9110 13.2.2, for GET and HEAD),
    else None. `headers` by lower-case name; `modified` the file's time in whole seconds."""
    opaque = etag.strip('"')
    if (if_match := headers.get("if-match")) is not None:
        tags = _tags(if_match)
        if not tags or not any(t == "*" or (not weak and t == opaque) for weak, t in tags):
            return 412
    elif (since := _date(headers.get("if-unmodified-since"))) is not None and modified > since:
        return 412
    if (if_none := headers.get("if-none-match")) is not None:
        tags = _tags(if_none)
        if tags and any(t in ("*", opaque) for _, t in tags):
            return 304
    elif (since := _date(headers.get("if-modified-since"))) is not None and modified <= since:
        return 304
    return None


def byte_range(headers: dict[str, str], size: int, etag: str, last_modified: str) -> tuple[int, int] | None | str:
    """The one range to send, (start, end exclusive); None for the whole file; "416" when the
    range lies past the end."""
    wanted = headers.get("range")
    if wanted is None:
        return None
    if (if_range := headers.get("if-range")) is not None:
        tags = _tags(if_range) if if_range.strip().startswith(("W/", '"')) else None
        if tags is not None:
            if len(tags) != 1 or tags[0][0] or tags[0][1] != etag.strip('"'):
                return None
        elif if_range.strip() != last_modified:
            return None
    match = _RANGE.fullmatch(wanted.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None  # several ranges, another unit, or malformed: the whole file
    first, last = match.group(1), match.group(2)
    if first == "":  # the last N bytes
        start, end = max(0, size - int(last)), size
        if int(last) == 0:
            return "416"
    else:
        start = int(first)
        end = size if last == "" else min(size, int(last) + 1)
        if last != "" and int(last) < start:
            return None
    if start >= size:
        return "416"
    return start, end


class FileAnswer(Response):
    """A response over an open file (module docstring). It owns `f` and closes it. A Response, so
    that FastAPI sends it as it is; none of Response's own body handling is used."""

    def __init__(self, f: BinaryIO, media_type: str, *, etag: str | None = None, filename: str | None = None,
                 headers: dict[str, str] | None = None):
        self.f, self.status_code, self.background = f, 200, None
        st = os.fstat(f.fileno())
        self.size, self.modified = st.st_size, int(st.st_mtime)
        self.etag = etag or file_tag(f)
        self.last_modified = email.utils.formatdate(self.modified, usegmt=True)
        self.answer_headers = {"content-type": media_type, "etag": self.etag, "last-modified": self.last_modified,
                        "accept-ranges": "bytes", **{k.lower(): v for k, v in (headers or {}).items()}}
        if filename is not None:
            self.answer_headers["content-disposition"] = f'attachment; filename="{filename}"'
        # What Response's `headers` reads (the 200's; the answer itself is chosen per request).
        self.raw_headers = [(k.encode(), v.encode()) for k, v in self.answer_headers.items()]

    def _plan(self, scope) -> tuple[int, dict[str, str], tuple[int, int] | None]:
        """The status, the headers and the bytes to send."""
        asked = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        validators = {"etag": self.etag, "last-modified": self.last_modified}
        status = precondition(asked, self.etag, self.modified)
        if status == 304:
            return 304, validators, None
        if status == 412:
            return 412, {**validators, **_problem("the file does not meet the request's preconditions "
                                                  "(If-Match, If-Unmodified-Since)")}, None
        span = byte_range(asked, self.size, self.etag, self.last_modified)
        if span == "416":
            return 416, {**_problem(f"the range lies past the end of the file ({self.size} bytes)"),
                         "content-range": f"bytes */{self.size}"}, None
        if span is None:
            return 200, {**self.answer_headers, "content-length": str(self.size)}, (0, self.size)
        start, end = span
        return 206, {**self.answer_headers, "content-length": str(end - start),
                     "content-range": f"bytes {start}-{end - 1}/{self.size}"}, (start, end)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._answer(scope, receive, send)
        finally:
            self.f.close()
        if self.background is not None:
            await self.background()

    async def _answer(self, scope, receive, send) -> None:
        status, headers, span = self._plan(scope)
        body = headers.pop("fadrm-problem", "").encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        if span is None or scope.get("fadrm.head") or span[0] == span[1]:
            await send({"type": "http.response.body", "body": b"" if scope.get("fadrm.head") else body})
            return
        async with anyio.create_task_group() as group:
            async def watch():  # a client that goes away ends the reads
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch)
            await self._stream(send, *span)
            group.cancel_scope.cancel()

    async def _stream(self, send, start: int, end: int) -> None:
        fd = self.f.fileno()
        while start < end:
            chunk = await anyio.to_thread.run_sync(os.pread, fd, min(CHUNK, end - start), start)
            if not chunk:  # shorter than it was: end here (the connection closes short)
                break
            start += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": start < end})


def _problem(detail: str) -> dict[str, str]:
    body = json.dumps({"detail": detail})
    return {"content-type": "application/json", "content-length": str(len(body)), "fadrm-problem": body}
