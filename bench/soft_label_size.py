"""What stored soft labels cost on disk and in student top-1: top-k logits and kept epochs.

    python -m bench.soft_label_size --run STORE/RUN_ID [--rows online,all,5,2,1,2@30]
        [--seeds 3] [--protocol published] [--threads N] [--out results.json]

Each row trains the run's students (`evaluate_run`, cached in the run, so a rerun resumes) with
one way of giving them soft labels: `online` (the teachers relabel every step), `all` (stored,
every logit), `K` (stored, the K largest logits of each view and one value for the rest:
soft_label_store.py), and `...@E` (only E epochs stored, read in turn). It prints, per row, the
bytes per image of one seed's labels, the top-1 over the seeds and, seed by seed, the difference
to the online row.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pydantic import BaseModel

from fadrm_ray.baselines import gain_text, paired_gain
from fadrm_ray.evaluate import evaluate_run
from fadrm_ray.scores import Evaluation
from fadrm_ray.settings import EvalConfig
from fadrm_ray.soft_label_store import SoftLabelMeta, StoredSoftLabels
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


def stored_bytes(run_dir: Path, evaluation: Evaluation, row: Row) -> float:
    """Bytes per image of the stored labels of the evaluation's first seed (found by their meta)."""
    reader = open_run(run_dir)
    images, _, _ = reader.read()
    cfg = evaluation.config
    kept_epochs = min(cfg.epochs, row.epochs or cfg.epochs)
    for meta_path in sorted(reader.layout.soft_labels.glob("*/meta.json")):
        meta = SoftLabelMeta.model_validate_json(meta_path.read_bytes())
        num_classes = meta.num_classes or 0
        if (meta.seed == cfg.seed_list[0] and meta.batch_size == cfg.batch_size and meta.epochs == kept_epochs
                and meta.dtype == cfg.soft_label_dtype and meta.topk == cfg.label_storage().kept(num_classes)
                and meta.spec.crop_scale == tuple(cfg.crop_scale)):
            return StoredSoftLabels(meta_path.parent, images).bytes_per_image()
    raise SystemExit(f"no stored labels found for row {row.name} in {reader.layout.soft_labels}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--rows", default="online,all,5,2,1,2@30")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--protocol", default="published", choices=["short", "published"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    base = EvalConfig(protocol=args.protocol, seeds=args.seeds)
    results: list[Result] = []
    for row in parse_rows(args.rows):
        evaluation = evaluate_run(args.run, row_config(base, row), num_threads=args.threads, progress=False)
        size = stored_bytes(args.run, evaluation, row) if row.stored else None
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
