"""Hostile requests with a valid token: the table of probes, and how fast the service refuses them.

    python -m bench.api_probes [--out DIR] [--json]

Each probe is one request a client could send to make the server build or run something
without bound (a count of 10**7, a non-finite number, a path for the model factory); the
service must refuse it with a 422 naming the field, before any job exists, and stay
responsive. `tests/test_api_limits.py` asserts exactly that for every probe here; this command
starts `fadrm serve` on a fresh store (as bench.api_load does) and prints, per probe, the
status, the time the refusal took, and the time of a `/healthz` right after it.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# (name, where the change goes: "overrides", "evaluation" or "body", the change, the field the 422 names)
PROBES = [
    # The two that stalled the server and ran for ever.
    ("k 10^7", "overrides", {"k": 10_000_000}, "k"),
    ("iterations 10^9", "overrides", {"iterations": 1_000_000_000}, "iterations"),
    # Every other count of the recover loop.
    ("patch_crops 10^6", "overrides", {"patch_crops": 10**6}, "patch_crops"),
    ("patch_group 10^6", "overrides", {"patch_group": 10**6}, "patch_group"),
    ("patch_candidates 10^9", "overrides", {"patch_candidates": 10**9}, "patch_candidates"),
    ("pack 10^6", "overrides", {"pack": 10**6}, "pack"),
    ("ipc_per_unit 10^6", "overrides", {"ipc_per_unit": 10**6}, "ipc_per_unit"),
    ("jitter 10^6", "overrides", {"jitter": 10**6}, "jitter"),
    ("classes_per_batch 10^6", "overrides", {"classes_per_batch": 10**6}, "classes_per_batch"),
    ("downsample_size 10^6", "overrides", {"downsample_size": 10**6}, "downsample_size"),
    ("stage_iterations of 1000", "overrides", {"stage_iterations": [1] * 1000}, "stage_iterations"),
    ("stage_iterations entry 10^9", "overrides", {"k": 1, "iterations": None, "stage_iterations": [8, 10**9]},
     "stage_iterations"),
    # Evaluation.
    ("epochs 10^6", "evaluation", {"epochs": 1_000_000}, "epochs"),
    ("seeds 10^6", "evaluation", {"seeds": 1_000_000}, "seeds"),
    ("a list of 1000 seeds", "evaluation", {"seeds": list(range(1000))}, "seeds"),
    ("batch_size 10^7", "evaluation", {"batch_size": 10**7}, "batch_size"),
    ("eval_every 10^7", "evaluation", {"eval_every": 10**7}, "eval_every"),
    ("student width 10^6", "evaluation", {"student_kwargs": {"width": 10**6}}, "student_kwargs"),
    ("student checkpoint_path", "evaluation", {"student_kwargs": {"checkpoint_path": "/etc/passwd"}},
     "student_kwargs"),
    ("student from timm", "evaluation", {"student": "vit_giant_patch14_224"}, "student"),
    # Values that are not finite, or not what they claim to be.
    ("lr Infinity", "overrides", {"lr": float("inf")}, "lr"),
    ("r_bn Infinity", "overrides", {"r_bn": float("inf")}, "r_bn"),
    ("alpha NaN", "overrides", {"alpha": float("nan")}, "alpha"),
    ("first_bn_weight 1e308", "overrides", {"first_bn_weight": 1e308}, "first_bn_weight"),
    ("crop_scale_min 1e-300", "overrides", {"crop_scale_min": 1e-300}, "crop_scale_min"),
    ("evaluation lr Infinity", "evaluation", {"lr": float("inf")}, "lr"),
    ("class true", "body", {"classes": [True]}, "classes"),
    ("class 3.0", "body", {"classes": [3.0]}, "classes"),
]


def probe_body(base: dict, where: str, change: dict) -> dict:
    """`base` (a valid request) with one probe's change put where it goes."""
    body = json.loads(json.dumps(base))
    if where == "overrides":
        body["overrides"] = {**body.get("overrides", {}), **change}
    elif where == "evaluation":
        body.update(evaluate=True, evaluation={**body.get("evaluation", {}), **change})
    else:
        body.update(change)
    return body


def post_raw(http: httpx.Client, body: dict) -> httpx.Response:
    """POST the body as Python's json writes it: Infinity and NaN as the bare words other
    languages' JSON parsers refuse, but which a Python server reads."""
    return http.post("/v1/distillations", content=json.dumps(body), headers={"Content-Type": "application/json"})


def main(argv: list[str] | None = None) -> int:
    from bench.api_load import TOKEN, _free_port, _start, _teacher, _wait_ready

    parser = argparse.ArgumentParser(prog="python -m bench.api_probes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for the store and teacher (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="fadrm-api-probes-"))
    (root / "teachers").mkdir(parents=True, exist_ok=True)
    (root / "teachers" / "bench.pt").write_bytes(_teacher(root / "teacher").read_bytes())
    port = _free_port()
    proc, env = _start(root, port)
    base = {"dataset": "digits", "teacher": "bench", "classes": [3, 7], "ipc": 2,
            "overrides": {"iterations": 8, "precision": "fp32"}}
    rows = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=60) as http:
            _wait_ready(http)
            post_raw(http, probe_body(base, "overrides", {"alpha": 2.0}))  # the first request loads the dataset
            for name, where, change, _ in PROBES:
                started = time.perf_counter()
                response = post_raw(http, probe_body(base, where, change))
                took = time.perf_counter() - started
                started = time.perf_counter()
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code
                rows.append({"probe": name, "status": response.status_code, "ms": round(1000 * took, 1),
                             "healthz": health, "healthz_ms": round(1000 * (time.perf_counter() - started), 1)})
            jobs = len(http.get("/v1/distillations", params={"limit": 100}).json()["jobs"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        subprocess.run([sys.executable, "-m", "actors.cli", "serve", "--stop-ray"], env=env, capture_output=True,
                       timeout=120)
    if args.json:
        print(json.dumps({"probes": rows, "jobs_made": jobs}))
    else:
        print("| probe | status | refused in (ms) | /healthz right after (ms) |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['probe']} | {r['status']} | {r['ms']} | {r['healthz_ms']} |")
        print(f"jobs made: {jobs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
