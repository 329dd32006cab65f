"""`fadrm export`: a run as an ImageFolder, a Parquet or a tensor file, with the teacher(s), the
stored soft labels and the student recipe its reported top-1 needs when asked."""
from __future__ import annotations

from fadrm_ray.cli.common import IPC_HELP, CLIError, common_parser, emit, parse_classes, warn_incomplete

NAME = "export"
HEAVY = False


def add_parser(sub):
    p = sub.add_parser(NAME, parents=[common_parser()], help="export a run as an ImageFolder, a Parquet or a tensor file")
    p.add_argument("--run", required=True, help="STORE/RUN_ID")
    p.add_argument("--format", choices=["imagefolder", "parquet", "pt"], default="imagefolder",
                   help="parquet: one file, as the REST service serves it and `fadrm train-student --data` reads it")
    p.add_argument("--classes", default=None)
    p.add_argument("--ipc", type=int, default=None, help=IPC_HELP)
    p.add_argument("--out", required=True, help="a new path (an empty folder for imagefolder); never replaced")
    p.add_argument("--incomplete", action="store_true", help="allow a run that was not finished")
    p.add_argument("--with-teacher", action="store_true",
                   help="also write the run's teacher checkpoint(s) and the student recipe (recipe.json) its "
                        "reported top-1 needs: inside the folder, or beside the file")
    p.add_argument("--soft-labels", action="store_true",
                   help="also write the soft labels of the recipe's students, stored (soft-labels.parquet), for "
                        "`fadrm train-student --soft-labels` without the teacher")
    p.add_argument("--topk", type=int, default=None,
                   help="keep the K largest logits of each view (default: all)")
    p.add_argument("--label-epochs", type=int, default=None,
                   help="keep the labels of this many epochs, read in turn (default: every epoch of the recipe)")
    return p


def run(args) -> None:
    from fadrm_ray.fileio import check_new_output
    from fadrm_ray.store import export_imagefolder, export_parquet, export_tensors, open_run

    classes = parse_classes(args.classes)
    check_new_output(args.out, "--out", empty_dir_ok=args.format == "imagefolder")
    if (args.topk is not None or args.label_epochs is not None) and not args.soft_labels:
        raise CLIError("--topk and --label-epochs shape the stored soft labels: add --soft-labels")
    for flag, value in (("--topk", args.topk), ("--label-epochs", args.label_epochs)):
        if value is not None and value < 1:
            raise CLIError(f"{flag} must be at least 1, got {value}")
    complete = open_run(args.run, incomplete=args.incomplete).complete
    warn_incomplete(args, complete)
    payload = {"run": args.run, "format": args.format, "out": args.out, "complete": complete}
    if args.with_teacher or args.soft_labels:  # what the report's top-1 needs, with the images
        from fadrm_ray.config import LabelStorage
        from fadrm_ray.evaluation.product import Shipped, export_with_product

        storage = LabelStorage(topk=args.topk, epochs=args.label_epochs) if args.soft_labels else None
        count, product, files = export_with_product(args.run, args.out, args.format, classes,
                                                    incomplete=args.incomplete, ipc=args.ipc,
                                                    shipped=Shipped(with_teachers=args.with_teacher, soft_labels=storage),
                                                    progress=not args.quiet)
        teachers = [str(p) for p in files[:len(product.teacher_files)]]
        payload.update(images=count, teachers=teachers, recipe=str(files[-1]), recipe_from=product.recipe_from)
        shipped = [f"the teacher(s) {', '.join(teachers)}"] if teachers else []
        if product.soft_labels is not None:
            labels = str(files[len(product.teacher_files)])
            payload.update(soft_labels=labels, soft_label_bytes_per_image=round(product.soft_label_bytes_per_image, 1),
                           soft_label_topk=product.recipe.soft_label_topk,
                           soft_label_epochs=product.recipe.soft_label_epochs or product.recipe.epochs)
            shipped.append(f"the stored soft labels {labels} ({product.soft_label_bytes_per_image:,.0f} bytes per "
                           f"image and seed, top-{product.recipe.soft_label_topk or 'all'} logits, "
                           f"{product.recipe.soft_label_epochs or product.recipe.epochs} epochs)")
        emit(args, payload,
             f"exported {count} images as {args.format} to {args.out}, with {' and '.join(shipped)} and the student "
             f"recipe {files[-1]} (from {product.recipe_from}): the reported top-1 trains students with the "
             "teachers' soft labels")
        return
    if args.format == "imagefolder":
        count = export_imagefolder(args.run, args.out, classes=classes, incomplete=args.incomplete, ipc=args.ipc)
    elif args.format == "parquet":
        count = export_parquet(args.run, args.out, classes=classes, incomplete=args.incomplete, ipc=args.ipc)
    else:
        count = export_tensors(args.run, args.out, classes=classes, incomplete=args.incomplete, ipc=args.ipc)
    emit(args, {**payload, "images": count}, f"exported {count} images as {args.format} to {args.out}")
