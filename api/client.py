"""A small Python client of the REST service.

    from api.client import FadrmClient

    client = FadrmClient("http://127.0.0.1:8000", token)
    path = client.distill(dataset="digits", teacher="digits-convnet", classes=[3, 7], ipc=10, out="digits-3-7.parquet")

`distill` submits (idempotently: a retried submit returns the same job), waits with exponential
backoff while the job is queued or running, and downloads the Parquet file, resuming a download
that was cut off with an HTTP Range request. A call over the service's per-token request rate
(429 with a short Retry-After) waits that long and is sent again. Errors of the service raise
`ServiceError` with its status and message.

The top-1 a job reports trains students with the teachers' soft labels, not the file's hard
labels: `distill(..., with_teacher=True)` also fetches the teacher checkpoint(s) and the student
recipe beside the Parquet file (`Downloaded`), `soft_labels=True` the soft labels the job's
evaluation stored (for a service that keeps its teachers private), and `download_teacher` /
`download_soft_labels` / `recipe` fetch each alone.
A service whose operator keeps teachers private answers 403, raised as `ServiceError` with its line.
"""
from __future__ import annotations

import hashlib
import ssl
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Sequence, overload

import httpx

if TYPE_CHECKING:
    from fadrm_ray.config import EvalConfig

FINAL = ("succeeded", "failed", "cancelled")
# A 429 asking to wait at most this long is the request-rate limit: wait and send again. A longer
# one (the job queue is full) goes to the caller, who knows whether waiting is worth it.
RATE_WAIT_S = 5
# The fields of a distillation request besides dataset, classes and ipc, with what `submit` sends
# when one is not given (teacher, teachers and evaluation are left out while unset; overrides: {}).
SUBMIT_FIELDS: dict[str, Any] = {"teacher": None, "teachers": None, "preset": "fadrm", "seed": 0, "overrides": None,
                                 "evaluate": False, "evaluation": None}


class ServiceError(RuntimeError):
    def __init__(self, status: int, detail: Any):
        self.status, self.detail = status, detail
        super().__init__(f"HTTP {status}: {detail}")


class JobFailed(RuntimeError):
    def __init__(self, job: dict):
        self.job = job
        super().__init__(f"job {job['id']} {job['state']}: {job.get('error')}")


@dataclass(frozen=True)
class Downloaded:
    """What `distill(..., with_teacher=True)` and/or `soft_labels=True` wrote: the Parquet file,
    the teacher checkpoint(s) beside it (`<stem>.teacher.pt`, `<stem>.teacher-1.pt`, ...: load
    with `fadrm_ray.models.load_teacher`), the stored soft labels (`<stem>.soft-labels.parquet`,
    for `fadrm train-student --soft-labels`) and the student recipe (`<stem>.recipe.json`, an
    `EvalConfig`)."""

    data: Path
    teachers: tuple[Path, ...]
    recipe: Path
    soft_labels: Path | None = None


def product_paths(out: str | Path, teachers: int) -> tuple[tuple[Path, ...], Path]:
    """Where `distill(..., with_teacher=True)` puts the teachers and the recipe of the file `out`."""
    out = Path(out)
    names = ([f"{out.stem}.teacher.pt"] + [f"{out.stem}.teacher-{i}.pt" for i in range(1, teachers)]) if teachers else []
    return tuple(out.with_name(n) for n in names), out.with_name(f"{out.stem}.recipe.json")


