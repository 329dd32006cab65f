"""`fadrm import-teacher`: a teacher checkpoint made from a classifier's weights trained elsewhere
(torchvision, timm, a state dict)."""
from __future__ import annotations

from typing import Sequence

from fadrm_ray.cli.common import DATASET_HELP, CLIError, common_parser, emit, note

NAME = "import-teacher"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser()],
                       help="make a teacher checkpoint from a classifier's weights (torchvision, timm, a state dict)")
    p.add_argument("--model", required=True,
                   help="torchvision:NAME, timm:NAME, convnet-bn or resnet18-cifar (the architecture of the weights)")
    p.add_argument("--weights", required=True,
                   help="a weights file (.pth, .bin, .safetensors), a torchvision weights name such as IMAGENET1K_V1 "
                        "(torch hub's cache), or `pretrained` for timm's Hugging Face cache")
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--out", required=True, help="the teacher checkpoint to write (a new file, e.g. r18.pt)")
    p.add_argument("--eval-images", type=int, default=None,
                   help="measure top-1 on this many test images spread over the classes (default: all of them)")
    p.add_argument("--mean", default=None, help="normalization mean per channel, e.g. 0.485,0.456,0.406 "
                                                "(default: the weights' metadata, else measured: ImageNet's or "
                                                "the dataset's, whichever scores better)")
    p.add_argument("--std", default=None, help="normalization std per channel (with --mean)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="a keyword of the model's builder, e.g. width=32 for convnet-bn (repeatable)")
    p.add_argument("--accept-chance", action="store_true",
                   help="write the teacher even when its top-1 is no better than chance (and without the "
                        "check that it does not take whole classes for one another)")
    p.add_argument("--class-order", default=None, metavar="NAME,NAME,...",
                   help="the dataset class of each of the weights' outputs, in output order (class names or "
                        "indices), where the weights were trained with another class order than the dataset's "
                        "sorted folders: their outputs are reordered to the dataset's (weights whose metadata "
                        "names their categories are reordered by those names without it)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--data-root", default=None, help="where downloadable datasets live")
    return p


def _floats(text: str | None, flag: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise CLIError(f"{flag} takes comma-separated numbers like 0.485,0.456,0.406, got {text!r}") from None


def _model_args(items: Sequence[str]) -> dict:
    """`key=value` keywords of a model builder, values read as YAML (32, [1, 2], true)."""
    import yaml

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise CLIError(f"--model-arg {item!r} must look like key=value, e.g. width=32")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise CLIError(f"--model-arg {item!r}: cannot read the value {raw!r}") from None
    return out


def run(args) -> None:
    """Wrap a classifier's weights trained elsewhere into a teacher checkpoint for a dataset."""
    from fadrm_ray.teacher_import import ImportSettings, import_teacher

    settings = ImportSettings(model=args.model, weights=args.weights, dataset=args.dataset, out=args.out,
                              eval_images=args.eval_images, mean=_floats(args.mean, "--mean"),
                              std=_floats(args.std, "--std"), model_kwargs=_model_args(args.model_arg or []),
                              accept_chance=args.accept_chance, device=args.device, data_root=args.data_root,
                              class_order=tuple(v.strip() for v in args.class_order.split(","))
                              if args.class_order else None)
    result = import_teacher(settings)
    for line in [result.split_note] * (result.split_note is not None) + result.notes:
        note(line)
    record = result.record
    trained = "" if record.trained_size is None else f"; the weights were trained at {record.trained_size} px"
    warn = ""
    if record.trained_size is not None and record.trained_size != result.image_size:
        warn = f"\nwarning: the dataset is {result.image_size} px, the weights were trained at {record.trained_size} px"
    names = "" if record.display_names is None else f"; class names: {', '.join(record.display_names[:3])}, ..."
    measured = "".join(f"\n  {c.name}: mean {list(c.mean)} std {list(c.std)}: test top-1 {c.top1:.2f}%"
                       for c in record.measured)
    warn += "".join(f"\nwarning: {line}" for line in result.warnings)
    emit(args, result.model_dump(mode="json"),
         f"teacher {result.model} on {result.dataset}: test top-1 {result.top1:.2f}% on {record.eval_images} images "
         f"(chance {result.chance:.2f}%)\n"
         f"weights: {record.source}\n"
         f"normalization: mean {list(result.mean)} std {list(result.std)}, from {record.normalization}{measured}\n"
         f"input: {result.image_size} px (the dataset's){trained}{names}{warn}\n"
         f"written to {result.path}")
