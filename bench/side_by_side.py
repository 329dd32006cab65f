"""The published FADRM recover loop and ours, side by side on one device, in one run.

    python -m bench.side_by_side --official DIR [--device cpu|cuda] [--size 32] [--batch 10]
                                 [--rounds 3] [--steps N] [--profile DIR] [--json]
    python -m bench.side_by_side --no-official ...     ours alone (where the published code is absent)
    python -m bench.side_by_side --share 2 ...         ours in 2 processes sharing the device, against 1

DIR is a checkout of the published code (github.com/Jiacheng8/FADRM: `recover/recover.py`,
`recover/utils_recover.py`, `models/`); `$FADRM_OFFICIAL` may name it instead. It is imported
from there, never copied into this project.

The setting is the released ImageNet-1K recover script's: a torchvision ResNet-18 (random
weights, the same for every contender: a step's cost does not depend on them), `--size` px
(224 on CUDA, 32 on a CPU), MRO stages at 200/224 of the size (D_ds, D, D_ds, D), ARC alpha 0.5,
lr 0.25, r_bn 0.01, crops of 8-100 %, flips, rolls of up to 32 px (4 below 128 px), one batch of
`--batch` classes (100 on CUDA, 10 on a CPU) starting from the same random patches. Each
contender runs in its own process (bench/side_by_side_worker.py), warms up every stage shape,
then times `--steps` steps (four stages and three merges) per round; the rounds alternate the
contenders, so a change of load hits them all, and each figure is the median over rounds.

Contenders: `official` (the published loop, its own fp16 autocast and GradScaler on CUDA; fp32
on a CPU, where its CUDA autocast is off), `ours-eager-pack1` (the engine at pack 1 as a run
configures it, nothing compiled), `ours-default` (a run as typed: eager, with the automatic
pack: as many 1-image-per-class groups per forward/backward as the device holds well),
`ours-fast-pack1` (the engine's fast path at pack 1), `ours-fast-auto` (the fast path with the
automatic pack) and, asked for by name with `--pack N`, `ours-fast-packed` (the fast path at a
fixed pack of N: contenders that run at the same time must not each size an automatic pack to
the memory free as if alone). Figures are per step of one `--batch` batch: a packed
step of G groups counts as G steps. Printed: ms per step, seconds per image at T = 2000
(ms per step x 2000 / batch), peak memory (CUDA: max_memory_allocated; CPU: the process's peak
RSS), and the ratio of the published loop's time to each of ours. `--json` prints one object
instead (`official_ms`, `ours_pack1_ms` (eager), `ours_fast_pack1_ms`, `ours_best_ms` (the
fastest of ours, per batch), `ratio_pack1`, `ratio_fast_pack1`, `ratio_best`, each contender's
rounds, the device, torch and the CPU or GPU name). `--profile DIR` adds a torch.profiler trace
of 20 steps of each contender at pack 1 (DIR/<contender>/trace.json and a summary: operator calls
per step, the busiest ops, and on
CUDA the kernel time against the wall time, host syncs and kernel launches per step).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from bench.decode import cpu_name

ROOT = Path(__file__).resolve().parent.parent
T_PUBLISHED = 2000
# The engine's settings per contender; "fast" is the engine's own fast path on the device.
OURS = {"ours-eager-pack1": {"pack": 1, "compile": False},
        "ours-default": {"pack": "auto", "compile": False},
        "ours-fast-pack1": {"pack": 1, "fast": True},
        "ours-fast-auto": {"pack": "auto", "fast": True},
        "ours-fast-packed": {"pack": "fixed", "fast": True}}  # the pack of --pack N


def fast_overrides(device: str) -> dict:
    from fadrm_ray.packing import fast_path

    return fast_path(device)


class Contender:
    """One contender's worker process."""

    def __init__(self, name: str, setup: dict, work: Path, env: dict):
        self.name = name
        path = work / f"{name}.json"
        path.write_text(json.dumps({**setup, "contender": name}))
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.side_by_side_worker", str(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
        self.hello: dict = {}

    def ready(self) -> dict:
        """Wait for the worker's warm-up (the workers warm up, and compile, at the same time)."""
        if not self.hello:
            self.hello = self._read()
        return self.hello

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker exited (status {self.proc.wait()}); its error is above")
        reply = json.loads(line)
        if "error" in reply:
            raise SystemExit(f"{self.name}: {reply['error']}")
        return reply

    def ask(self, command: str) -> dict:
        self.send(command)
        return self._read()

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


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
    """What one `python -m bench.side_by_side` call times (its flags, checked once)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str
    size: int
    batch: int
    rounds: int = 3
    steps: int
    official: str | None = None     # a checkout of the published code; None: ours alone
    ours: list[str] = [n for n in OURS if n != "ours-fast-packed"]  # which of OURS
    profile: str | None = None      # a folder for torch.profiler traces of each contender at pack 1
    pack: int | None = None         # the pack of ours-fast-packed

    @property
    def jitter(self) -> int:
        return 32 if self.size >= 128 else min(4, max(1, self.size // 8))


def _inputs(setting: Setting, work: Path) -> dict:
    """The worker setup every contender shares: the random ResNet-18's weights (saved under the name
    the published loader looks for) and the patches, in `work`."""
    import torchvision

    torch.manual_seed(0)
    weights = work / "ResNet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), weights)
    patches = work / "patches.pt"
    torch.save(torch.randint(0, 256, (setting.batch, 3, setting.size, setting.size), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(1)), patches)
    return {"device": setting.device, "size": setting.size, "batch": setting.batch, "steps": setting.steps,
            "jitter": setting.jitter, "weights": str(weights), "patches": str(patches), "official": setting.official}


def side_by_side(setting: Setting, log=print) -> dict:
    """Run the contenders (module docstring) and return the figures."""
    names = (["official"] if setting.official else []) + list(setting.ours)
    steps = setting.steps
    with tempfile.TemporaryDirectory(prefix="fadrm-side-by-side-") as tmp:
        work = Path(tmp)
        base = _inputs(setting, work)
        env = worker_env(setting.device)
        contenders = {}
        try:
            for name in names:
                overrides = dict(OURS.get(name, {}))  # the published contender has none
                if overrides.get("pack") == "fixed":
                    overrides["pack"] = setting.pack
                if overrides.pop("fast", False):
                    overrides.update(fast_overrides(setting.device))
                contenders[name] = Contender(name, {**base, "overrides": overrides}, work, env)
            for name in names:
                log(f"  {name}: ready ({json.dumps(contenders[name].ready())})")
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for r in range(setting.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    runs[name].append(contenders[name].ask("run"))
                log(f"  round {r + 1}/{setting.rounds}: " + ", ".join(
                    f"{n} {1000 * runs[n][-1]['seconds'] / steps / contenders[n].hello['pack']:.1f} ms" for n in names))
            profiles = {}
            if setting.profile:
                for name in names:  # the pack-1 contenders: what one step costs, op by op
                    if contenders[name].hello["pack"] == 1:
                        profiles[name] = contenders[name].ask(f"profile {Path(setting.profile).resolve() / name}")
        finally:
            for c in contenders.values():
                c.close()
    return summarize(names, contenders, runs, profiles, setting)


def share(setting: Setting, processes: int = 2, log=print) -> dict:
    """Ours at pack 1 (eager) in `processes` processes on one device: one alone, then all at
    once, alternating; whether a second process fills the gaps one leaves (launches, syncs,
    Python) shows as the throughput of all of them against one."""
    steps = setting.steps
    with tempfile.TemporaryDirectory(prefix="fadrm-share-") as tmp:
        work = Path(tmp)
        base = {**_inputs(setting, work), "official": None, "overrides": dict(OURS["ours-eager-pack1"])}
        env = worker_env(setting.device)
        workers = [Contender(f"ours-eager-pack1-{i}", base, work, env) for i in range(processes)]
        try:
            for w in workers:
                w.ready()
            alone, together = [], []
            for _ in range(setting.rounds):
                alone.append(1000 * workers[0].ask("run")["seconds"] / steps)
                for w in workers:
                    w.send("run")
                replies = [w._read() for w in workers]
                # all of them ran `steps` steps in the time of the slowest
                together.append(1000 * max(r["seconds"] for r in replies) / (steps * processes))
                log(f"  share: one process {alone[-1]:.2f} ms/step, {processes} at once {together[-1]:.2f} ms/step")
        finally:
            for w in workers:
                w.close()
    one, many = statistics.median(alone), statistics.median(together)
    return {"processes": processes, "one_ms_per_step": one, "shared_ms_per_step": many, "gain": one / many,
            "rounds_one": alone, "rounds_shared": together}


def summarize(names, contenders, runs, profiles, setting: Setting) -> dict:
    device, steps, batch = setting.device, setting.steps, setting.batch
    rows = {}
    for name in names:
        pack = contenders[name].hello["pack"]
        per_step = [1000 * r["seconds"] / steps / pack for r in runs[name]]
        ms = statistics.median(per_step)
        peak = [r.get("peak_gb", r.get("peak_rss_mb")) for r in runs[name]]
        rows[name] = {"ms_per_step": ms, "rounds_ms": per_step, "pack": pack,
                      "precision": contenders[name].hello["precision"],
                      "seconds_per_image_at_T2000": ms / 1000 * T_PUBLISHED / batch,
                      "peak": max(peak), "peak_unit": "GB" if device.startswith("cuda") else "MB (process RSS)",
                      "finite": all(r["finite"] for r in runs[name])}
    ours = [n for n in names if n != "official"]
    best = min(ours, key=lambda n: rows[n]["ms_per_step"])

    def ms(name):
        return rows[name]["ms_per_step"] if name in rows else None

    out = {"device": device, "torch": torch.__version__, "cpu": cpu_name(), "threads": torch.get_num_threads(),
           "setting": {**setting.model_dump(include={"size", "batch", "steps", "rounds"}), "jitter": setting.jitter},
           "contenders": rows, "ours_pack1_ms": ms("ours-eager-pack1"), "ours_fast_pack1_ms": ms("ours-fast-pack1"),
           "ours_best_ms": ms(best), "ours_best": best,
           "official_ms": None, "ratio_pack1": None, "ratio_fast_pack1": None, "ratio_best": None}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    if "official" in rows:
        official = rows["official"]["ms_per_step"]
        out.update(official_ms=official, ratio_best=official / out["ours_best_ms"])
        for key, name in (("ratio_pack1", "ours-eager-pack1"), ("ratio_fast_pack1", "ours-fast-pack1")):
            if name in rows:
                out[key] = official / rows[name]["ms_per_step"]
                # the ratios of each round, where a change of load between rounds cancels out
                out[key + "_rounds"] = [o / e for o, e in zip(rows["official"]["rounds_ms"], rows[name]["rounds_ms"])]
    if profiles:
        out["profiles"] = profiles
    return out


def report(out: dict) -> str:
    s = out["setting"]
    where = out.get("gpu") or f"{out['cpu']}, {out['threads']} threads"
    lines = [f"recover step, ResNet-18, {s['size']} px, batch {s['batch']}, {s['steps']} steps x {s['rounds']} "
             f"rounds on {out['device']} ({where}), torch {out['torch']}",
             f"{'contender':<18} {'pack':>5} {'precision':>9} {'ms/step':>9} {'s/image@T2000':>14} {'peak':>10}"
             f" {'official/this':>14}"]
    for name, r in out["contenders"].items():
        ratio = f"{out['official_ms'] / r['ms_per_step']:.2f}x" if out["official_ms"] else "-"
        unit = "GB" if r["peak_unit"] == "GB" else "MB"
        lines.append(f"{name:<18} {r['pack']:>5} {r['precision']:>9} {r['ms_per_step']:>9.2f} "
                     f"{r['seconds_per_image_at_T2000']:>14.3f} {r['peak']:>8.2f}{unit} {ratio:>14}"
                     + ("" if r["finite"] else "  NOT FINITE"))
    if out["official_ms"] is None:
        lines.append("official: not run (no --official DIR or $FADRM_OFFICIAL)")
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
    parser = argparse.ArgumentParser(prog="python -m bench.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", default=os.environ.get("FADRM_OFFICIAL"),
                        help="a checkout of github.com/Jiacheng8/FADRM (default: $FADRM_OFFICIAL)")
    parser.add_argument("--no-official", action="store_true", help="time ours alone")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--size", type=int, help="image size (default 224 on CUDA, 32 on a CPU)")
    parser.add_argument("--batch", type=int, help="classes per batch (default 100 on CUDA, 10 on a CPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="timed steps per round, a multiple of 4 (default 100 on CUDA, 40 "
                                                  "on a CPU)")
    parser.add_argument("--ours", default=",".join(n for n in OURS if n != "ours-fast-packed"),
                        help=f"which of ours, comma-separated (default: all of {', '.join(OURS)} but the last)")
    parser.add_argument("--profile", metavar="DIR", help="also write a torch.profiler trace of 20 steps of each "
                                                         "contender at pack 1")
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
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    if args.share:
        out = share(Setting(device=args.device, size=size, batch=batch, rounds=args.rounds, steps=steps), args.share,
                    log=log)
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
    ours = [n.strip() for n in args.ours.split(",") if n.strip()]
    unknown = sorted(set(ours) - set(OURS))
    if unknown or not ours:
        parser.error(f"--ours: unknown {', '.join(unknown) or 'nothing'}; choose from {', '.join(OURS)}")
    if "ours-fast-packed" in ours and not (args.pack and args.pack >= 1):
        parser.error("ours-fast-packed needs --pack N (N >= 1)")
    out = side_by_side(Setting(device=args.device, size=size, batch=batch, rounds=args.rounds, steps=steps,
                               official=official, ours=ours, profile=args.profile, pack=args.pack), log=log)
    print(json.dumps(out) if args.json else report(out))


if __name__ == "__main__":
    main()
