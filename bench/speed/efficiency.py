"""The efficiency table of FADRM's paper (its Table 2) on this machine: every method on one
setting side by side in one run.

    python -m bench.speed.efficiency [--dataset digits] [--ipc 1] [--classes 0,1,2] [--teachers 2]
                                     [--scale 0.05] [--device cpu|cuda] [--threads 1] [--json]

Each method is its preset here (docs/method.md sections 7 and 7c), resolved for the dataset, at
its own published iteration budget (PUBLISHED_BUDGET). Multi-teacher methods (fadrm+, g-vbsm,
edc, cv-dd) get all `--teachers` teachers, the others the first. Teachers are untrained
convnet-bn models of different widths with running statistics from the real images: the cost
of a step does not depend on what a teacher learned. CV-DD's priors are fixed made-up
accuracies (the vote's cost does not depend on their values).

Timed: the recover loop only (`init_state` + every stage), the same real images as patches for
every real-init method; patch scoring and the one-time convolution targets of G-VBSM and EDC
are left out, as the paper's per-image time leaves out their precomputed statistics. Each
method runs `scale` of its budget (at least 2 iterations per stage) in a fresh process, after one
untimed warm-up stage, and the
seconds per image are scaled to the full budget, since the cost of an iteration does not
depend on T. Peak memory: on CUDA `torch.cuda.max_memory_allocated` during the loop; on the
CPU the growth of the process's peak resident set (ru_maxrss) over its value before the loop.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time

# Published iterations per method (their released recover scripts; docs/method.md sections 7, 7c).
PUBLISHED_BUDGET = {"g-vbsm": 4000, "cv-dd": 4000, "edc": 1000, "sre2l++": 4000, "fadrm+": 2000, "fadrm": 2000,
                    "sre2l": 1000, "cda": 4000}
MULTI_TEACHER = ("fadrm+", "g-vbsm", "edc", "cv-dd")
# The paper's Table 2 (ImageNet-1K, one RTX 4090): seconds per image, peak GB; for the ranking.
PAPER = {"g-vbsm": (17.28, 21.4), "cv-dd": (8.20, 23.4), "edc": (4.99, 17.9), "sre2l++": (2.52, 5.3),
         "fadrm+": (1.09, 11.0), "fadrm": (0.47, 2.9)}
WIDTHS = (32, 48, 24, 40)  # teacher widths, so the teachers of a multi-teacher method differ in cost


def _measure(method: str, args: dict, queue) -> None:
    import torch

    from fadrm_ray.config import make_config
    from fadrm_ray.data import get_dataset
    from fadrm_ray.models import create_model
    from fadrm_ray.frozen_teacher import equip_teachers
    from fadrm_ray.recover import init_state, run_stage

    torch.set_num_threads(args["threads"])
    torch.manual_seed(0)
    device = torch.device(args["device"])
    data = get_dataset(args["dataset"])
    classes = args["classes"] or list(range(data.num_classes))
    real = data.normalize(data.train.load(list(range(min(512, len(data.train.labels))))))
    models, infos = [], []
    for i in range(args["teachers"] if method in MULTI_TEACHER else 1):
        model = create_model("convnet-bn", num_classes=data.num_classes, in_chans=data.channels,
                             image_size=data.image_size, width=WIDTHS[i % len(WIDTHS)]).train()
        with torch.no_grad():
            model(real)  # running statistics of real images
        models.append(model.eval().to(device))
        infos.append(type("Info", (), {"test_accuracy": 60.0 + 5 * i, "in_chans": None})())
    budget = PUBLISHED_BUDGET[method]
    probe = make_config(method, overrides={"ipc": args["ipc"], "classes": classes, "iterations": budget})
    run = max(2 * (probe.k + 1), round(budget * args["scale"]))
    cfg = make_config(method, overrides={"ipc": args["ipc"], "classes": classes, "iterations": run}).resolve(
        data.image_size, data.num_classes, data.hflip, device.type, channels=data.channels)
    teachers = equip_teachers(models, infos, data, cfg, device)
    by_class = {c: torch.nonzero(data.train.labels == c).flatten() for c in classes}
    patches = torch.stack([torch.stack([data.train.load([int(by_class[c][g])])[0] for c in classes])
                           for g in range(args["ipc"])]) if cfg.init == "real" else None
    def fresh():
        return init_state(cfg, classes, list(range(args["ipc"])), patches, data.image_size, data.channels,
                          data.mean, data.std)

    warm = fresh()  # one untimed stage: first-call costs (kernels, allocator) are not per-iteration costs
    run_stage(warm, teachers, cfg, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    state = fresh()
    while not state.done:
        run_stage(state, teachers, cfg, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:  # ru_maxrss is in KiB on Linux
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    seconds = time.perf_counter() - started
    images = len(classes) * args["ipc"]
    queue.put({"method": method, "teachers": len(teachers), "budget": budget, "iterations_run": run,
               "s_per_image": seconds / images * budget / run, "peak_mb": peak_mb, "precision": cfg.precision})


def measure_all(args: dict) -> list[dict]:
    """One fresh process per method, one after another, so one method's peak is not another's."""
    ctx = mp.get_context("spawn")
    rows = []
    for method in PUBLISHED_BUDGET:
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(method, args, queue))
        proc.start()
        row = queue.get()
        proc.join()
        rows.append(row)
    base = next(r for r in rows if r["method"] == "fadrm")
    for r in rows:
        r["ratio_to_fadrm"] = r["s_per_image"] / base["s_per_image"]
    return rows


def table(rows: list[dict], device: str) -> str:
    mem = "peak MB (CUDA allocated)" if device == "cuda" else "peak MB (RSS growth)"
    ours = [r["method"] for r in sorted(rows, key=lambda r: -r["s_per_image"]) if r["method"] in PAPER]
    lines = [f"| method | teachers | budget T | s / image | x FADRM | {mem} | paper s / image | paper GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, gb = PAPER.get(r["method"], ("-", "-"))
        lines.append(f"| {r['method']} | {r['teachers']} | {r['budget']} | {r['s_per_image']:.3f} | "
                     f"{r['ratio_to_fadrm']:.2f} | {r['peak_mb']:.1f} | {s} | {gb} |")
    lines += ["", "ranking here (slowest first): " + " > ".join(ours),
              "ranking in the paper:         " + " > ".join(sorted(PAPER, key=lambda m: -PAPER[m][0]))]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speed.efficiency", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="digits")
    p.add_argument("--ipc", type=int, default=1)
    p.add_argument("--classes", default="0,1,2", help="comma-separated class indices; empty = all")
    p.add_argument("--teachers", type=int, default=2, help="teachers of the multi-teacher methods")
    p.add_argument("--scale", type=float, default=0.05, help="fraction of each budget actually run")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not (0 < a.scale <= 1) or a.ipc < 1 or not (1 <= a.teachers <= len(WIDTHS)):
        p.error(f"--scale must be in (0, 1], --ipc >= 1, --teachers in [1, {len(WIDTHS)}]")
    args = {"dataset": a.dataset, "ipc": a.ipc, "teachers": a.teachers, "scale": a.scale, "device": a.device,
            "threads": a.threads, "classes": [int(c) for c in a.classes.split(",") if c.strip()]}
    rows = measure_all(args)
    print(json.dumps(rows, indent=1) if a.json else table(rows, a.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
