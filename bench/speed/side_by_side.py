"""The published FADRM recover loop and ours, side by side on one device, in one run.

    python -m bench.speed.side_by_side --official DIR [--device cpu|cuda] [--size 32] [--batch 10]
                                       [--rounds 3] [--steps N] [--published NAMES] [--ours NAMES]
                                       [--schedule T [--schedule-for NAMES]] [--profile DIR
                                       [--profile-for NAMES]] [--record FILE] [--json]
    python -m bench.speed.side_by_side --no-official ...   ours alone (where the published code is absent)
    python -m bench.speed.side_by_side --share 2 ...       ours in 2 processes sharing the device, against 1

DIR is a checkout of the published code (github.com/Jiacheng8/FADRM: `recover/recover.py`,
`recover/utils_recover.py`, `models/`); `$FADRM_OFFICIAL` may name it instead. It is imported
from there, never copied into this project.

The setting is the released ImageNet-1K recover script's: a torchvision ResNet-18 (random
weights, the same for every contender: a step's cost does not depend on them), `--size` px
(224 on CUDA, 32 on a CPU), MRO stages at 200/224 of the size (D_ds, D, D_ds, D), ARC alpha 0.5,
lr 0.25, r_bn 0.01, crops of 8-100 %, flips, rolls of up to 32 px (4 below 128 px), one batch of
`--batch` classes (100 on CUDA, 10 on a CPU) starting from the same random patches. Each
contender runs in its own process (bench/speed/contender.py), warms up every stage shape,
then times `--steps` steps (four stages and three merges) per round; the rounds alternate the
contenders, so a change of load hits them all, and each figure is the median over rounds.

Contenders: the published loop (its own fp16 autocast and GradScaler on CUDA; fp32 on a CPU,
where its CUDA autocast is off) in up to three settings (`--published`, PUBLISHED): `official`
as released (torchvision's RandomResizedCrop, which resamples with antialias, and cuDNN's
autotuning off, as its script leaves it), `official-benchmark` (cuDNN's autotuning on: a
one-flag change its users can make) and `official-like` (autotuning on and the crop resampled
bilinearly without antialias, as ours resamples it: like for like); `ours-eager-pack1` (the
engine at pack 1 as a run configures it, nothing compiled), `ours-default` (a run as typed: eager, with the automatic
pack: as many 1-image-per-class groups per forward/backward as the device holds well),
`ours-fast-pack1` (the engine's fast path at pack 1), `ours-fast-auto` (the fast path with the
automatic pack) and, asked for by name with `--pack N`, `ours-fast-packed` (the fast path at a
fixed pack of N: contenders that run at the same time must not each size an automatic pack to
the memory free as if alone). Figures are per step of one `--batch` batch: a packed
step of G groups counts as G steps. Printed: ms per step, seconds per image at T = 2000
(ms per step x 2000 / batch), peak memory (CUDA: max_memory_allocated; CPU: the process's peak
RSS), and the ratio of the published loop's time to each of ours. Seconds per image at T = 2000
from the per-step figure is a linear extrapolation: `--schedule T` also times one whole stage
schedule of T steps (T / 4 per stage, its merges and per-stage costs included) of each
contender (or of those in `--schedule-for`), reported as measured, beside it.

`--json` prints one object instead (`official_ms` (as released), `published_best` and its
`published_best_ms` (the fastest published setting), `ours_pack1_ms` (eager),
`ours_fast_pack1_ms`, `ours_best_ms` (the fastest of ours, per batch), `ratio_pack1`,
`ratio_fast_pack1`, `ratio_best` (against `official`), `ratios` (every published setting's time
over every one of ours), each contender's rounds and schedule, the device, torch and the CPU or
GPU name). `--profile DIR` adds a torch.profiler summary of 20 steps of each contender at pack 1
(or of those in `--profile-for`) in DIR/<contender>/summary.json: operator calls per step, the
busiest ops, and on CUDA the kernel time against the wall time, host syncs and kernel launches
per step; the trace beside it, gzipped, where it is small. `--record FILE` appends each figure to FILE (JSON lines,
bench/record.py) the moment it is measured: each contender's warm-up, round, schedule and
profile.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from bench.decode import cpu_name
from bench.record import Record
from bench.speed.contender import ContenderSetup, Published, inputs
from bench.speed.workers import Worker

ROOT = Path(__file__).resolve().parents[2]
T_PUBLISHED = 2000
# The engine's settings per contender; "fast" is the engine's own fast path on the device.
OURS = {"ours-eager-pack1": {"pack": 1, "compile": False},
        "ours-default": {"pack": "auto", "compile": False},
        "ours-fast-pack1": {"pack": 1, "fast": True},
        "ours-fast-auto": {"pack": "auto", "fast": True},
        "ours-fast-packed": {"pack": "fixed", "fast": True}}  # the pack of --pack N
# The published loop's settings per contender (module docstring).
PUBLISHED = {"official": Published(antialias=True, cudnn_benchmark=False),
             "official-benchmark": Published(antialias=True, cudnn_benchmark=True),
             "official-like": Published(antialias=False, cudnn_benchmark=True)}


def fast_overrides(device: str) -> dict:
    from fadrm_ray.packing import fast_path

    return fast_path(device)


def compile_disabled() -> str | None:
    """Why torch.compile compiles nothing in this process and those it starts (the fast path is
    then the eager step), or None."""
    if os.environ.get("TORCH_COMPILE_DISABLE", "").lower() in ("1", "true"):
        return "torch.compile is disabled (TORCH_COMPILE_DISABLE=1)"
    import torch._dynamo

    return "torch._dynamo is disabled" if torch._dynamo.config.disable else None


def worker_env(device: str) -> dict:
    """Every contender: the passive OpenMP policy and thread count a heavy process of ours gets
    (fadrm_ray.runtime), glibc's own malloc settings (ours applies its own in-process, with
    `tune_allocator`, as every heavy entry point of the library does)."""
    from fadrm_ray.runtime import ALLOCATOR_ENV, heavy_process_env

    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    env.update({k: v for k, v in heavy_process_env(environ=env).items() if k not in ALLOCATOR_ENV})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if device == "cpu":
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


class Setting(BaseModel):
    """What one `python -m bench.speed.side_by_side` call times (its flags, checked once)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str
    size: int
    batch: int
    rounds: int = 3
    steps: int
    official: str | None = None     # a checkout of the published code; None: ours alone
    published: list[str] = ["official"]  # which of PUBLISHED, where `official` is given
    ours: list[str] = [n for n in OURS if n != "ours-fast-packed"]  # which of OURS
    profile: str | None = None      # a folder for torch.profiler summaries of each contender at pack 1
    profile_for: list[str] | None = None   # which of them (None: all)
    pack: int | None = None         # the pack of ours-fast-packed
    schedule: int | None = None     # steps of one whole stage schedule timed per contender
    schedule_for: list[str] | None = None  # which contenders (None: all)
    record: str | None = None       # a JSON-lines file of each figure as it is measured

    @property
    def names(self) -> list[str]:
        return (list(self.published) if self.official else []) + list(self.ours)

    @property
    def jitter(self) -> int:
        return 32 if self.size >= 128 else min(4, max(1, self.size // 8))


def setups(setting: Setting, work: Path) -> dict[str, ContenderSetup]:
    """Each contender's setup; the random ResNet-18 and the patches they share are written to `work`."""
    shared = {"device": setting.device, "size": setting.size, "batch": setting.batch, "steps": setting.steps,
              "jitter": setting.jitter, **inputs(work, setting.size, setting.batch)}
    out = {}
    for name in setting.names:
        overrides = dict(OURS.get(name, {}))  # the published contenders have none
        if name == "ours-fast-packed":  # its pack is fixed by --pack
            overrides["pack"] = setting.pack
        if overrides.pop("fast", False):
            overrides.update(fast_overrides(setting.device))
        published = PUBLISHED.get(name)
        out[name] = ContenderSetup(contender=name, official=setting.official if published else None,
                                   published=published, overrides=overrides, **shared)
    return out


def start(setup: ContenderSetup, work: Path, env: dict, name: str | None = None) -> Worker:
    """A contender's worker process (bench/speed/contender.py), its setup written to `work`."""
    name = name or setup.contender
    path = work / f"{name}.json"
    path.write_text(setup.model_dump_json())
    return Worker(name, "bench.speed.contender", [str(path)], env)


def side_by_side(setting: Setting, log=print) -> dict:
    """Run the contenders (module docstring) and return the figures."""
    names, steps, record = setting.names, setting.steps, Record(setting.record)
    with tempfile.TemporaryDirectory(prefix="fadrm-side-by-side-") as tmp:
        work = Path(tmp)
        env = worker_env(setting.device)
        contenders = {}
        try:
            for name, setup in setups(setting, work).items():
                contenders[name] = start(setup, work, env)
            for name in names:
                hello = contenders[name].ready()
                record("ready", contender=name, **hello)
                log(f"  {name}: ready ({json.dumps(hello)})")
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for r in range(setting.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    runs[name].append(contenders[name].ask(run=steps))
                    record("round", contender=name, round=r, pack=contenders[name].hello["pack"], **runs[name][-1])
                log(f"  round {r + 1}/{setting.rounds}: " + ", ".join(
                    f"{n} {1000 * runs[n][-1]['seconds'] / steps / contenders[n].hello['pack']:.1f} ms" for n in names))
            schedules = {}
            for name in names if setting.schedule else []:  # one whole stage schedule of T steps
                if setting.schedule_for is None or name in setting.schedule_for:
                    schedules[name] = contenders[name].ask(run=setting.schedule)
                    record("schedule", contender=name, pack=contenders[name].hello["pack"], **schedules[name])
                    log(f"  {name}: a whole schedule of {setting.schedule} steps in {schedules[name]['seconds']:.2f} s")
            profiles = {}
            if setting.profile:
                for name in names:  # the pack-1 contenders: what one step costs, op by op
                    if contenders[name].hello["pack"] == 1 and (setting.profile_for is None or
                                                                name in setting.profile_for):
                        profiles[name] = contenders[name].ask(profile=str(Path(setting.profile).resolve() / name))
                        record("profile", contender=name, **profiles[name])
        finally:
            for c in contenders.values():
                c.close()
    return summarize(names, contenders, runs, schedules, profiles, setting)


def share(setting: Setting, processes: int = 2, log=print) -> dict:
    """Ours at pack 1 (eager) in `processes` processes on one device: one alone, then all at
    once, alternating; whether a second process fills the gaps one leaves (launches, syncs,
    Python) shows as the throughput of all of them against one."""
    steps, record = setting.steps, Record(setting.record)
    with tempfile.TemporaryDirectory(prefix="fadrm-share-") as tmp:
        work = Path(tmp)
        setup = setups(setting.model_copy(update={"official": None, "ours": ["ours-eager-pack1"]}), work)
        env = worker_env(setting.device)
        workers = [start(setup["ours-eager-pack1"], work, env, f"ours-eager-pack1-{i}") for i in range(processes)]
        try:
            for w in workers:
                w.ready()
            alone, together = [], []
            for _ in range(setting.rounds):
                alone.append(1000 * workers[0].ask(run=steps)["seconds"] / steps)
                for w in workers:
                    w.send(run=steps)
                replies = [w.read() for w in workers]
                # all of them ran `steps` steps in the time of the slowest
                together.append(1000 * max(r["seconds"] for r in replies) / (steps * processes))
                record("share", one_ms_per_step=alone[-1], shared_ms_per_step=together[-1], processes=processes)
                log(f"  share: one process {alone[-1]:.2f} ms/step, {processes} at once {together[-1]:.2f} ms/step")
        finally:
            for w in workers:
                w.close()
    one, many = statistics.median(alone), statistics.median(together)
    return {"processes": processes, "one_ms_per_step": one, "shared_ms_per_step": many, "gain": one / many,
            "rounds_one": alone, "rounds_shared": together}


def summarize(names, contenders, runs, schedules, profiles, setting: Setting) -> dict:
    device, steps, batch = setting.device, setting.steps, setting.batch
    rows = {}
    for name in names:
        pack = contenders[name].hello["pack"]
        per_step = [1000 * r["seconds"] / steps / pack for r in runs[name]]
        ms = statistics.median(per_step)
        peak = [r.get("peak_gb", r.get("peak_rss_mb")) for r in runs[name]]
        rows[name] = {"ms_per_step": ms, "rounds_ms": per_step, "pack": pack,
                      "precision": contenders[name].hello["precision"],
                      "seconds_per_image_at_T2000": ms / 1000 * T_PUBLISHED / batch,  # extrapolated
                      "peak": max(peak), "peak_unit": "GB" if device.startswith("cuda") else "MB (process RSS)",
                      "finite": all(r["finite"] for r in runs[name])}
        if name in schedules:  # measured over one whole schedule: every per-stage cost in it
            done = schedules[name]
            rows[name]["schedule"] = {"steps": done["steps"], "seconds": done["seconds"],
                                      "ms_per_step": 1000 * done["seconds"] / done["steps"] / pack,
                                      "seconds_per_image": done["seconds"] / (batch * pack), "finite": done["finite"]}
            rows[name]["finite"] = rows[name]["finite"] and done["finite"]
    ours = [n for n in names if n in OURS]
    published = [n for n in names if n in PUBLISHED]
    best = min(ours, key=lambda n: rows[n]["ms_per_step"])

    def ms(name):
        return rows[name]["ms_per_step"] if name in rows else None

    out = {"device": device, "torch": torch.__version__, "cpu": cpu_name(), "threads": torch.get_num_threads(),
           "setting": {**setting.model_dump(include={"size", "batch", "steps", "rounds"}), "jitter": setting.jitter},
           "contenders": rows, "ours_pack1_ms": ms("ours-eager-pack1"), "ours_fast_pack1_ms": ms("ours-fast-pack1"),
           "ours_best_ms": ms(best), "ours_best": best,
           "official_ms": None, "ratio_pack1": None, "ratio_fast_pack1": None, "ratio_best": None,
           "published_best": None, "published_best_ms": None}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    if published:
        top = min(published, key=lambda n: rows[n]["ms_per_step"])
        out.update(published_best=top, published_best_ms=rows[top]["ms_per_step"],
                   ratios={p: {o: rows[p]["ms_per_step"] / rows[o]["ms_per_step"] for o in ours} for p in published})
    if "official" in rows:
        official = rows["official"]["ms_per_step"]
        out.update(official_ms=official, ratio_best=official / out["ours_best_ms"])
        for key, name in (("ratio_pack1", "ours-eager-pack1"), ("ratio_fast_pack1", "ours-fast-pack1")):
            if name in rows:
                out[key] = official / rows[name]["ms_per_step"]
                # the ratios of each round, where a change of load between rounds cancels out
                out[key + "_rounds"] = [o / e for o, e in zip(rows["official"]["rounds_ms"], rows[name]["rounds_ms"])]
    why = compile_disabled()
    if why and any(OURS[n].get("fast") for n in ours):
        out["fast_is_eager"] = f"{why}: the fast contenders ran the eager step"
    if profiles:
        out["profiles"] = profiles
    return out


def report(out: dict) -> str:
    s = out["setting"]
    where = out.get("gpu") or f"{out['cpu']}, {out['threads']} threads"
    lines = [f"recover step, ResNet-18, {s['size']} px, batch {s['batch']}, {s['steps']} steps x {s['rounds']} "
             f"rounds on {out['device']} ({where}), torch {out['torch']}",
             f"{'contender':<18} {'pack':>5} {'precision':>9} {'ms/step':>9} {'s/image@T2000':>14} "
             f"{'schedule s/image':>17} {'peak':>10} {'best published/this':>20}"]
    for name, r in out["contenders"].items():
        ratio = f"{out['published_best_ms'] / r['ms_per_step']:.2f}x" if out["published_best_ms"] else "-"
        unit = "GB" if r["peak_unit"] == "GB" else "MB"
        sched = f"{r['schedule']['seconds_per_image']:.3f} (T={r['schedule']['steps']})" if "schedule" in r else "-"
        lines.append(f"{name:<18} {r['pack']:>5} {r['precision']:>9} {r['ms_per_step']:>9.2f} "
                     f"{r['seconds_per_image_at_T2000']:>14.3f} {sched:>17} {r['peak']:>8.2f}{unit} {ratio:>20}"
                     + ("" if r["finite"] else "  NOT FINITE"))
    lines.append("s/image@T2000: the per-step time extrapolated linearly; schedule: one whole schedule, measured")
    if "fast_is_eager" in out:
        lines.append(f"NOTE {out['fast_is_eager']}")
    if out["published_best"]:
        lines.append(f"best published setting: {out['published_best']}")
    else:
        lines.append("published loop: not run (no --official DIR or $FADRM_OFFICIAL)")
    for name, p in out.get("profiles", {}).items():
        head = f"profile {name}: {p['wall_ms_per_step']:.2f} ms/step wall"
        if "op_calls_per_step" in p:
            head += f", {p['op_calls_per_step']:.0f} op calls ({p['top_level_op_calls_per_step']:.0f} from Python)"
        if "kernel_ms_per_step" in p:
            head += (f", kernels {p['kernel_ms_per_step']:.2f} ms ({100 * p['busy_share']:.0f}% busy), "
                     f"{p['kernel_launches_per_step']:.0f} launches, {p['host_syncs_per_step']:.2f} host syncs, "
                     f"{p['memcpy_calls_per_step']:.2f} copies per step")
        lines.append(head)
        lines += [f"    {t['ms_per_step']:8.3f} ms  {t['calls_per_step']:6.1f}x  {t['op']}" for t in p["top"][:8]]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", default=os.environ.get("FADRM_OFFICIAL"),
                        help="a checkout of github.com/Jiacheng8/FADRM (default: $FADRM_OFFICIAL)")
    parser.add_argument("--no-official", action="store_true", help="time ours alone")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--size", type=int, help="image size (default 224 on CUDA, 32 on a CPU)")
    parser.add_argument("--batch", type=int, help="classes per batch (default 100 on CUDA, 10 on a CPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="timed steps per round, a multiple of 4 (default 100 on CUDA, 40 "
                                                  "on a CPU)")
    parser.add_argument("--published", default="official",
                        help=f"which settings of the published loop, comma-separated, of {', '.join(PUBLISHED)}")
    parser.add_argument("--ours", default=",".join(n for n in OURS if n != "ours-fast-packed"),
                        help=f"which of ours, comma-separated (default: all of {', '.join(OURS)} but the last)")
    parser.add_argument("--schedule", type=int, metavar="T", help="also time one whole stage schedule of T steps "
                                                                  "(a multiple of 4) of each contender")
    parser.add_argument("--schedule-for", metavar="NAMES", help="only these contenders' schedules (comma-separated)")
    parser.add_argument("--profile", metavar="DIR", help="also profile 20 steps of each contender at pack 1: a "
                                                         "summary (and a small trace) per contender under DIR")
    parser.add_argument("--profile-for", metavar="NAMES", help="only these contenders' profiles (comma-separated)")
    parser.add_argument("--record", metavar="FILE", help="append each figure to FILE (JSON lines) as it is measured")
    parser.add_argument("--pack", type=int, default=None, help="the pack of ours-fast-packed (required with it)")
    parser.add_argument("--share", type=int, metavar="N",
                        help="instead: ours at pack 1 in N processes on the device, against one alone")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    size, batch, steps = args.size or (224 if cuda else 32), args.batch or (100 if cuda else 10), \
        args.steps or (100 if cuda else 40)
    if steps < 4 or steps % 4:
        parser.error("--steps must be a positive multiple of 4 (four stages)")
    if args.schedule is not None and (args.schedule < 4 or args.schedule % 4):
        parser.error("--schedule must be a positive multiple of 4 (four stages)")
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    if args.share:
        out = share(Setting(device=args.device, size=size, batch=batch, rounds=args.rounds, steps=steps,
                            record=args.record), args.share, log=log)
        out.update(device=args.device, torch=torch.__version__, cpu=cpu_name())
        print(json.dumps(out) if args.json else f"{args.share} processes on one {args.device}: "
              f"{out['shared_ms_per_step']:.2f} ms per batch-step against {out['one_ms_per_step']:.2f} alone "
              f"({out['gain']:.2f}x the throughput)")
        return
    official = None if args.no_official else args.official
    if official is None and not args.no_official:
        parser.error("--official DIR (a checkout of the published FADRM code) or $FADRM_OFFICIAL; --no-official "
                     "times ours alone")
    if official is not None and not (Path(official) / "recover" / "utils_recover.py").is_file():
        parser.error(f"--official {official}: no recover/utils_recover.py there (a checkout of Jiacheng8/FADRM?)")
    ours, published = _names(args.ours), _names(args.published)
    unknown = sorted(set(ours) - set(OURS))
    if unknown or not ours:
        parser.error(f"--ours: unknown {', '.join(unknown) or 'nothing'}; choose from {', '.join(OURS)}")
    unknown = sorted(set(published) - set(PUBLISHED))
    if unknown or not published:
        parser.error(f"--published: unknown {', '.join(unknown) or 'nothing'}; choose from {', '.join(PUBLISHED)}")
    chosen = {}
    for flag in ("schedule_for", "profile_for"):
        names = _names(getattr(args, flag)) if getattr(args, flag) else None
        stray = sorted(set(names or []) - set(ours) - set(published if official else []))
        if stray:
            parser.error(f"--{flag.replace('_', '-')}: {', '.join(stray)} is not a contender of this run")
        chosen[flag] = names
    if "ours-fast-packed" in ours and not (args.pack and args.pack >= 1):
        parser.error("ours-fast-packed needs --pack N (N >= 1)")
    out = side_by_side(Setting(device=args.device, size=size, batch=batch, rounds=args.rounds, steps=steps,
                               official=official, published=published, ours=ours, profile=args.profile,
                               pack=args.pack, schedule=args.schedule, record=args.record, **chosen), log=log)
    print(json.dumps(out) if args.json else report(out))


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


if __name__ == "__main__":
    main()
