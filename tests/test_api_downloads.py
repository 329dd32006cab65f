"""Downloads, against a real `fadrm serve` on loopback: they answer conditional and range requests
as RFC 9110 says; stored soft labels are packed and served in bounded memory, and the first
download of many stored epochs takes a time linear in them; a run damaged after its job succeeded
is refused on every download route, in one line, with the job's record saying so; a download
during a repair is a 409 or 503, never a 500 nor a reason for a new job, and once repaired serves
again with the job's error cleared; a damaged stored soft-label epoch is found by `fadrm verify`,
recomputed by `--repair`, and a 409 naming the repair meanwhile (and the evaluation that stored it
had an ETA)."""
from __future__ import annotations

import email.utils
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from bench.api_probes.store import grow_soft_labels, peak_growth_kib
from fadrm_ray.evaluation.soft_labels import DIGESTS, EpochDigests, recorded_digests
from fadrm_ray.layout import RunLayout
from tests.api_helpers import REPO, flip_a_byte, request, running_service

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def downloads(digits_teacher, tmp_path_factory):
    """A service of this module's own: its tests damage and repair runs and grow soft labels."""
    with running_service(digits_teacher[0], tmp_path_factory.mktemp("api-downloads"), max_ipc=5, max_images=20,
                         max_running=1, rate_limit=1000, rate_burst=2000) as server:
        yield server


def _succeeded(http: httpx.Client, body: dict, seen: list | None = None, timeout: float = 600) -> dict:
    """The job of `body` once it has succeeded; every state it was seen in (polled every 0.3 s) to `seen`."""
    made = http.post("/v1/distillations", json=body)
    assert made.status_code in (200, 202), made.text
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = http.get(f"/v1/distillations/{made.json()['id']}").json()
        if seen is not None:
            seen.append(job)
        if job["state"] in ("succeeded", "failed", "cancelled"):
            assert job["state"] == "succeeded", job
            return job
        time.sleep(0.3)
    raise TimeoutError(f"job {made.json()['id']} did not end: {job}")


def _one_line(response: httpx.Response, root: Path) -> str:
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and "Traceback" not in response.text, response.text
    assert str(root) not in response.text, response.text
    return detail


# --------------------------------------------------------------------------- as HTTP says
def test_downloads_answer_conditional_and_range_requests(downloads):
    with downloads.client() as http:
        job = _succeeded(http, request(classes=(2, 6), ipc=1, seed=41))
        base = f"/v1/distillations/{job['id']}"
        for route in ("/dataset", "/preview.png", "/teacher"):
            whole = http.get(base + route)
            assert whole.status_code == 200, (route, whole.text[:200])
            tag, modified = whole.headers["etag"], whole.headers["last-modified"]
            same = http.get(base + route, headers={"If-None-Match": tag})
            assert same.status_code == 304 and same.content == b"" and same.headers["etag"] == tag, route
            assert http.get(base + route, headers={"If-None-Match": f'W/{tag}, "other"'}).status_code == 304
            assert http.get(base + route, headers={"If-None-Match": '"other"'}).status_code == 200
            assert http.get(base + route, headers={"If-Modified-Since": modified}).status_code == 304
            assert http.head(base + route, headers={"If-None-Match": tag}).status_code == 304
            assert http.get(base + route, headers={"If-Match": tag}).status_code == 200
            for failing in ({"If-Match": '"other"'}, {"If-Unmodified-Since": "Mon, 01 Jan 1990 00:00:00 GMT"}):
                refused = http.get(base + route, headers=failing)
                assert refused.status_code == 412 and refused.json()["detail"], (route, failing)
            part = http.get(base + route, headers={"Range": "bytes=3-12"})
            assert part.status_code == 206 and part.content == whole.content[3:13], route
            assert part.headers["content-range"] == f"bytes 3-12/{len(whole.content)}"
            tail = http.get(base + route, headers={"Range": "bytes=-5", "If-Range": tag})
            assert tail.status_code == 206 and tail.content == whole.content[-5:]
            stale = http.get(base + route, headers={"Range": "bytes=0-9", "If-Range": '"another-version"'})
            assert stale.status_code == 200 and stale.content == whole.content
            past = http.get(base + route, headers={"Range": f"bytes={len(whole.content)}-"})
            assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(whole.content)}"
        teacher = http.get(base + "/teacher")
        assert teacher.headers["etag"].strip('"') == json.loads(teacher.headers["etag"])  # the sha256, quoted
        assert email.utils.parsedate_to_datetime(teacher.headers["last-modified"]).tzinfo is not None


