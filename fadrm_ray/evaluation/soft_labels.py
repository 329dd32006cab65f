"""Stored soft labels: the plans and teacher logits of E epochs, kept in Parquet and read back.

The online source (relabel.OnlineSoftLabels) runs the teachers on every student step. The stored
source computes the same steps once and keeps each one's `ViewPlan` with its logits, so a student
can be trained again, or elsewhere, without the teachers (docs/method.md section 6).

How much is kept is a `LabelStorage`:
- `dtype`: float16 (the default) or float32 logits;
- `topk`: of each augmented view, the k largest logits and their classes, and one value for
  every other class, r = T * (logsumexp(z_rest / T) - log(K - k)). At the KD temperature T the
  k kept classes keep their exact probabilities and the others share what is left equally.
  None, or k >= K, keeps every logit;
- `epochs`: only E epochs are kept; training epoch e reads stored epoch e mod E.

A run keeps its labels in a folder per key (`<dir>/<key>/epoch=NNNNN.parquet`, each written
atomically, `meta.json`, a `SoftLabelMeta`, and `sha256.json`, the sha256 of each epoch file as
written: `EpochDigests`, what `fadrm verify` checks them against); a rerun fills in only what is
missing.
`pack_soft_labels` puts the folders of one or more student seeds in one Parquet file (a row
row per view with its seed and epoch, the metas in the schema metadata): what `fadrm export --soft-labels`
ships and `fadrm train-student --soft-labels` reads. `StoredSoftLabels` reads either.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterator, Literal, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict

from fadrm_ray.fileio import atomic_write_bytes, atomic_write_text
from fadrm_ray.config import EvalConfig, LabelStorage
from fadrm_ray.settings import EvaluationError
from fadrm_ray.evaluation.relabel import (AugmentSpec, OnlineSoftLabels, Step, ViewPlan, apply_plan, held_images,
                                         steps_per_epoch)
from fadrm_ray.runtime import to_device
from fadrm_ray.errors import InputError

SOFT_LABEL_MODES = ("online", "stored")
STORE_FORMAT = "fadrm-soft-labels"
STORE_VERSION = 2            # version 1 folders (every logit, no image digest) are still read
PACK_FORMAT = "fadrm-soft-labels-pack"
PACK_KEY = b"fadrm_soft_labels"
PACK_ROW_GROUP = 1 << 17     # rows; a reader skips the groups of other seeds and epochs by their statistics
LOGIT_DTYPES = {"float16": (torch.float16, pa.float16()), "float32": (torch.float32, pa.float32())}
DEFAULT_STORAGE = LabelStorage()
PLAN_COLUMNS = ("step", "slot", "image", "crop_top", "crop_left", "crop_h", "crop_w", "flip", "mix_slot",
                "mix_image", "mix_y0", "mix_y1", "mix_x0", "mix_x1", "lam")


class SoftLabelError(EvaluationError):
    """Stored soft labels that are missing, unreadable or not for these images."""


class SoftLabelMeta(BaseModel):
    """What a folder (or one part of a packed file) of stored soft labels holds."""

    model_config = ConfigDict(extra="ignore")
    format: Literal["fadrm-soft-labels"] = STORE_FORMAT
    version: Literal[1, 2] = STORE_VERSION
    key: str
    teachers: list[str]
    spec: AugmentSpec
    batch_size: int
    seed: int
    dtype: Literal["float16", "float32"]
    images: int
    image_shape: list[int]
    epochs: int = 0
    images_sha256: str | None = None   # of the uint8 images (version 2)
    num_classes: int | None = None
    topk: int | None = None            # logits kept per view; None: all
    temperature: float | None = None   # the KD temperature of the top-k values
    teacher_bn: Literal["running", "batch"] = "running"  # how the teachers' BatchNorm layers labelled
    epochs_kept: int | None = None     # LabelStorage.epochs: None, a folder training epochs add to


class EpochDigests(BaseModel):
    """The sha256 of each epoch file of a folder (`DIGESTS`), by file name, as it was written."""

    model_config = ConfigDict(extra="ignore")
    format: Literal["fadrm-soft-label-digests"] = "fadrm-soft-label-digests"
    files: dict[str, str] = {}


DIGESTS = "sha256.json"


def recorded_digests(folder: Path) -> dict[str, str]:
    """The digests recorded in `folder` ({} where none are, or the file does not read)."""
    try:
        return dict(EpochDigests.model_validate_json((Path(folder) / DIGESTS).read_bytes()).files)
    except (OSError, ValueError):
        return {}


class PackPart(BaseModel):
    meta: SoftLabelMeta                # its rows are those of seed meta.seed


class SoftLabelPack(BaseModel):
    """The schema metadata of a packed file: one part per student seed."""

    format: Literal["fadrm-soft-labels-pack"] = PACK_FORMAT
    version: Literal[1] = 1
    parts: list[PackPart]


# --------------------------------------------------------------------------- top-k
def topk_compress(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values (B, k), classes (B, k), rest (B,)) of float32 logits (B, K), k < K."""
    num_classes = logits.shape[1]
    values, classes = logits.topk(k, dim=1)
    others = logits.scatter(1, classes, float("-inf"))
    rest = temperature * (torch.logsumexp(others / temperature, dim=1) - math.log(num_classes - k))
    return values, classes, rest


