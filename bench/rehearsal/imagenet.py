"""A scale rehearsal of an ImageNet-1K run on this machine, done with the `fadrm` command.

    python -m bench.rehearsal.imagenet [--classes 10,100,1000] [--train-per-class 2] [--val-per-class 1]
                                       [--workers 2] [--iterations 4] [--out DIR] [--json]

For each class count N, in DIR/runs/N (the working directory of every command):

1. data: an ImageNet-shaped folder DIR/data/imagenet-N, generated once and kept:
   `train/<wnid>/<wnid>_<i>.JPEG` and `val/<wnid>/ILSVRC2012_val_<n>.JPEG`, the first N of 1000
   sorted WordNet-id-like names, small non-square JPEGs (96x72, quality 90, class-dependent
   colour and stripes), so the folder reader takes its 224 px default. Files and folders are
   dated a day back, as an extracted archive leaves them (`--fresh-dates` keeps the time of
   writing; the listing cache keeps no listing of a tree changed in the last 5 minutes);
2. weights: a seeded random torchvision resnet18 state dict with N outputs (`r18.pth`);
3. import: `fadrm import-teacher --model torchvision:resnet18 --weights r18.pth --dataset
   imagefolder:PATH --mean/--std (ImageNet's) --eval-images E --accept-chance` (random weights
   are at chance);
4. distill: `fadrm distill --preset fadrm --ipc 1 --workers W --cpus-per-worker 1` on the
   embedded local Ray, at 224 px with the published `imagenet` recipe (`recipe=imagenet`, MRO
   stages 200/224/200/224; the pilot `auto` would run on such unnamed colour data is measured
   apart: `python -m bench.pilot_cost`), with a tiny budget: `iterations` (T, one per stage by
   default), `patch_crops=1`, `patch_candidates=1`. Its time is split with the run's ledger into recover
   stages, patch scoring and the rest (start-up, listing, statistics, writing), each as wall time
   (the union of the workers' intervals) and as worker seconds;
5. verify and export: `fadrm verify --run`, `fadrm export --format imagefolder`;
6. rest: `fadrm serve` on a free loopback port with a fresh token, its own store, the teacher
   folder and a FADRM_DATASETS file naming the folder; one POST /v1/distillations of 100 classes
   spread over the N (all of them when N <= 100) with the same settings, polled until it ends,
   its Parquet file downloaded and its rows checked; then the service is stopped and its Ray
   head with `fadrm serve --stop-ray`.

Every phase reports its wall seconds and its memory, sampled from /proc every 0.2 s over the
whole process tree of the command (the embedded Ray's GCS, raylet and workers, the service's Ray
head and job drivers: this process is made their subreaper, so daemonized ones stay in the tree):
the peak of the tree's summed RSS (shared pages counted once per process), of its summed PSS
(shared pages split), and the largest VmHWM of one process. It also counts how often each command
lists the dataset (inotify: the opens of the first class's train folder, which only a walk of
the tree opens) and whether the listing cache file (FADRM_CACHE=DIR/cache, emptied before each
class count) was written.

Prints a table of phase x class count (seconds, seconds per class, peak memory), the distill
split, the outside-recover cost per class at the largest class count over the one at 100 (or the
smallest), and the peak memory against the class count. Writes DIR/imagenet_rehearsal.json.
The machine may be shared: the load average before and after is recorded beside the timings.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fadrm_ray.store.manifests import read_config, unit_manifest
from bench.rehearsal.measure import ListingCounter, Phase, TreeSampler, become_subreaper, last_json, ledger_split
from bench.decode import cpu_name
from fadrm_ray.layout import RunLayout
from bench.rehearsal.report import report, summarize

ROOT = Path(__file__).resolve().parents[2]
IMAGENET_MEAN = "0.485,0.456,0.406"
IMAGENET_STD = "0.229,0.224,0.225"
IMAGE_SIZE = (96, 72)  # width, height: not square, so the folder reader takes 224 px
REST_CLASSES = 100


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def wnids(count: int = 1000) -> list[str]:
    """`count` WordNet-id-like class names (n0 and 7 digits), sorted, the same on every call."""
    return [f"n0{1440000 + 7919 * i:07d}" for i in range(count)]


# --------------------------------------------------------------------------- data
def _image(label: int, index: int):
    """A 96x72 RGB image of class `label`: the class's colour and stripe period, with noise
    that differs from image to image."""
    import numpy as np
    from PIL import Image

    width, height = IMAGE_SIZE
    rng = np.random.default_rng(label * 100_003 + index)
    base = np.array([(label * 37) % 200, (label * 91) % 200, (label * 13) % 200], dtype=np.int16) + 28
    period = 4 + label % 13
    stripes = ((np.arange(width) // period) % 2 * 40 - 20).astype(np.int16)[None, :, None]
    noise = rng.integers(-25, 26, size=(height, width, 3), dtype=np.int16)
    pixels = np.clip(base[None, None, :] + stripes + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def make_folder(root: Path, classes: int, train_per_class: int, val_per_class: int, backdate: bool = True) -> Path:
    """An ImageNet-shaped folder of the first `classes` wnids at `root`, written once (a `done`
    file with the parameters marks it complete; a folder with other parameters is rewritten)."""
    if not 1 <= classes <= 1000:
        raise ValueError(f"classes must be in 1..1000, got {classes}")
    params = {"classes": classes, "train_per_class": train_per_class, "val_per_class": val_per_class,
              "size": list(IMAGE_SIZE), "backdate": backdate}
    done = root.parent / f".{root.name}.done"
    if root.is_dir() and done.is_file() and json.loads(done.read_text()) == params:
        return root
    shutil.rmtree(root, ignore_errors=True)
    done.unlink(missing_ok=True)
    names = wnids(classes)
    for label, wnid in enumerate(names):
        train, val = root / "train" / wnid, root / "val" / wnid
        train.mkdir(parents=True)
        val.mkdir(parents=True)
        for i in range(train_per_class):
            _image(label, i).save(train / f"{wnid}_{i}.JPEG", quality=90)
        for j in range(val_per_class):
            number = label * val_per_class + j + 1
            _image(label, 10_000 + j).save(val / f"ILSVRC2012_val_{number:08d}.JPEG", quality=90)
    if backdate:
        stamp = time.time() - 86_400
        for dirpath, _, files in os.walk(root, topdown=False):
            for name in files:
                os.utime(os.path.join(dirpath, name), (stamp, stamp))
            os.utime(dirpath, (stamp, stamp))
    done.write_text(json.dumps(params))
    return root


# --------------------------------------------------------------------------- commands
def fadrm_command() -> list[str]:
    """The `fadrm` script beside this interpreter, else the module it runs."""
    script = Path(sys.executable).with_name("fadrm")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "actors.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rest_classes(n: int) -> list[int]:
    return list(range(n)) if n <= REST_CLASSES else [i * n // REST_CLASSES for i in range(REST_CLASSES)]


def rest_phase(phase: Phase, work: Path, folder: Path, teacher: Path, overrides: dict, classes: list[int],
               workers: int, timeout: float) -> None:
    """`fadrm serve`, one distillation job over HTTP, its Parquet download; the whole service
    tree (HTTP process, Ray head, job driver, actors) sampled."""
    import httpx
    import pyarrow.parquet as pq

    token = secrets.token_hex(32)
    for name in ("serve-store", "serve-teachers"):
        shutil.rmtree(work / name, ignore_errors=True)
    (work / "serve-teachers").mkdir()
    shutil.copy(teacher, work / "serve-teachers" / "teacher.pt")
    (work / "datasets.yaml").write_text(f"imagenet: imagefolder:{folder.resolve()}\n")
    env = {**phase.env, "FADRM_API_TOKEN": token, "FADRM_STORE": str(work / "serve-store"),
           "FADRM_TEACHERS": str(work / "serve-teachers"), "FADRM_DATASETS": str(work / "datasets.yaml"),
           "FADRM_WORKERS": str(workers), "FADRM_CPUS_PER_WORKER": "1", "FADRM_MAX_RUNNING": "1"}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve_log = open(work / "serve.log", "wb")
    started = time.perf_counter()
    proc = subprocess.Popen([*fadrm_command(), "serve", "--host", "127.0.0.1", "--port", str(port)], cwd=work,
                            env=env, stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)
    sampler = TreeSampler(proc.pid, keep={proc.pid}).__enter__()
    r = phase.result
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"fadrm serve exited {proc.returncode}: "
                                       f"{(work / 'serve.log').read_text(errors='replace')[-2000:]}")
                try:
                    if http.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("fadrm serve was not ready within 300 s")
                time.sleep(0.5)
            r["ready_s"] = round(time.perf_counter() - started, 2)
            body = {"dataset": "imagenet", "teacher": "teacher", "classes": classes, "ipc": 1, "preset": "fadrm",
                    "overrides": overrides}
            submitted = time.perf_counter()
            response = http.post("/v1/distillations", json=body)
            if response.status_code not in (200, 202):
                raise RuntimeError(f"POST /v1/distillations: {response.status_code} {response.text[:500]}")
            job = response.json()
            r["submit_ms"] = round(1000 * (time.perf_counter() - submitted), 1)
            deadline, polls = time.monotonic() + timeout, 0
            while job["state"] not in ("succeeded", "failed", "cancelled"):
                if time.monotonic() > deadline or polls > timeout:
                    raise RuntimeError(f"job {job['id']} still {job['state']} after {timeout:.0f} s")
                time.sleep(1.0)
                polls += 1
                job = http.get(f"/v1/distillations/{job['id']}").json()
            r["job_s"] = round(time.perf_counter() - submitted, 2)
            r["polls"] = polls
            r["job_timings"] = job.get("timings")
            if job["state"] != "succeeded":
                raise RuntimeError(f"job {job['id']} {job['state']}: {job.get('error')}")
            target = work / "rest.parquet"
            got = time.perf_counter()
            with http.stream("GET", f"/v1/distillations/{job['id']}/dataset") as stream:
                if stream.status_code != 200:
                    raise RuntimeError(f"GET .../dataset: {stream.status_code}")
                with open(target, "wb") as fh:
                    for chunk in stream.iter_bytes():
                        fh.write(chunk)
            r["download_s"] = round(time.perf_counter() - got, 2)
            table = pq.read_table(target, columns=["label", "ipc_index"])
            labels = sorted(table.column("label").to_pylist())
            r["rows"], r["expected_rows"] = table.num_rows, len(classes)
            r["labels_match"] = labels == sorted(classes)
            r["bytes"] = target.stat().st_size
            if not r["labels_match"]:
                raise RuntimeError(f"the download holds labels {labels[:10]}..., not the {len(classes)} asked for")
    finally:
        sampler.stop()  # before `--stop-ray`: the sampler reaps adopted processes, never a command of ours
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stop = subprocess.run([*fadrm_command(), "serve", "--stop-ray"], cwd=work, env=env, capture_output=True,
                              timeout=180)
        r["stop_ray_rc"] = stop.returncode
        deadline = time.monotonic() + 60  # the Ray head's processes end after --stop-ray
        while time.monotonic() < deadline:
            sampler.sample()
            if not [p for p in sampler.tracked if p != proc.pid]:
                break
            time.sleep(0.5)
        r["left_running"] = len([p for p in sampler.tracked if p != proc.pid])
        r.update(sampler.result())
        serve_log.close()


# --------------------------------------------------------------------------- one class count
def rehearse(n: int, args, out: Path, counter_for) -> dict:

    folder_started = time.perf_counter()
    folder = make_folder(out / "data" / f"imagenet-{n}", n, args.train_per_class, args.val_per_class,
                         backdate=not args.fresh_dates)
    result: dict = {"classes": n, "data": {"seconds": round(time.perf_counter() - folder_started, 2),
                                           "path": str(folder)}}
    work = out / "runs" / str(n)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cache = out / "cache"
    shutil.rmtree(cache, ignore_errors=True)  # each class count starts without a listing cache
    env = {**os.environ, "FADRM_CACHE": str(cache), "FADRM_OFFLINE": "1"}
    counter = counter_for(folder)
    fadrm = fadrm_command()
    spec = f"imagefolder:{folder.resolve()}"
    # The published ImageNet recipe, as for a dataset named imagenet: the pilot (fadrm_ray/pilot.py)
    # is measured apart, with bench.pilot_cost on the same folder.
    overrides = {"iterations": args.iterations, "patch_crops": 1, "patch_candidates": 1, "recipe": "imagenet"}
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    phases = result["phases"] = {}

    def phase(name: str) -> Phase:
        p = Phase(name, work, env, counter, cache)
        phases[name] = p.result
        return p

    try:
        with phase("weights") as p:
            p.run([sys.executable, "-c",
                   "import torch, torchvision; torch.manual_seed(0); "
                   f"torch.save(torchvision.models.resnet18(num_classes={n}).state_dict(), 'r18.pth')"], 300)
        eval_images = min(n * args.val_per_class, args.eval_images)
        with phase("import") as p:
            got = last_json(p.run([*fadrm, "import-teacher", "--model", "torchvision:resnet18", "--weights", "r18.pth",
                                   "--dataset", spec, "--out", "teacher.pt", "--eval-images", str(eval_images),
                                   "--mean", IMAGENET_MEAN, "--std", IMAGENET_STD, "--accept-chance", "--json",
                                   "--quiet"], args.timeout).stdout)
            p.result.update({"top1": got["top1"], "chance": got["chance"], "image_size": got["image_size"],
                             "normalization": got["record"]["normalization"], "own_s": got["seconds"],
                             "eval_images": eval_images})
        log(f"  [{n}] import {p.result['seconds']:.1f} s ({got['image_size']} px, top-1 {got['top1']}%)")
        with phase("distill") as p:
            got = last_json(p.run([*fadrm, "distill", "--dataset", spec, "--teacher", "teacher.pt", "--preset", "fadrm",
                                   "--ipc", "1", "--workers", str(args.workers), "--cpus-per-worker", "1", *sets,
                                   "--out", "store", "--json", "--quiet"], args.timeout).stdout)
            run_dir = work / got["run_dir"]
            layout = RunLayout(run_dir)
            resolved = read_config(layout)
            split = ledger_split(run_dir)
            p.result.update({"run_id": got["run_id"], "images": got["images"], "own_s": round(got["seconds"], 2),
                             "recipe": resolved.recipe, "downsample_size": resolved.downsample_size,
                             "precision": resolved.precision, **split})
            units = layout.unit_ids()
            resolutions = unit_manifest(layout, units[0]).stats.packs[0].resolutions if units else None
            p.result["stage_resolutions"] = resolutions
        d = p.result
        d["outside_recover_s"] = round(d["seconds"] - d["recover_wall_s"], 2)
        d["rest_s"] = round(d["seconds"] - d["recover_wall_s"] - d["patch_scoring_wall_s"], 2)
        log(f"  [{n}] distill {d['seconds']:.1f} s: recover {d['recover_wall_s']:.1f} s, patch scoring "
            f"{d['patch_scoring_wall_s']:.1f} s, rest {d['rest_s']:.1f} s; stages {resolutions}")
        with phase("verify") as p:
            got = last_json(p.run([*fadrm, "verify", "--run", f"store/{d['run_id']}", "--json"], args.timeout).stdout)
            p.result.update({"ok": got["ok"], "rows": got["rows"]})
            if not got["ok"]:
                raise RuntimeError(f"fadrm verify found problems: {got['problems']}")
        with phase("export") as p:
            got = last_json(p.run([*fadrm, "export", "--run", f"store/{d['run_id']}", "--format", "imagefolder",
                                   "--out", "export", "--json", "--quiet"], args.timeout).stdout)
            files = sum(1 for f in (work / "export").rglob("*") if f.is_file() and f.suffix.lower() == ".png")
            p.result.update({"images": got["images"], "png_files": files})
        log(f"  [{n}] verify {phases['verify']['seconds']:.1f} s, export {phases['export']['seconds']:.1f} s")
        if not args.no_rest:
            classes = rest_classes(n)
            with phase("rest") as p:
                p.result["classes"] = len(classes)
                rest_phase(p, work, folder, work / "teacher.pt", overrides, classes, args.workers, args.timeout)
            log(f"  [{n}] rest {p.result['seconds']:.1f} s ({len(classes)} classes, {p.result['rows']} rows)")
    finally:
        counter.close()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.rehearsal.imagenet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", default="10,100,1000", help="class counts, comma-separated (at most 1000)")
    parser.add_argument("--train-per-class", type=int, default=2)
    parser.add_argument("--val-per-class", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=4, help="recover iterations T over the 4 stages")
    parser.add_argument("--eval-images", type=int, default=1000, help="test images the import measures, at most")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds one command may run")
    parser.add_argument("--fresh-dates", action="store_true", help="leave the generated files dated now")
    parser.add_argument("--no-rest", action="store_true", help="skip the REST phase")
    parser.add_argument("--out", default="bench-results/imagenet-rehearsal")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    counts = sorted({int(c) for c in args.classes.split(",") if c.strip()})
    if not counts or counts[0] < 1 or counts[-1] > 1000:
        parser.error("--classes: counts from 1 to 1000")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    subreaper = become_subreaper()
    result: dict = {"cpu": cpu_name(), "cpus": os.cpu_count(), "workers": args.workers, "iterations": args.iterations,
                    "train_per_class": args.train_per_class, "val_per_class": args.val_per_class,
                    "subreaper": subreaper, "command": "python -m bench.rehearsal.imagenet " + " ".join(argv or sys.argv[1:]),
                    "load_before": "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), "counts": []}

    def counter_for(folder: Path) -> ListingCounter:
        first = wnids(1)[0]
        return ListingCounter([folder / "train" / first])

    for n in counts:
        log(f"{n} classes")
        result["counts"].append(rehearse(n, args, out, counter_for))
        result["summary"] = summarize(result)
        (out / "imagenet_rehearsal.json").write_text(json.dumps(result, indent=2))
    result["load_after"] = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    (out / "imagenet_rehearsal.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result) if args.json else report(result))
    return result


if __name__ == "__main__":
    main()