# --------------------------------------------------------------------------- soft labels
def test_stored_soft_labels_are_packed_and_served_in_bounded_memory(downloads, tmp_path):
    """Two evaluations of the same images share one stored soft-label folder. The first job's file,
    downloaded, is what the library packs; the folder then grows to over 100 MiB of labels, and
    the second job's first download packs and serves them while the server's memory rises by
    less than 64 MiB."""
    from fadrm_ray.evaluation.soft_labels import PACK_KEY, pack_soft_labels

    evaluation = {"epochs": 2, "seeds": 1, "soft_labels": "stored"}
    body = {**request(classes=(0, 9), ipc=1, seed=51), "evaluate": True, "evaluation": evaluation}
    with downloads.client() as http:
        small = _succeeded(http, body)
        larger = _succeeded(http, {**body, "evaluation": {**evaluation, "lr": 0.002}})  # the same labels
        served = http.get(f"/v1/distillations/{small['id']}/soft-labels")
        assert served.status_code == 200
    folders = [meta.parent for meta in RunLayout(downloads.store / small["run_id"]).soft_labels.glob("*/meta.json")]
    assert len(folders) == 1
    (tmp_path / "small.parquet").write_bytes(served.content)
    (tmp_path / "whole.parquet").write_bytes(pack_soft_labels(folders))
    got, whole = pq.read_table(tmp_path / "small.parquet"), pq.read_table(tmp_path / "whole.parquet")
    assert got.equals(whole) and got.schema.metadata[PACK_KEY] == whole.schema.metadata[PACK_KEY]

    rows = grow_soft_labels(folders[0], 104 * 2**20)
    out = tmp_path / "larger.parquet"

    def download():
        with downloads.client() as http, http.stream("GET", f"/v1/distillations/{larger['id']}/soft-labels") as r:
            assert r.status_code == 200
            with open(out, "wb") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)

    grown = peak_growth_kib(downloads.process.pid, download)
    print(f"soft labels of {out.stat().st_size / 2**20:.0f} MiB served; the server's RSS rose {grown / 1024:.1f} MiB")
    assert out.stat().st_size >= 100 * 2**20 and pq.read_metadata(out).num_rows == rows, out.stat().st_size
    assert grown < 64 * 1024, f"the server's RSS grew by {grown / 1024:.0f} MiB"


def test_the_first_soft_label_download_is_linear_in_the_stored_epochs(downloads):
    """100 stored epochs, then 1,000 (the same small epoch file copied): the first download of
    each (the pack built then; built again after its file is removed) takes a time per epoch
    within 3x of 100 epochs' (the best of two builds each)."""
    body = {**request(classes=[3, 7], ipc=1, seed=61), "evaluate": True,
            "evaluation": {"epochs": 100, "seeds": 1, "soft_labels": "stored", "soft_label_topk": 2}}
    with downloads.client() as http:
        job = _succeeded(http, body)
        url, built = f"/v1/distillations/{job['id']}/soft-labels", downloads.store / ".fadrm-api" / "jobs" / job["id"]
        folder = next(RunLayout(downloads.store / job["run_id"]).soft_labels.glob("*/meta.json")).parent

        def first_download() -> tuple[float, int]:
            best, rows = float("inf"), 0
            for _ in range(2):
                (built / "soft-labels.parquet").unlink(missing_ok=True)
                time.sleep(0.1)
                started = time.perf_counter()
                r = http.get(url)
                best = min(best, time.perf_counter() - started)
                assert r.status_code == 200, r.text
                rows = pq.read_metadata(built / "soft-labels.parquet").num_rows
            return best, rows

        hundred, rows_100 = first_download()
        digests = recorded_digests(folder)
        for epoch in range(100, 1000):  # recorded as an evaluation of 1,000 epochs records them
            name = f"epoch={epoch:05d}.parquet"
            shutil.copy(folder / "epoch=00000.parquet", folder / name)
            digests[name] = digests["epoch=00000.parquet"]
        (folder / DIGESTS).write_text(EpochDigests(files=digests).model_dump_json())
        thousand, rows_1000 = first_download()
    assert rows_1000 == 10 * rows_100 > 0
    assert thousand / 1000 <= 3 * hundred / 100, (hundred, thousand)


# --------------------------------------------------------------------------- damaged runs, repairs
def test_a_run_damaged_after_its_job_succeeded_is_refused_on_every_download_route(downloads):
    with downloads.client() as http:
        done = _succeeded(http, request(classes=(1, 8), ipc=1, seed=11))
        run = downloads.store / done["run_id"]
        flip_a_byte(run)
        base = f"/v1/distillations/{done['id']}"
        for route in ("/dataset", "/dataset?format=imagefolder", "/preview.png"):
            r = http.get(base + route)
            assert r.status_code == 409, (route, r.status_code, r.text[:300])
            detail = r.json()["detail"]
            assert "failed verification" in detail and "fadrm verify" in detail and "\n" not in detail
            assert str(downloads.root) not in r.text
        assert "failed verification" in http.get(base).json()["error"]


