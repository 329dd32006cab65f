"""One contender of bench.speed.side_by_side in a process of its own, and the loops it times.

    python -m bench.speed.contender SETUP.json

SETUP.json (a `ContenderSetup`, written by the parent) names the contender, the device, the image
size, the batch, the timed steps, the random ResNet-18's weights file and the patches. The worker
builds its loop, warms it up (every stage shape once, so cuDNN's choices and any compiling are
behind it), prints its hello, then answers each command line (a `ContenderCommand`,
bench/speed/workers.py) with one JSON line: `{"run": T}` the seconds of T steps (four stages and
their merges: the setup's steps, or one whole schedule) and the peak memory of that run;
`{"profile": DIR}` a profile of 20 steps (bench/speed/timing.py), written to DIR/summary.json (and
the trace, gzipped, where it is small), answered with the summary; `{"quit": true}` ends it.

The contenders:

- the published loop (`official`, `official-benchmark`, `official-like`: the setup's
  `published` settings, bench.speed.side_by_side's PUBLISHED): its per-iteration work, driven through its own modules
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
- `ours-*` (`OurLoop`): `fadrm_ray.recover` at the same setting, with the config overrides the
  contender stands for (bench.speed.side_by_side's OURS) and the engine's own `pack` (an integer,
  or "auto": what a default run packs on this device). bench.speed.imagenet times the same loop
  in its own process, against pack size and precision.
"""
from __future__ import annotations

import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pydantic import BaseModel, ConfigDict, model_validator

from bench.speed.timing import profile, timed
from bench.speed.workers import serve

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's, as the published imagenet1k path
LR, ALPHA, R_BN, FIRST_BN = 0.25, 0.5, 0.01, 10.0              # the released ImageNet-1K recover script's


class Published(BaseModel):
    """How a published contender runs the published loop (bench.speed.side_by_side's PUBLISHED)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    antialias: bool          # the crop resampled with antialias, as torchvision's RandomResizedCrop does
    cudnn_benchmark: bool    # cuDNN's autotuning (the published script leaves it off)


class ContenderSetup(BaseModel):
    """What one contender's process builds and times, written by its parent as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    contender: str
    device: str
    size: int                        # image size D; MRO stages at `stage_sizes(D)`
    batch: int                       # classes per batch, one image each
    steps: int                       # the timed steps of a round, a multiple of 4
    jitter: int
    weights: str                     # the random ResNet-18's state dict, named as the published loader looks for it
    patches: str                     # uint8 (batch, 3, D, D), torch.save'd
    official: str | None = None      # a checkout of the published code (its contenders only)
    published: Published | None = None
    overrides: dict = {}             # ours: config overrides; `pack` an integer, "auto" or absent (1)
    teacher: str | None = None       # ours: a teacher checkpoint instead of `weights` (its own mean/std)


