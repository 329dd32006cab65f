"""A stand-in for `recover/utils_recover.py` of the published FADRM code (github.com/Jiacheng8/FADRM),
written for this project's tests; it is not that code.

It has the names and signatures bench/speed/contender.py imports from a checkout of the
published code (`load_recover_model`, `BNFeatureHook`, `lr_cosine_policy`, `clip`), each doing
the work of the published recover step in a few lines: the frozen torchvision teacher loaded
from `<model_pool_dir>/<name>.pth` with a hook on every BatchNorm layer that measures the
distance of the batch's statistics from the running ones, the cosine learning rate, the clip of
the normalized pixels to [0, 1]. With it the side-by-side's published contender, and
bench/gpu_check.sh on the path a GPU run takes, run in CI; the real code is fetched for the
GPU run (bench/gpu_check.sh, its header).
"""
import math
import os

import torch
import torchvision


def lr_cosine_policy(base_lr, warmup_length, epochs):
    """`set_lr(optimizer, iteration, epoch)`: a linear warm-up, then a cosine from `base_lr` to 0."""
    def set_lr(optimizer, iteration, epoch):
        if epoch < warmup_length:
            lr = base_lr * (epoch + 1) / warmup_length
        else:
            lr = 0.5 * (1 + math.cos(math.pi * (epoch - warmup_length) / (epochs - warmup_length))) * base_lr
        for group in optimizer.param_groups:
            group["lr"] = lr
    return set_lr


def clip(image_tensor, args, use_fp16=False):
    """Normalized images whose pixels, de-normalized, stay in [0, 1] (in place)."""
    for c, (m, s) in enumerate(zip(args.mean_norm, args.std_norm)):
        image_tensor[:, c] = image_tensor[:, c].clamp(-m / s, (1 - m) / s)
    return image_tensor


class BNFeatureHook:
    """After each forward, `r_feature`: the L2 distances of the batch's per-channel mean and
    variance at this BatchNorm layer's input from its running ones, summed."""

    def __init__(self, module):
        self.hook = module.register_forward_hook(self.hook_fn)

    def hook_fn(self, module, inputs, output):
        x = inputs[0]
        mean = x.mean(dim=(0, 2, 3))
        var = x.transpose(0, 1).flatten(1).var(dim=1, unbiased=False)
        self.r_feature = torch.norm(module.running_var - var, 2) + torch.norm(module.running_mean - mean, 2)

    def close(self):
        self.hook.remove()


def load_recover_model(recover_model_name_list, args, device):
    """(teachers, the BN hooks of each, weights): each named torchvision model (the ImageNet-1K
    offline path) loaded from `args.model_pool_dir`, frozen in eval mode on `device`."""
    builders = {"ResNet18": torchvision.models.resnet18, "ResNet50": torchvision.models.resnet50,
                "MobileNetV2": torchvision.models.mobilenet_v2}
    teachers, hooks = [], []
    for name in recover_model_name_list:
        model = builders[name](weights=None)
        model.load_state_dict(torch.load(os.path.join(args.model_pool_dir, name + ".pth"), weights_only=True))
        model = model.to(device).eval()
        for p in model.parameters():
            p.requires_grad = False
        teachers.append(model)
        hooks.append([BNFeatureHook(m) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)])
    return teachers, hooks, []