def test_a_download_during_a_repair_is_a_409_or_503_and_serves_again_after(downloads):
    from fadrm_ray.store.lock import RunLock

    with downloads.client() as http:
        job = _succeeded(http, request(classes=(1, 8), ipc=2, seed=31))
        base = f"/v1/distillations/{job['id']}"
        run = downloads.store / job["run_id"]
        flip_a_byte(run)
        damaged = http.get(base + "/dataset")
        assert damaged.status_code == 409 and "failed verification" in _one_line(damaged, downloads.root)
        assert "failed verification" in http.get(base).json()["error"]

        # What a repair does first (fadrm_ray.repair): its manifest gone, under the run's writer lock.
        layout = RunLayout(run)
        aside = layout.manifest.with_name("manifest.json.aside")
        jobs_before = len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"])
        with RunLock(layout).held():
            layout.manifest.rename(aside)
            for route in ("/dataset", "/dataset?format=imagefolder", "/preview.png"):
                busy = http.get(base + route)
                assert busy.status_code == 503 and busy.headers["retry-after"], (route, busy.text)
                assert "being written" in _one_line(busy, downloads.root)
            # The same run asked for at a smaller IPC: not taken for absent, so no job is queued.
            smaller = http.post("/v1/distillations", json=request(classes=(1, 8), ipc=1, seed=31))
            assert smaller.status_code == 503 and "being written" in _one_line(smaller, downloads.root)
        assert len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"]) == jobs_before
        stopped = http.get(base + "/dataset")  # no writer and no manifest: a repair that stopped half-way
        assert stopped.status_code == 409 and "incomplete" in _one_line(stopped, downloads.root)
        aside.rename(layout.manifest)

        statuses: list[int] = []
        repair = subprocess.Popen([sys.executable, "-m", "actors.cli", "verify", "--run", str(run), "--repair",
                                   "--quiet"], env={**downloads.env}, cwd=downloads.root, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)
        while repair.poll() is None:
            statuses.append(http.get(base + "/dataset").status_code)
            time.sleep(0.02)
        assert repair.returncode == 0, repair.stdout.read().decode()[-2000:]
        # Refused while the run fails its check or is being rewritten, never a 500; served once
        # repaired (the repair's last moments, before its process exits, may already see that).
        served_from = statuses.index(200) if 200 in statuses else len(statuses)
        assert set(statuses[:served_from]) <= {409, 503} and set(statuses[served_from:]) <= {200}, statuses
        served = http.get(base + "/dataset")
        assert served.status_code == 200 and served.content[:4] == b"PAR1"
        assert http.get(base).json()["error"] is None


def test_a_damaged_soft_label_epoch_is_found_repaired_and_a_409_naming_the_repair_meanwhile(downloads):
    body = {**request(classes=[2, 5], ipc=1, seed=62), "evaluate": True,
            "evaluation": {"epochs": 300, "seeds": 1, "soft_labels": "stored", "soft_label_topk": 2}}
    seen: list[dict] = []
    with downloads.client() as http:
        job = _succeeded(http, body, seen)
        # The evaluation's progress as the job reported it: its students counted up to their total
        # (whether a poll falls between the two students is the machine's timing; the ETA once the
        # first has trained is test_jobs_db's).
        evaluating = [j for j in seen if j["progress"]["phase"] == "evaluating"]
        assert evaluating and all(j["progress"]["students_total"] == 2 for j in evaluating)
        done = [j["progress"]["students_done"] for j in evaluating]
        assert all(0 <= d <= 2 for d in done) and done == sorted(done), done

        run = downloads.store / job["run_id"]
        folder = next(RunLayout(run).soft_labels.glob("*/meta.json")).parent
        epoch = folder / "epoch=00299.parquet"
        data = bytearray(epoch.read_bytes())
        data[len(data) // 2] ^= 0xFF
        epoch.write_bytes(bytes(data))
        name = f"soft_labels/{folder.name}/epoch=00299.parquet"

        refused = http.get(f"/v1/distillations/{job['id']}/soft-labels")
        assert refused.status_code == 409, refused.text
        detail = refused.json()["detail"]
        assert name in detail and f"fadrm verify --run STORE/{job['run_id']} --repair" in detail
        assert str(downloads.root) not in refused.text
        assert http.get(f"/v1/distillations/{job['id']}").json()["error"] == detail

        env = {**downloads.env, "PYTHONPATH": str(REPO)}
        found = subprocess.run([sys.executable, "-m", "actors.cli", "verify", "--run", str(run)], env=env,
                               capture_output=True, text=True, timeout=300)
        assert found.returncode == 1 and f"{name}: its sha256 differs" in found.stdout, found.stdout + found.stderr
        fixed = subprocess.run([sys.executable, "-m", "actors.cli", "verify", "--run", str(run), "--repair", "--quiet"],
                               env=env, capture_output=True, text=True, timeout=600)
        assert fixed.returncode == 0 and f"mended 1 other file(s): {name}" in fixed.stdout, fixed.stdout + fixed.stderr

        served = http.get(f"/v1/distillations/{job['id']}/soft-labels")
        assert served.status_code == 200, served.text
        assert http.get(f"/v1/distillations/{job['id']}").json()["error"] is None
