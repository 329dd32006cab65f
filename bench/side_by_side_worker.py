"""One contender of bench/side_by_side.py in a process of its own.

    python -m bench.side_by_side_worker SETUP.json

SETUP.json (written by the parent) names the contender, the device, the image size, the batch,
the timed and warm-up steps, the random ResNet-18's weights file and the patches. The worker
builds its loop, warms it up (every stage shape once, so cuDNN's choices and any compiling are
behind it), prints one JSON line `{"ready": ...}`, then answers each stdin line `run` with one
JSON line: the seconds of `steps` timed steps (four stages and their merges) and the peak memory
of that run; `run T` the same over one whole schedule of T steps; `profile DIR` profiles 20 steps,
writes DIR/summary.json (and the trace, gzipped, where it is small) and answers with the summary;
`quit` ends it.

The contenders:

- the published loop (`official`, `official-benchmark`, `official-like`: the setup's
  `published` settings, bench/side_by_side.py's PUBLISHED): its per-iteration work, driven through its own modules
  imported from the directory the parent was given: the teacher built, loaded and frozen by its
  `utils_recover.load_recover_model` (torchvision's ResNet-18 from a state dict, as its
  `imagenet1k` offline path does), its `BNFeatureHook`s, its `lr_cosine_policy` and `clip`, and
  the order of operations of its `recover.py` `get_images` loop: torchvision's
  `RandomResizedCrop` (antialiased as released; bilinear without antialias, as ours resamples,
  in `official-like`) + `RandomHorizontalFlip` of the whole batch, a roll drawn by `random`,
  `torch.amp.autocast('cuda')` with a `GradScaler`, Adam(betas 0.5, 0.9), the clip after each
  step, one `loss.item()` every 100 iterations, and a bilinear resize and merge with the patch
  between stages. Its autocast and scaler name CUDA, so on a CPU they are off and it runs fp32,
  as the published script would. cuDNN's autotuning is off, as the published script leaves it,
  but in `official-benchmark` and `official-like`. The published `utils_recover` imports OpenCV at the top for
  reading patch files, which this loop does not do; where OpenCV is not installed a stand-in
  module takes its name and raises if called.
- `ours:NAME`: `fadrm_ray.recover` at the same setting, the config overrides NAME stands for
  (bench/side_by_side.py's OURS), with the engine's own `pack` (an integer, or "auto": what a
  default run packs on this device).
"""
from __future__ import annotations

import json
import random
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from bench.speed_worker import peak_rss_mb, reset_peak_rss, sync

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's, as the published imagenet1k path
LR, ALPHA, R_BN, FIRST_BN = 0.25, 0.5, 0.01, 10.0              # the released ImageNet-1K recover script's


def stage_sizes(size: int) -> list[int]:
    """MRO as the released ImageNet-1K script: D_ds, D, D_ds, D with D_ds = 200/224 of D."""
    low = int(round(size * 200 / 224))
    return [low, size, low, size]