def topk_expand(values: torch.Tensor, classes: torch.Tensor, rest: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The (B, K) logits `topk_compress` stands for: the kept values, `rest` everywhere else."""
    out = rest.float().view(-1, 1).expand(-1, num_classes).clone()
    return out.scatter_(1, classes.long(), values.float())


# --------------------------------------------------------------------------- writing
def images_digest(images_uint8: torch.Tensor) -> str:
    h = hashlib.sha256(json.dumps(list(images_uint8.shape)).encode())
    h.update(images_uint8.contiguous().numpy().tobytes())
    return h.hexdigest()


def soft_label_key(source: OnlineSoftLabels, storage: LabelStorage) -> str:
    """What the stored labels depend on: without a set number of epochs, not the epoch count
    (epochs are independent, so a longer training adds epochs to the same folder)."""
    h = hashlib.sha256()
    h.update(source.images_uint8.contiguous().numpy().tobytes())
    named = {"teachers": list(source.labeler.key_ids), "spec": source.spec.to_dict(),
             "batch_size": source.batch_size, "seed": source.seed, "dtype": storage.dtype,
             "shape": list(source.images_uint8.shape)}
    if storage.topk is not None:
        named.update(topk=storage.topk, temperature=storage.temperature)
    if storage.epochs is not None:  # a folder holds exactly the epochs it was asked for
        named.update(epochs=storage.epochs)
    h.update(json.dumps(named, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _epoch_file(directory: Path, epoch: int) -> Path:
    return directory / f"epoch={epoch:05d}.parquet"


def _plan_table(steps: list[Step], storage: LabelStorage) -> pa.Table:
    """One row per view: its plan in the narrowest integer types that hold it, then its logits."""
    torch_dtype, arrow_dtype = LOGIT_DTYPES[storage.dtype]
    cols: dict[str, list] = {k: [] for k in PLAN_COLUMNS}
    for step in steps:
        p = step.plan
        for j in range(len(p)):
            cols["step"].append(step.index)
            cols["slot"].append(j)
            cols["image"].append(int(p.indices[j]))
            for name, v in zip(("crop_top", "crop_left", "crop_h", "crop_w"), p.boxes[j].tolist()):
                cols[name].append(int(v))
            cols["flip"].append(bool(p.flips[j]))
            cols["mix_slot"].append(int(p.partner[j]))
            cols["mix_image"].append(int(p.indices[int(p.partner[j])]))
            for name, v in zip(("mix_y0", "mix_y1", "mix_x0", "mix_x1"), p.mix_box):
                cols[name].append(int(v))
            cols["lam"].append(float(p.lam))
    arrays = {k: pa.array(v, type=_column_type(k, v)) for k, v in cols.items()}
    logits = torch.cat([step.logits.float().cpu() for step in steps])
    kept = storage.kept(logits.shape[1])
    if kept is None:
        values = logits
    else:
        values, classes, rest = topk_compress(logits, kept, storage.temperature)
        arrays["classes"] = pa.FixedSizeListArray.from_arrays(
            pa.array(classes.reshape(-1).numpy().astype("uint16" if logits.shape[1] < 65536 else "uint32")), kept)
        arrays["rest"] = pa.array(rest.to(torch_dtype).numpy(), type=arrow_dtype)
    arrays["logits"] = pa.FixedSizeListArray.from_arrays(
        pa.array(values.to(torch_dtype).reshape(-1).numpy(), type=arrow_dtype), values.shape[1])
    return pa.table(arrays)


def _column_type(name: str, values: list) -> pa.DataType:
    if name == "flip":
        return pa.bool_()
    if name == "lam":
        return pa.float32()   # what is left of each view after CutMix: read, never used for pixels
    top = max(values, default=0)
    return pa.uint16() if top < 2 ** 16 else pa.uint32() if top < 2 ** 32 else pa.int64()


def precompute_soft_labels(source: OnlineSoftLabels, epochs: int, directory: str | Path,
                           storage: LabelStorage = DEFAULT_STORAGE, progress: bool = False) -> Path:
    """Write the plans and logits of the first `epochs` epochs of `source` (at most
    `storage.epochs`) under `directory/<key>/`; returns that folder."""
    from tqdm.auto import tqdm

    key = soft_label_key(source, storage)
    out = Path(directory) / key
    out.mkdir(parents=True, exist_ok=True)
    keep = min(int(epochs), storage.epochs or int(epochs))
    num_classes = None
    digests = recorded_digests(out)
    for epoch in tqdm(range(keep), desc="relabel", unit="epoch", disable=not progress):
        path = _epoch_file(out, epoch)
        if path.is_file():
            if path.name not in digests:  # written by a run stopped before it recorded them
                digests[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
            continue
        steps = list(source.epoch(epoch))
        num_classes = steps[0].logits.shape[1]
        sink = pa.BufferOutputStream()
        pq.write_table(_plan_table(steps, storage), sink, compression="zstd")
        data = sink.getvalue().to_pybytes()
        atomic_write_bytes(path, data)
        digests[path.name] = hashlib.sha256(data).hexdigest()
    atomic_write_text(out / DIGESTS, EpochDigests(files=dict(sorted(digests.items()))).model_dump_json())
    if num_classes is None:  # every epoch was there: the classes are the stored ones
        num_classes = StoredSoftLabels(out, source.images_uint8).num_classes
    images = source.images_uint8
    meta = SoftLabelMeta(key=key, teachers=list(source.labeler.ids), spec=source.spec,
                         batch_size=source.batch_size, seed=source.seed, dtype=storage.dtype,
                         images=int(images.shape[0]), image_shape=list(images.shape[1:]),
                         epochs=max(keep, _stored_epochs(out)), images_sha256=images_digest(images),
                         num_classes=num_classes, topk=storage.kept(num_classes),
                         temperature=storage.temperature if storage.kept(num_classes) else None,
                         teacher_bn="batch" if source.labeler.batch_statistics else "running",
                         epochs_kept=storage.epochs)
    atomic_write_text(out / "meta.json", meta.model_dump_json(indent=2))
    return out


def _stored_epochs(directory: Path) -> int:
    n = 0
    while _epoch_file(directory, n).is_file():
        n += 1
    return n


def pack_soft_labels(folders: list[Path]) -> bytes:
    """The bytes of one Parquet file of the soft-label folders of one or more seeds: their rows
    with `seed` and `epoch` columns, in that order, the metas in the schema metadata."""
    parts, tables = [], []
    for folder in folders:
        meta, files = stored_folder(folder)
        parts.append(PackPart(meta=meta.model_copy(update={"epochs": len(files)})))
        for epoch, path in enumerate(files):
            table = pq.read_table(path)
            rows = table.num_rows
            table = table.add_column(0, "epoch", pa.array([epoch] * rows, type=pa.uint32()))
            tables.append(table.add_column(0, "seed", pa.array([meta.seed] * rows, type=pa.int64())))
    if not tables:
        raise SoftLabelError("no stored soft labels to pack")
    table = pa.concat_tables(tables, promote_options="permissive")
    table = table.replace_schema_metadata({PACK_KEY: SoftLabelPack(parts=parts).model_dump_json().encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=PACK_ROW_GROUP)
    return sink.getvalue().to_pybytes()


def folders_of(directory: str | Path, images_uint8: torch.Tensor, cfg: EvalConfig,
               teachers: Sequence[str]) -> list[Path]:
    """The stored-label folder of each seed of `cfg` (resolved: epochs set) for these images and
    teachers, as `evaluate_run` left them under `directory`, found by what their metas record;
    SoftLabelError names the seeds that have none."""
    digest, storage, found = images_digest(images_uint8), cfg.label_storage(), {}
    wanted = min(int(cfg.epochs), storage.epochs or int(cfg.epochs))
    for meta_path in sorted(Path(directory).glob("*/meta.json")):
        try:
            meta = SoftLabelMeta.model_validate_json(meta_path.read_bytes())
        except ValueError:
            continue
        kept = storage.kept(meta.num_classes or 0)
        if (meta.images_sha256 == digest and meta.teachers == list(teachers) and meta.batch_size == cfg.batch_size
                and meta.dtype == storage.dtype and meta.topk == kept and meta.teacher_bn == cfg.teacher_bn
                and (kept is None or meta.temperature == storage.temperature)
                and tuple(meta.spec.crop_scale) == tuple(cfg.crop_scale) and meta.spec.cutmix_prob == cfg.cutmix_prob
                and meta.epochs_kept == storage.epochs and _stored_epochs(meta_path.parent) >= wanted):
            found.setdefault(meta.seed, meta_path.parent)
    missing = [seed for seed in cfg.seed_list if seed not in found]
    if missing:
        raise SoftLabelError(f"no stored soft labels of seed(s) {missing} for these images and settings in {directory}")
    return [found[seed] for seed in cfg.seed_list]


# --------------------------------------------------------------------------- reading
def stored_folder(folder: str | Path) -> tuple[SoftLabelMeta, list[Path]]:
    """A stored soft-label folder's meta (SoftLabelError where it has none, or not one of a
    soft-label folder) and its epoch files, epoch 0 first."""
    folder = Path(folder)
    meta = _read_meta(folder)
    return meta, [_epoch_file(folder, epoch) for epoch in range(_stored_epochs(folder))]


def _read_meta(folder: Path) -> SoftLabelMeta:
    path = folder / "meta.json"
    if not path.is_file():
        raise SoftLabelError(f"no stored soft labels in {folder} (meta.json missing)")
    try:
        return SoftLabelMeta.model_validate_json(path.read_bytes())
    except ValueError as exc:
        raise SoftLabelError(f"{path}: not a {STORE_FORMAT} folder ({exc.errors()[0]['msg']})") from None


def _parts(path: Path) -> list[PackPart]:
    try:
        raw = (pq.read_schema(path).metadata or {}).get(PACK_KEY)
    except (OSError, pa.ArrowException) as exc:
        raise SoftLabelError(f"{path} is not a Parquet file ({type(exc).__name__})") from None
    if raw is None:
        raise SoftLabelError(f"{path} is not a soft-label file (no {PACK_KEY.decode()} metadata)")
    try:
        return SoftLabelPack.model_validate_json(raw).parts
    except ValueError:
        raise SoftLabelError(f"{path}: its {PACK_KEY.decode()} metadata is not a soft-label pack") from None


def _packed_part(path: Path, seed: int | None) -> PackPart:
    parts = _parts(path)
    seeds = [p.meta.seed for p in parts]
    if seed is None and len(parts) == 1:
        return parts[0]
    for part in parts:
        if part.meta.seed == seed:
            return part
    raise SoftLabelError(f"{path} holds the soft labels of student seed(s) {seeds}, not seed {seed}: "
                         f"train with {'one of those seeds' if len(seeds) > 1 else f'--seed {seeds[0]}'}")


class StoredSoftLabels(torch.utils.data.Dataset):
    """A plain map-style Dataset over stored steps, from a folder or a packed file (`seed` picks
    the part): item i is step i % steps_per_epoch of epoch i // steps_per_epoch, returned as
    (ViewPlan, logits float32). `epoch(e)` rebuilds the views of a whole epoch with the same
    `apply_plan` the online path uses; training epochs past the stored ones read them in turn.
    The images are held uint8 where the student trains (`relabel.held_images`; `held`: that very
    tensor where the caller has it there already) and converted view by view."""

    mode = "stored"

    def __init__(self, source: str | Path, images_uint8: torch.Tensor, seed: int | None = None,
                 device: torch.device | str = "cpu", held: torch.Tensor | None = None):
        self.source, self.device = Path(source), torch.device(device)
        if self.source.is_dir():
            self.meta, self._packed = _read_meta(self.source), False
            self.epochs = _stored_epochs(self.source)
        elif self.source.is_file():
            self.meta, self._packed = _packed_part(self.source, seed).meta, True
            self.epochs = self.meta.epochs
        else:
            raise SoftLabelError(f"no stored soft labels at {self.source}")
        meta = self.meta
        if meta.images != images_uint8.shape[0] or meta.image_shape != list(images_uint8.shape[1:]):
            raise SoftLabelError(f"{self.source}: stored labels are for {meta.images} images of shape "
                                 f"{meta.image_shape}, got {tuple(images_uint8.shape)}")
        if meta.images_sha256 is not None and meta.images_sha256 != images_digest(images_uint8):
            raise SoftLabelError(f"{self.source}: these soft labels were made for other images (their sha256 "
                                 "differs): use the soft-label file of this very data file")
        if self.epochs < 1:
            raise SoftLabelError(f"{self.source}: no epoch is stored")
        # The views are cut, and the logits held, where the student trains (relabel.apply_plan).
        self.images = held if held is not None and held.device == self.device else held_images(images_uint8, self.device)
        self.spec, self.batch_size = meta.spec, meta.batch_size
        self._cache: tuple[int, list[tuple[ViewPlan, torch.Tensor]]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.images.shape[0], self.batch_size)

    @property
    def num_classes(self) -> int:
        return self._load_epoch(0)[0][1].shape[1]

    def bytes_per_image(self) -> float:
        """Bytes of these labels per image, packed as they ship (`pack_soft_labels`); a packed
        file's bytes are shared by its seeds."""
        if self._packed:
            parts = len(_parts(self.source))
            return self.source.stat().st_size / parts / self.meta.images
        return len(pack_soft_labels([self.source])) / self.meta.images

    def __len__(self) -> int:
        return self.epochs * self.steps_per_epoch

    def _table(self, epoch: int) -> pa.Table:
        if not self._packed:
            return pq.read_table(_epoch_file(self.source, epoch))
        return pq.read_table(self.source, filters=[("seed", "=", self.meta.seed), ("epoch", "=", epoch)])

    def _load_epoch(self, epoch: int) -> list[tuple[ViewPlan, torch.Tensor]]:
        epoch %= self.epochs
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        table = self._table(epoch)
        col = {name: table.column(name).to_pylist() for name in PLAN_COLUMNS}
        logits = _logits(table, self.meta.num_classes)
        steps: list[tuple[ViewPlan, torch.Tensor]] = []
        rows = torch.tensor(col["step"])
        for s in range(int(rows.max()) + 1):
            sel = torch.nonzero(rows == s).flatten()
            order = sel[torch.tensor([col["slot"][i] for i in sel.tolist()]).argsort()]
            o = order.tolist()
            first = o[0]
            plan = ViewPlan(
                indices=torch.tensor([col["image"][i] for i in o], dtype=torch.long),
                boxes=torch.tensor([[col["crop_top"][i], col["crop_left"][i], col["crop_h"][i], col["crop_w"][i]]
                                    for i in o], dtype=torch.long),
                flips=torch.tensor([col["flip"][i] for i in o], dtype=torch.bool),
                partner=torch.tensor([col["mix_slot"][i] for i in o], dtype=torch.long),
                mix_box=(col["mix_y0"][first], col["mix_y1"][first], col["mix_x0"][first], col["mix_x1"][first]),
                lam=float(col["lam"][first]))
            steps.append((plan, to_device(logits[order], self.device)))
        self._cache = (epoch, steps)
        return steps

    def __getitem__(self, i: int) -> tuple[ViewPlan, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        epoch, step = divmod(int(i), self.steps_per_epoch)
        return self._load_epoch(epoch)[step]

    def epoch(self, epoch: int) -> Iterator[Step]:
        for i, (plan, logits) in enumerate(self._load_epoch(epoch)):
            yield Step(apply_plan(self.images, plan, self.spec.out_size), logits, plan, epoch, i)


def _fixed_list(table: pa.Table, name: str, dtype: str) -> torch.Tensor:
    column = table.column(name).combine_chunks()
    flat = column.flatten().to_numpy(zero_copy_only=False).astype(dtype)
    return torch.from_numpy(flat).view(-1, column.type.list_size)


def _logits(table: pa.Table, num_classes: int | None) -> torch.Tensor:
    values = _fixed_list(table, "logits", "float32")
    if "classes" not in table.column_names:
        return values
    rest = torch.from_numpy(table.column("rest").to_numpy(zero_copy_only=False).astype("float32"))
    return topk_expand(values, _fixed_list(table, "classes", "int64"), rest, int(num_classes))


def soft_label_source(mode: str, online: OnlineSoftLabels, epochs: int, directory: str | Path | None = None,
                      storage: LabelStorage = DEFAULT_STORAGE, progress: bool = False):
    """`online` itself, or the stored labels of its steps (computing whatever epochs are not
    stored yet under `directory`)."""
    if mode == "online":
        return online
    if mode == "stored":
        if directory is None:
            raise InputError('soft_labels="stored" needs a folder for the labels (soft_label_dir)')
        folder = precompute_soft_labels(online, epochs, directory, storage, progress=progress)
        return StoredSoftLabels(folder, online.images_uint8, device=online.labeler.device, held=online.images)
    raise InputError(f"soft_labels must be one of {', '.join(SOFT_LABEL_MODES)}, got {mode!r}")
