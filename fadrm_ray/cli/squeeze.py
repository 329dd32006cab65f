"""`fadrm squeeze`: train a teacher on a dataset."""
from __future__ import annotations

from fadrm_ray.cli.common import DATASET_HELP, common_parser, emit, note

NAME = "squeeze"
HEAVY = True  # the process gets runtime.heavy_process_env before torch loads


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser()], help="train a teacher on a dataset")
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--model", default=None,
                   help="convnet-bn (the default), resnet18-cifar, or a timm/torchvision name")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default 15)")
    p.add_argument("--seed", type=int, default=None, help="(default 0)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one SqueezeConfig value, e.g. model_kwargs={width: 64} (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--data-root", default=None, help="where downloadable datasets live")
    p.add_argument("--out", required=True, help="directory for teacher.pt")
    return p


def run(args) -> None:
    from fadrm_ray.config import SqueezeConfig, parse_overrides
    from fadrm_ray.data import dataset_notes, get_dataset
    from fadrm_ray.runtime import process_info
    from fadrm_ray.settings import layered
    from fadrm_ray.squeeze import check_out_dir, squeeze

    check_out_dir(args.out)
    cfg = layered(SqueezeConfig, parse_overrides(args.set or [], SqueezeConfig),
                  flags={"model": args.model, "epochs": args.epochs, "seed": args.seed})
    dataset = get_dataset(args.dataset, root=args.data_root)
    if dataset.split_note() is not None:
        note(dataset.split_note())
    for line in dataset_notes(dataset):
        note(line)
    result = squeeze(dataset, cfg, out_dir=args.out, num_threads=args.threads, progress=not args.quiet)
    payload = {"teacher": str(result.path), "model": cfg.model, "dataset": dataset.name,
               "test_accuracy": result.test_accuracy, "train_seconds": result.train_seconds,
               "epochs": result.epochs, "config": cfg.model_dump(mode="json"), "process": process_info()}
    emit(args, payload, f"teacher {cfg.model} on {dataset.name}: test top-1 {result.test_accuracy:.2f}% "
                        f"after {result.epochs} epochs ({result.train_seconds:.1f} s)\nwritten to {result.path}")