def budgets(steps: int) -> list[int]:
    return [steps // 4 + (1 if s < steps % 4 else 0) for s in range(4)]


# --------------------------------------------------------------------------- the published loop
def import_official(directory: str | Path):
    """The published repository's `recover/utils_recover.py`, imported from `directory`."""
    root = Path(directory).resolve()
    if not (root / "recover" / "utils_recover.py").is_file():
        raise SystemExit(f"{root} is not a checkout of the published FADRM code (no recover/utils_recover.py)")
    try:
        import cv2  # noqa: F401
    except ImportError:
        sys.modules["cv2"] = _absent("cv2", "OpenCV is not installed; the benchmark reads no patch files")
    for path in (str(root), str(root / "recover")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import utils_recover

    return utils_recover


def _absent(name: str, why: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def __getattr__(attr):
        raise RuntimeError(f"{name}.{attr}: {why}")

    module.__getattr__ = __getattr__
    return module


class OfficialLoop:
    """The published loop's per-iteration work on one batch (module docstring)."""

    def __init__(self, setup: dict, device: torch.device):
        from torchvision import transforms

        self.utils = import_official(setup["official"])
        self.device, self.steps = device, setup["steps"]
        self.antialias = bool(setup["published"]["antialias"])
        self.args = SimpleNamespace(pretrained_model_type="offline", dataset_name="imagenet1k",
                                    model_pool_dir=str(Path(setup["weights"]).parent), mean_norm=MEAN, std_norm=STD)
        models, hooks, _ = self.utils.load_recover_model(["ResNet18"], self.args, device)
        self.model, self.hooks = models[0], hooks[0]
        self.transforms = transforms
        patches = torch.load(setup["patches"])  # uint8 (B, 3, D, D)
        mean, std = torch.tensor(MEAN).view(1, -1, 1, 1), torch.tensor(STD).view(1, -1, 1, 1)
        self.patch = ((patches.float() / 255 - mean) / std).to(device)
        self.targets = torch.arange(patches.shape[0], device=device)
        self.jitter = setup["jitter"]
        self.sizes = stage_sizes(setup["size"])

    def prepare(self, steps: int) -> None:
        """The starting images (outside the timed window, as ours: `OurLoop.prepare`)."""
        size = self.sizes[0]
        self.start = F.interpolate(self.patch, size=(size, size), mode="bilinear", align_corners=False)

    def run(self, steps: int) -> torch.Tensor:
        cuda = self.device.type == "cuda"
        sizes, plan = self.sizes, budgets(steps)
        inputs = self.start.requires_grad_(True)
        schedule = self.utils.lr_cosine_policy(LR, 0, steps)
        criterion = torch.nn.CrossEntropyLoss().to(self.device)
        scaler = torch.amp.GradScaler("cuda", enabled=cuda)
        rescale = [FIRST_BN] + [1.0] * (len(self.hooks) - 1)
        it = 0
        for stage, (budget, size) in enumerate(zip(plan, sizes)):
            optimizer = torch.optim.Adam([{"params": [inputs], "lr": LR}], betas=[0.5, 0.9], eps=1e-8)
            aug = self.transforms.Compose([self.transforms.RandomResizedCrop(size, antialias=self.antialias),
                                           self.transforms.RandomHorizontalFlip()])
            for _ in range(budget):
                schedule(optimizer, it, it)
                view = aug(inputs)
                view = torch.roll(view, shifts=(random.randint(0, self.jitter), random.randint(0, self.jitter)),
                                  dims=(2, 3))
                optimizer.zero_grad()
                with torch.amp.autocast(device_type="cuda", enabled=cuda):
                    out = self.model(view)
                    loss_ce = criterion(out, self.targets)
                    loss_bn = sum(hook.r_feature * rescale[i] for i, hook in enumerate(self.hooks))
                    loss = R_BN * loss_bn + loss_ce
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                inputs.data = self.utils.clip(inputs.data, self.args)
                if it % 100 == 0:
                    loss.item()
                it += 1
            inputs = inputs.detach()
            if stage + 1 < len(plan):
                nxt = sizes[stage + 1]
                if nxt != size:
                    inputs = F.interpolate(inputs, size=(nxt, nxt), mode="bilinear", align_corners=False)
                patch = self.patch if nxt == self.patch.shape[-1] else F.interpolate(
                    self.patch, size=(nxt, nxt), mode="bilinear", align_corners=False)
                inputs = ALPHA * inputs + (1 - ALPHA) * patch
            inputs.requires_grad = True
        return inputs.detach()

    def describe(self) -> dict:
        return {"pack": 1, "precision": "fp16" if self.device.type == "cuda" else "fp32", "antialias": self.antialias,
                "cudnn_benchmark": torch.backends.cudnn.benchmark}


# --------------------------------------------------------------------------- ours
class OurLoop:
    """`fadrm_ray.recover` at the same setting, with the overrides of one contender."""

    def __init__(self, setup: dict, device: torch.device):
        import torchvision

        from fadrm_ray.packing import pack_limit
        from fadrm_ray.frozen_teacher import FrozenTeacher
        from fadrm_ray.runtime import tune_allocator

        tune_allocator()
        self.device, self.size = device, setup["size"]
        model = torchvision.models.resnet18(weights=None)
        model.load_state_dict(torch.load(setup["weights"], weights_only=True))
        self.teacher = FrozenTeacher(model.to(device))
        self.patches = torch.load(setup["patches"])  # uint8 (B, 3, D, D)
        self.classes = list(range(self.patches.shape[0]))
        self.overrides = dict(setup["overrides"])
        low = stage_sizes(self.size)[0]
        self.base = {"downsample_size": low, "classes": self.classes, "lr": LR, "alpha": ALPHA, "r_bn": R_BN,
                     "first_bn_weight": FIRST_BN, "jitter": setup["jitter"], "crop_scale_min": 0.08,
                     "bound": "clamp", "flip": True, "k": 3}
        probe = self.config(8, pack=self.overrides.get("pack", 1), ipc=1)
        self.pack = pack_limit(probe, len(self.classes), self.size, 3, [self.teacher], device)

    def config(self, steps: int, **extra):
        from fadrm_ray.config import make_config

        values = {**self.base, **{k: v for k, v in self.overrides.items() if k != "pack"}, **extra,
                  "iterations": steps}
        return make_config("fadrm", overrides=values).resolve(self.size, 1000, True, self.device.type, channels=3)

    def prepare(self, steps: int) -> None:
        """The starting state (`init_state`: patches normalized and resized on the host), outside
        the timed window, as the published loop's starting images (`OfficialLoop.prepare`)."""
        from fadrm_ray.recover import init_state

        self.cfg = self.config(steps, pack=self.pack, ipc=self.pack)
        patches = self.patches.unsqueeze(0).expand(self.pack, *self.patches.shape).contiguous()
        self.state = init_state(self.cfg, self.classes, list(range(self.pack)), patches, self.size, 3, MEAN, STD)

    def run(self, steps: int) -> torch.Tensor:
        from fadrm_ray.recover import recover

        recover(self.state, [self.teacher], self.cfg, self.device)
        return self.state.x

    def describe(self) -> dict:
        cfg = self.config(8, pack=self.pack, ipc=self.pack)
        return {"pack": self.pack, "precision": cfg.precision, "compile": cfg.compile,
                "channels_last": cfg.channels_last}


# --------------------------------------------------------------------------- the process
def timed(loop, steps: int, device: torch.device) -> dict:
    loop.prepare(steps)
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(device.type)
    started = time.perf_counter()
    x = loop.run(steps)
    sync(device.type)
    seconds = time.perf_counter() - started
    out = {"seconds": seconds, "steps": steps, "finite": bool(torch.isfinite(x).all())}
    if device.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        out["peak_rss_mb"] = peak_rss_mb()
    return out


TRACE_LIMIT = 4 << 20  # bytes of a gzipped trace kept beside its summary


def profile(loop, device: torch.device, folder: Path, steps: int = 20) -> dict:
    """A torch.profiler summary of `steps` steps: the busiest ops, and on CUDA the kernel time
    against the wall time and the host syncs; written to `folder`/summary.json, and the trace
    beside it (trace.json.gz) where it is at most TRACE_LIMIT bytes gzipped."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    folder.mkdir(parents=True, exist_ok=True)
    loop.prepare(steps)
    sync(device.type)
    with torch_profile(activities=activities) as prof:
        started = time.perf_counter()
        loop.run(steps)
        sync(device.type)
        wall = time.perf_counter() - started
    raw = folder / "trace.json"
    prof.export_chrome_trace(str(raw))
    trace = folder / "trace.json.gz"
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    trace_bytes = trace.stat().st_size
    if trace_bytes > TRACE_LIMIT:
        trace.unlink()
    events = prof.key_averages()
    cuda = device.type == "cuda"

    def self_us(e):
        return getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total

    top = sorted(events, key=self_us, reverse=True)[:12]
    out = {"steps": steps, "wall_ms_per_step": 1000 * wall / steps,
           "trace": str(trace) if trace_bytes <= TRACE_LIMIT else None, "trace_gzip_bytes": trace_bytes,
           "top": [{"op": e.key, "calls_per_step": e.count / steps, "ms_per_step": self_us(e) / 1000 / steps}
                   for e in top]}
    if cuda:
        kernels = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000
        syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                           "cudaEventSynchronize"))
        copies = sum(e.count for e in events if e.key.startswith("cudaMemcpy"))
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                             "cuLaunchKernel", "cuLaunchKernelEx"))
        out.update(kernel_ms_per_step=kernels / steps, busy_share=kernels / (1000 * wall),
                   host_syncs_per_step=syncs / steps, memcpy_calls_per_step=copies / steps,
                   kernel_launches_per_step=launches / steps)
    else:
        out["ops_ms_per_step"] = sum(e.self_cpu_time_total for e in events) / 1000 / steps
    # Every operator call the profiler recorded (nested calls counted), and those called from
    # Python directly (no recorded parent): what each step asks of the dispatcher.
    recorded = prof.events()
    out["op_calls_per_step"] = len(recorded) / steps
    out["top_level_op_calls_per_step"] = sum(1 for e in recorded if e.cpu_parent is None) / steps
    (folder / "summary.json").write_text(json.dumps(out, indent=2))
    return out


def main(argv=None) -> None:
    setup = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    device = torch.device(setup["device"])
    torch.manual_seed(0)
    random.seed(0)
    if device.type == "cuda":  # ours turns cuDNN's autotuning on itself (runtime.autotune_convolutions)
        published = setup.get("published") or {}
        torch.backends.cudnn.benchmark = bool(published.get("cudnn_benchmark"))  # the published script: off
    loop = OfficialLoop(setup, device) if setup.get("published") else OurLoop(setup, device)
    warm = timed(loop, 2 * 4, device)  # two steps per stage: every shape once
    print(json.dumps({"ready": True, "warmup_seconds": warm["seconds"], **loop.describe()}), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        try:
            if command == "quit":
                break
            if command == "run":  # `run`: the setup's steps; `run T`: one whole schedule of T steps
                reply = timed(loop, int(arg) if arg else setup["steps"], device)
            elif command == "profile":
                reply = profile(loop, device, Path(arg))
            else:
                reply = {"error": f"unknown command {command!r}"}
        except Exception as exc:  # report and go on: the parent decides
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