class FadrmClient:
    def __init__(self, url: str, token: str, timeout: float = 60.0, verify: ssl.SSLContext | bool = True):
        """`verify`: an SSLContext trusting the service's certificate, for an https `url` whose
        certificate the system does not trust."""
        self.http = httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {token}"},
                                 timeout=timeout, verify=verify)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "FadrmClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        for _ in range(5):
            response = self.http.request(method, path, **kwargs)
            if (wait := _rate_wait(response)) is None:
                break
            time.sleep(wait)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            raise ServiceError(response.status_code, detail)
        return response

    def submit(self, *, dataset: str, classes: Sequence[int | str], ipc: int, idempotency_key: str | None = None,
               **fields: Any) -> dict:
        """Submit a distillation; `fields` are the request's other fields (SUBMIT_FIELDS: teacher,
        teachers, preset, seed, overrides, evaluate, evaluation; any other name is a TypeError)."""
        unknown = sorted(set(fields) - set(SUBMIT_FIELDS))
        if unknown:
            raise TypeError(f"submit() got unexpected keyword argument(s) {', '.join(unknown)}")
        given = {**SUBMIT_FIELDS, **fields}
        body = {"dataset": dataset, "classes": list(classes), "ipc": ipc, "preset": given["preset"],
                "seed": given["seed"], "overrides": given["overrides"] or {}, "evaluate": given["evaluate"]}
        if given["teacher"] is not None:
            body["teacher"] = given["teacher"]
        if given["teachers"] is not None:
            body["teachers"] = list(given["teachers"])
        if given["evaluation"]:
            body["evaluation"] = given["evaluation"]
        key = idempotency_key or uuid.uuid4().hex
        for attempt in range(6):  # the same key makes a retried submit return the same job
            try:
                return self._call("POST", "/v1/distillations", json=body, headers={"Idempotency-Key": key}).json()
            except ServiceError as exc:
                if exc.status != 429 or attempt == 5:
                    raise
                time.sleep(min(30.0, 2.0 ** attempt))
            except httpx.TransportError:
                if attempt == 5:
                    raise
                time.sleep(min(30.0, 2.0 ** attempt))
        raise AssertionError("unreachable")

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/distillations/{job_id}").json()

    def jobs(self, state: str | None = None, limit: int = 20) -> list[dict]:
        """Every job (of `state`), newest first, following the pages."""
        out, cursor = [], None
        while True:
            params = {"limit": limit, **({"state": state} if state else {}), **({"cursor": cursor} if cursor else {})}
            page = self._call("GET", "/v1/distillations", params=params).json()
            out += page["jobs"]
            cursor = page["next_cursor"]
            if not cursor:
                return out

    def cancel(self, job_id: str) -> dict:
        return self._call("DELETE", f"/v1/distillations/{job_id}").json()

    def wait(self, job_id: str, timeout: float = 3600.0, first: float = 0.5, longest: float = 15.0) -> dict:
        """Poll until the job ends, the interval doubling from `first` to `longest`; JobFailed
        unless it succeeded."""
        deadline, delay = time.monotonic() + timeout, first
        while True:
            job = self.job(job_id)
            if job["state"] in FINAL:
                if job["state"] != "succeeded":
                    raise JobFailed(job)
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['state']} after {timeout:.0f} s")
            time.sleep(delay)
            delay = min(longest, delay * 2)

    def download(self, job_id: str, out: str | Path, format: str = "parquet") -> Path:
        """The job's dataset file; a partial `out` left by a cut download is resumed."""
        return self._fetch(f"/v1/distillations/{job_id}/dataset", out, {"format": format})

    def download_soft_labels(self, job_id: str, out: str | Path) -> Path:
        """The soft labels the job's evaluation stored (a job submitted with `evaluate: true` and
        `evaluation.soft_labels: stored`), one file for `fadrm train-student --soft-labels`."""
        return self._fetch(f"/v1/distillations/{job_id}/soft-labels", out, {})

    def _fetch(self, url: str, out: str | Path, params: dict[str, str]) -> Path:
        """A file of the service to `out`, by way of `out.part`, which a cut download resumes."""
        out = Path(out)
        partial = out.with_name(out.name + ".part")
        for attempt in range(5):
            have = partial.stat().st_size if partial.exists() else 0
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                with self.http.stream("GET", url, params=params, headers=headers) as response:
                    if response.status_code == 416:  # nothing left to fetch
                        break
                    if (wait := _rate_wait(response)) is not None:
                        time.sleep(wait)
                        continue
                    if response.status_code >= 400:
                        response.read()
                        raise ServiceError(response.status_code, _detail(response))
                    mode = "ab" if response.status_code == 206 else "wb"
                    with open(partial, mode) as f:
                        for chunk in response.iter_bytes():
                            f.write(chunk)
                break
            except httpx.TransportError:
                if attempt == 4:
                    raise
                time.sleep(2.0 ** attempt)
        partial.replace(out)
        return out

    def download_teacher(self, job_id: str, out: str | Path, index: int = 0) -> Path:
        """The job's teacher checkpoint `index` (a committee has several), checked against the sha256
        the service sends (ETag) before it is renamed to `out`."""
        out = Path(out)
        partial = out.with_name(out.name + ".part")
        try:
            want, got = self._fetch_teacher(job_id, index, partial)
            if got != want:
                raise ServiceError(502, f"teacher {index} of job {job_id} arrived with sha256 {got[:12]}..., not the "
                                        f"{want[:12] or '(none)'}... the service sent")
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(out)
        return out

    def _fetch_teacher(self, job_id: str, index: int, partial: Path) -> tuple[str, str]:
        """Write the teacher to `partial`: (the sha256 the service sent, that of the bytes received)."""
        for _ in range(5):
            digest = hashlib.sha256()
            with self.http.stream("GET", f"/v1/distillations/{job_id}/teacher", params={"index": index}) as response:
                if (wait := _rate_wait(response)) is not None:
                    time.sleep(wait)
                    continue
                if response.status_code >= 400:
                    response.read()
                    raise ServiceError(response.status_code, _detail(response))
                with open(partial, "wb") as f:
                    for chunk in response.iter_bytes():
                        digest.update(chunk)
                        f.write(chunk)
                return response.headers.get("etag", "").strip('"'), digest.hexdigest()
        raise ServiceError(429, "the request rate stayed over the service's limit")

    def recipe(self, job_id: str) -> "EvalConfig":
        """The student recipe of the job's report (`fadrm_ray.config.EvalConfig`)."""
        from fadrm_ray.config import EvalConfig

        return EvalConfig.model_validate_json(self._call("GET", f"/v1/distillations/{job_id}/recipe").content)

    @overload
    def distill(self, *, out: str | Path, timeout: float = ..., with_teacher: Literal[False] = ...,
                soft_labels: Literal[False] = ..., **request: Any) -> Path: ...

    @overload
    def distill(self, *, out: str | Path, timeout: float = ..., with_teacher: bool = ..., soft_labels: bool = ...,
                **request: Any) -> Downloaded: ...

    def distill(self, *, out: str | Path, timeout: float = 3600.0, with_teacher: bool = False,
                soft_labels: bool = False, **request: Any) -> Path | Downloaded:
        """Submit, wait, download: the path of the Parquet file (`submit` takes the request's fields).
        `with_teacher`: the teacher checkpoint(s) and the student recipe too, beside it;
        `soft_labels`: the soft labels the job's evaluation stored and the recipe (submit with
        `evaluate=True, evaluation={"soft_labels": "stored", ...}`): a `Downloaded`. When one
        cannot be had (a service that keeps its teachers private, a job that stored no soft
        labels: ServiceError with the service's line) nothing of this call is left behind."""
        job = self.submit(**request)
        self.wait(job["id"], timeout=timeout)
        if not (with_teacher or soft_labels):
            return self.download(job["id"], out)
        teachers, recipe = product_paths(out, len(job["teachers"]) if with_teacher else 0)
        labels = Path(out).with_name(f"{Path(out).stem}.soft-labels.parquet") if soft_labels else None
        written: list[Path] = []
        try:
            for index, path in enumerate(teachers):
                written.append(self.download_teacher(job["id"], path, index))
            if labels is not None:
                written.append(self.download_soft_labels(job["id"], labels))
            body = self._call("GET", f"/v1/distillations/{job['id']}/recipe").content
            from fadrm_ray.config import EvalConfig

            EvalConfig.model_validate_json(body)  # what is written reads back
            recipe.write_bytes(body)
            written.append(recipe)
            data = self.download(job["id"], out)
        except BaseException:
            for path in written:
                path.unlink(missing_ok=True)
            raise
        return Downloaded(data=data, teachers=teachers, recipe=recipe, soft_labels=labels)


def _detail(response: httpx.Response) -> Any:
    try:
        return response.json().get("detail")
    except ValueError:
        return response.text


def _rate_wait(response: httpx.Response) -> int | None:
    """The seconds a 429 of the request-rate limit asks to wait; None for any other answer."""
    wait = response.headers.get("retry-after", "")
    if response.status_code == 429 and wait.isdigit() and int(wait) <= RATE_WAIT_S:
        return max(1, int(wait))
    return None
