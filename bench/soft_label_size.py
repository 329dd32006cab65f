"""What stored soft labels cost on disk and in student top-1: top-k logits and kept epochs.

    python -m bench.soft_label_size --run STORE/RUN_ID [--rows online,all,5,2,1,2@30]
        [--seeds 3] [--protocol published] [--threads N] [--out results.json]
    python -m bench.soft_label_size --classes 1000 [--topk all,100,10,5,1]

Each row trains the run's students (`evaluate_store_run`, cached in the run, so a rerun resumes) with
one way of giving them soft labels: `online` (the teachers relabel every step), `all` (stored,
every logit), `K` (stored, the K largest logits of each view and one value for the rest:
soft_label_store.py), and `...@E` (only E epochs stored, read in turn). It prints, per row, the
bytes per image of one seed's labels, the top-1 over the seeds and, seed by seed, the difference
to the online row. `--classes K` prints instead the bytes per view of one packed epoch for K
classes, with teacher-like logits drawn at random (no run, no student): what top-k saves where
the class count, not the crop plan, dominates.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from pydantic import BaseModel

from fadrm_ray.evaluation.baselines import gain_text, paired_gain
from fadrm_ray.evaluation.eval_job import EvalJob, EvalSpec
from fadrm_ray.evaluation.store_run import evaluate_store_run
from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.evaluation.relabel import AugmentSpec, OnlineSoftLabels
from fadrm_ray.config import EvalConfig, LabelStorage
from fadrm_ray.evaluation.soft_labels import StoredSoftLabels, folders_of, precompute_soft_labels
from fadrm_ray.store import open_run


class Row(BaseModel):
    name: str
    topk: int | None = None      # None: every logit
    epochs: int | None = None    # None: every epoch
    stored: bool = True


class Result(BaseModel):
    row: Row
    evaluation: Evaluation
    bytes_per_image: float | None   # one seed's labels; None online


def parse_rows(text: str) -> list[Row]:
    rows = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "online":
            rows.append(Row(name=item, stored=False))
            continue
        k, _, e = item.partition("@")
        rows.append(Row(name=item, topk=None if k == "all" else int(k), epochs=int(e) if e else None))
    return rows


def row_config(base: EvalConfig, row: Row) -> EvalConfig:
    if not row.stored:
        return base
    return EvalConfig.model_validate({**base.model_dump(), "soft_labels": "stored", "soft_label_topk": row.topk,
                                      "soft_label_epochs": row.epochs})


def stored_bytes(run_dir: Path, evaluation: Evaluation) -> float:
    """Bytes per image of the packed labels of the evaluation's first seed."""
    reader = open_run(run_dir)
    images, _, _ = reader.read()
    folder = folders_of(reader.layout.soft_labels, images, evaluation.config, evaluation.teachers)[0]
    return StoredSoftLabels(folder, images).bytes_per_image()


class RandomTeacher:
    """Stands for the teachers of a `SoftLabeler`: logits ~ N(0, 3^2) with one class raised by 12
    (a confident teacher), drawn from a fixed seed."""

    batch_statistics = False

    def __init__(self, classes: int):
        self.classes, self.gen = classes, torch.Generator().manual_seed(0)
        self.ids = self.key_ids = [f"random-{classes}"]

    def __call__(self, view01: torch.Tensor) -> torch.Tensor:
        n = view01.shape[0]
        logits = torch.randn(n, self.classes, generator=self.gen) * 3
        logits[torch.arange(n), torch.randint(0, self.classes, (n,), generator=self.gen)] += 12
        return logits


def bytes_per_view(classes: int, topks: list[int | None], images: int = 2048) -> dict[str, float]:
    """Bytes per view of one packed epoch (one view per image) of `images` 32-px colour images,
    batches of 16, for each k of `topks` (None: every logit)."""
    pixels = torch.randint(0, 256, (images, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = {}
    for k in topks:
        online = OnlineSoftLabels(pixels, RandomTeacher(classes), AugmentSpec(out_size=32, hflip=True), 16, 0)
        with tempfile.TemporaryDirectory() as tmp:
            folder = precompute_soft_labels(online, 1, tmp, LabelStorage(topk=k))
            out["all" if k is None else str(k)] = StoredSoftLabels(folder, pixels).bytes_per_image()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path)
    parser.add_argument("--classes", type=int, default=None, help="bytes per view for this many classes instead")
    parser.add_argument("--topk", default="all,100,10,5,1", help="with --classes: the k to measure")
    parser.add_argument("--rows", default="online,all,5,2,1,2@30")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--protocol", default="published", choices=["short", "published"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.classes is not None:
        topks = [None if t == "all" else int(t) for t in args.topk.split(",")]
        sizes = bytes_per_view(args.classes, topks)
        print(f"| logits kept per view ({args.classes} classes) | bytes per view, packed |\n|---|---|")
        for k, size in sizes.items():
            print(f"| {k} | {size:,.1f} |")
        return
    if args.run is None:
        parser.error("--run STORE/RUN_ID is needed (or --classes K)")
    base = EvalConfig(protocol=args.protocol, seeds=args.seeds)
    results: list[Result] = []
    for row in parse_rows(args.rows):
        evaluation = evaluate_store_run(args.run, EvalJob(config=row_config(base, row)),
                                        EvalSpec(threads=args.threads, progress=False)).evaluation
        size = stored_bytes(args.run, evaluation) if row.stored else None
        results.append(Result(row=row, evaluation=evaluation, bytes_per_image=size))
        print(f"{row.name}: top-1 {evaluation.top1_mean:.2f} ± {evaluation.top1_std:.2f}"
              + (f", {size:,.0f} bytes per image" if size is not None else ""), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps([r.model_dump(mode="json") for r in results], indent=2))
    online = next((r for r in results if not r.row.stored), None)
    print("\n| soft labels | logits kept per view | epochs stored | bytes per image | top-1 | minus online |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ev = r.evaluation
        kept = "all" if r.row.topk is None else str(r.row.topk)
        epochs = "-" if not r.row.stored else str(min(ev.config.epochs, r.row.epochs or ev.config.epochs))
        size = "0 (teacher at hand)" if r.bytes_per_image is None else f"{r.bytes_per_image:,.0f}"
        diff = "" if online is None or r is online else gain_text(
            paired_gain(ev.top1_per_seed, online.evaluation.top1_per_seed))
        name = "online" if not r.row.stored else "stored"
        print(f"| {name} | {kept if r.row.stored else 'all'} | {epochs} | {size} | "
              f"{ev.top1_mean:.2f} ± {ev.top1_std:.2f} | {diff} |")


if __name__ == "__main__":
    main()