class ContenderCommand(BaseModel):
    """One command to a contender's process: `run` steps (four stages and their merges), or a
    `profile` of 20 steps written to that folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    run: int | None = None
    profile: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.run is None) == (self.profile is None):
            raise ValueError("a command is either run or profile")
        return self


def inputs(work: Path, size: int, batch: int) -> dict:
    """The files every contender shares, in `work`: the random ResNet-18's weights (saved under the
    name the published loader looks for) and the patches (ContenderSetup's `weights`, `patches`)."""
    import torchvision

    torch.manual_seed(0)
    weights = work / "ResNet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), weights)
    patches = work / "patches.pt"
    torch.save(torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(1)), patches)
    return {"weights": str(weights), "patches": str(patches)}


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

    def __init__(self, setup: ContenderSetup, device: torch.device):
        from torchvision import transforms

        self.utils = import_official(setup.official)
        self.device, self.steps = device, setup.steps
        self.antialias = setup.published.antialias
        self.args = SimpleNamespace(pretrained_model_type="offline", dataset_name="imagenet1k",
                                    model_pool_dir=str(Path(setup.weights).parent), mean_norm=MEAN, std_norm=STD)
        models, hooks, _ = self.utils.load_recover_model(["ResNet18"], self.args, device)
        self.model, self.hooks = models[0], hooks[0]
        self.transforms = transforms
        patches = torch.load(setup.patches)  # uint8 (B, 3, D, D)
        mean, std = torch.tensor(MEAN).view(1, -1, 1, 1), torch.tensor(STD).view(1, -1, 1, 1)
        self.patch = ((patches.float() / 255 - mean) / std).to(device)
        self.targets = torch.arange(patches.shape[0], device=device)
        self.jitter = setup.jitter
        self.sizes = stage_sizes(setup.size)

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
    """`fadrm_ray.recover` at the same setting, with the overrides of one contender; with the
    setup's `teacher`, that checkpoint (and its normalization) instead of the random ResNet-18."""

    def __init__(self, setup: ContenderSetup, device: torch.device):
        import torchvision

        from fadrm_ray.packing import pack_limit
        from fadrm_ray.frozen_teacher import FrozenTeacher
        from fadrm_ray.runtime import tune_allocator

        tune_allocator()
        self.device, self.size = device, setup.size
        self.patches = torch.load(setup.patches)  # uint8 (B, 3, D, D)
        self.classes = list(range(self.patches.shape[0]))
        self.mean, self.std, self.num_classes = MEAN, STD, 1000
        if setup.teacher is None:
            model = torchvision.models.resnet18(weights=None)
            model.load_state_dict(torch.load(setup.weights, weights_only=True))
            self.described = "torchvision resnet18 (random init)"
        else:
            model = self._teacher(setup.teacher)
        self.teacher = FrozenTeacher(model.to(device))
        self.overrides = dict(setup.overrides)
        low = stage_sizes(self.size)[0]
        self.base = {"downsample_size": low, "classes": self.classes, "lr": LR, "alpha": ALPHA, "r_bn": R_BN,
                     "first_bn_weight": FIRST_BN, "jitter": setup.jitter, "crop_scale_min": 0.08,
                     "bound": "clamp", "flip": True, "k": 3}
        probe = self.config(8, pack=self.overrides.get("pack", 1), ipc=1)
        self.pack = pack_limit(probe, len(self.classes), self.size, 3, [self.teacher], device)

    def config(self, steps: int, **extra):
        from fadrm_ray.config import make_config

        values = {**self.base, **{k: v for k, v in self.overrides.items() if k != "pack"}, **extra,
                  "iterations": steps}
        return make_config("fadrm", overrides=values).resolve(self.size, self.num_classes, True, self.device.type,
                                                               channels=3)

    def _teacher(self, path: str):
        from fadrm_ray.models import load_teacher

        model, info = load_teacher(path)
        if info.in_chans != 3 or info.num_classes < len(self.classes):
            raise SystemExit(f"teacher {path}: needs 3 input channels and at least {len(self.classes)} classes, has "
                             f"{info.in_chans} and {info.num_classes}")
        self.mean, self.std, self.num_classes = list(info.mean), list(info.std), info.num_classes
        self.described = f"{info.model_name} from {path} (test top-1 {info.test_accuracy:.2f}%)"
        return model

    def prepare(self, steps: int) -> None:
        """The starting state (`init_state`: patches normalized and resized on the host), outside
        the timed window, as the published loop's starting images (`OfficialLoop.prepare`)."""
        from fadrm_ray.recover import init_state

        self.cfg = self.config(steps, pack=self.pack, ipc=self.pack)
        patches = self.patches.unsqueeze(0).expand(self.pack, *self.patches.shape).contiguous()
        self.state = init_state(self.cfg, self.classes, list(range(self.pack)), patches, self.size, 3, self.mean,
                                self.std)

    def run(self, steps: int) -> torch.Tensor:
        from fadrm_ray.recover import recover

        recover(self.state, [self.teacher], self.cfg, self.device)
        return self.state.x

    def describe(self) -> dict:
        cfg = self.config(8, pack=self.pack, ipc=self.pack)
        return {"pack": self.pack, "precision": cfg.precision, "compile": cfg.compile,
                "channels_last": cfg.channels_last}


# --------------------------------------------------------------------------- the process
def run_once(loop, steps: int, device: torch.device) -> dict:
    """`steps` steps of `loop`, its starting state made outside the timed window."""
    loop.prepare(steps)
    seconds, x, peak = timed(lambda: loop.run(steps), device.type)
    return {"seconds": seconds, "steps": steps, "finite": bool(torch.isfinite(x).all()), **peak}


def main(argv=None) -> None:
    setup = ContenderSetup.model_validate_json(Path((argv or sys.argv[1:])[0]).read_text())
    device = torch.device(setup.device)
    torch.manual_seed(0)
    random.seed(0)
    if device.type == "cuda":  # ours turns cuDNN's autotuning on itself (runtime.autotune_convolutions)
        torch.backends.cudnn.benchmark = bool(setup.published and setup.published.cudnn_benchmark)  # published: off
    loop = OfficialLoop(setup, device) if setup.published else OurLoop(setup, device)
    warm = run_once(loop, 2 * 4, device)  # two steps per stage: every shape once

    def answer(line: dict) -> dict:
        command = ContenderCommand.model_validate(line)
        if command.run is not None:
            return run_once(loop, command.run, device)
        loop.prepare(20)
        return profile(lambda: loop.run(20), device.type, 20, Path(command.profile))

    serve({"warmup_seconds": warm["seconds"], **loop.describe()}, answer)


if __name__ == "__main__":
    main()
