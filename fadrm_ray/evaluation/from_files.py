"""Train a student from downloaded files alone: `fadrm train-student`, `train_from_files()`.

What a client gets from the service (`GET .../dataset`, `.../teacher`, `.../recipe`) or from
`fadrm export --with-teacher` is enough to reach the top-1 the job reported: the distilled images
(a Parquet file of the store's layout, its class names in the `huggingface` metadata), the
teacher checkpoint(s) that give the soft labels, or, where the teachers stay on the server, the
stored soft labels (`fadrm export --soft-labels`: evaluation/soft_labels.py), and the student recipe
(an `EvalConfig` as JSON). The student is trained exactly as `fadrm evaluate` trains it (`evaluate.evaluate_images`),
and, with a test dataset, scored on the test images of the classes the file holds, the
prediction restricted to them, as the service scores a class subset. Neither Ray nor the
service is imported.
"""
from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict

from fadrm_ray import codec
from fadrm_ray.data.base import ImageDataset, Split
from fadrm_ray.data.common import decode_bytes
from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
from fadrm_ray.data.parquet import fadrm_hflip, label_names
from fadrm_ray.models import load_teacher
from fadrm_ray.teacher_record import TeacherRecord
from fadrm_ray.evaluation.scores import Evaluation
from fadrm_ray.config import EvalConfig
from fadrm_ray.settings import EvaluationError


class DistilledFile(BaseModel):
    """The images of a downloaded Parquet file, sorted by (label, ipc_index) as a run reads them."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    images: torch.Tensor        # uint8 (N, C, H, W)
    labels: torch.Tensor        # int64 (N,)
    class_names: list[str]      # of the whole dataset, in class-index order
    hflip: bool | None = None   # whether a flip keeps the label, where the file says

    @property
    def classes(self) -> list[int]:
        return sorted({int(v) for v in self.labels.tolist()})


def read_distilled(path: str | Path) -> DistilledFile:
    """The images, labels and class names of a distilled Parquet file (EvaluationError if it is
    not one: no `image`/`label` columns, no class names, or images of different shapes)."""
    path = Path(path)
    if not path.is_file():
        raise EvaluationError(f"data file not found: {path}")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's errors for a file that is not Parquet
        raise EvaluationError(f"{path} is not a Parquet file ({type(exc).__name__})") from None
    if not {"image", "label"} <= set(table.column_names):
        raise EvaluationError(f"{path} has no image and label columns: not a distilled dataset file")
    metadata = table.schema.metadata
    names = label_names(metadata)
    if not names:
        raise EvaluationError(f"{path} records no class names (a ClassLabel in its `huggingface` metadata)")
    labels = table.column("label").to_pylist()
    ipc = table.column("ipc_index").to_pylist() if "ipc_index" in table.column_names else list(range(len(labels)))
    cells = table.column("image").to_pylist()
    order = sorted(range(len(labels)), key=lambda i: (labels[i], ipc[i]))
    if not order:
        raise EvaluationError(f"{path} holds no images")
    first = cells[order[0]]
    raw = first["bytes"] if isinstance(first, dict) else first
    try:
        channels = 1 if codec.stored_channels(raw) in (1, 2) else 3  # the store writes grey images as grey PNGs
    except codec.CodecError as exc:
        raise EvaluationError(f"cannot decode {path} row {order[0]}: {exc}") from None
    images = []
    for i in order:
        cell = cells[i]
        images.append(decode_bytes(cell["bytes"] if isinstance(cell, dict) else cell, channels, what=f"{path} row {i}"))
    shapes = {tuple(x.shape) for x in images}
    if len(shapes) > 1:
        raise EvaluationError(f"{path}: images of different shapes {sorted(shapes)}")
    return DistilledFile(images=torch.stack(images), labels=torch.as_tensor([labels[i] for i in order]),
                         class_names=names, hflip=fadrm_hflip(metadata))


class PackedSoftLabels:
    """`training.Targets`: the stored soft labels of a packed file (`soft_labels`), one part
    per student seed, learnt by KD at the recipe's temperature."""

    def __init__(self, path: str | Path, temperature: float):
        self.path, self.temperature = Path(path), float(temperature)
        self.teacher_ids: list[str] = []

    def source(self, images_uint8: torch.Tensor, batch_size: int, seed: int, device: torch.device | str = "cpu"):
        from fadrm_ray.evaluation.soft_labels import SoftLabelError, StoredSoftLabels

        stored = StoredSoftLabels(self.path, images_uint8, seed=seed, device=device)
        if stored.batch_size != batch_size:
            raise SoftLabelError(f"{self.path} was made for batch size {stored.batch_size}, the recipe trains with "
                                 f"{batch_size}: use the recipe exported with it")
        self.teacher_ids = list(stored.meta.teachers)
        return stored

    def loss(self, logits: torch.Tensor, step) -> torch.Tensor:
        from fadrm_ray.evaluation.training import kd_loss

        return kd_loss(logits, step.logits, self.temperature)


def _check_classes(file: DistilledFile, info: TeacherRecord, teacher: str) -> None:
    if [str(n) for n in info.class_names] != file.class_names:
        raise EvaluationError(f"teacher {teacher} has other classes than the data file ({info.num_classes} classes, "
                              f"{info.dataset}): it is not the teacher of these images")


def _training_only(file: DistilledFile, info: TeacherRecord, source: str) -> ImageDataset:
    """A dataset of the file's images alone (no test split), normalized as the teacher was."""
    empty = Split(labels=torch.empty(0, dtype=torch.int64),
                  load=lambda idx: torch.empty((0, *file.images.shape[1:]), dtype=torch.uint8))
    channels, size = int(file.images.shape[1]), int(file.images.shape[-1])
    mean, std = tuple(info.mean), tuple(info.std)
    if len(mean) != channels:
        mean, std = (sum(mean) / len(mean),) * channels, (sum(std) / len(std),) * channels
    return ImageDataset(name=f"parquet:{source}", class_names=list(file.class_names), image_size=size,
                        channels=channels, mean=mean, std=std, train=Split.in_memory(file.images, file.labels),
                        test=empty, hflip=bool(file.hflip), info={"source": "distilled file"})


def read_recipe(recipe: str | Path | None) -> EvalConfig:
    """The student recipe of the JSON file `recipe` (an `EvalConfig`); None: EvalConfig()."""
    if recipe is None:
        return EvalConfig()
    try:
        return EvalConfig.model_validate_json(Path(recipe).read_bytes())
    except OSError as exc:
        raise EvaluationError(f"cannot read recipe {recipe}: {exc.strerror or exc}") from None


def train_from_files(data: str | Path, job: EvalJob, spec: EvalSpec | None = None, parts: EvalParts | None = None, *,
                     soft_labels: str | Path | None = None, data_root: str | None = None) -> Evaluation:
    """Students trained on the images of `data` with the soft labels of `job.teacher_paths`, or
    with the stored ones of the file `soft_labels` (then there may be no teachers), under
    `job.config` (the recipe: `read_recipe` reads its file), one per seed of it, running as
    `spec` says (None: `EvalSpec()`). With a test dataset (`parts.dataset`, or the spec
    `job.dataset`, read under `data_root`), each is scored on the test images of the file's
    classes; without, `top1_*` are NaN."""
    from fadrm_ray.data import get_dataset
    from fadrm_ray.evaluation.evaluate import evaluate_images
    from fadrm_ray.evaluation.relabel import SoftLabeler

    file = read_distilled(data)
    spec = spec or EvalSpec()
    cfg, device, teachers = job.config, spec.on_device(), job.teacher_paths or ()
    test = parts.dataset if parts is not None and parts.dataset is not None else job.dataset
    if not teachers and soft_labels is None:
        raise EvaluationError("a teacher checkpoint (--teacher FILE) or a soft-label file (--soft-labels FILE) is "
                              "needed for the soft labels")
    loaded = [load_teacher(path, device=device) for path in teachers]
    for path, (_, info) in zip(teachers, loaded):
        _check_classes(file, info, str(path))
    targets = None if soft_labels is None else PackedSoftLabels(soft_labels, cfg.temperature)
    if test is None and not loaded:
        raise EvaluationError("without a teacher, --test DATASET gives the normalization the student trains with")
    if test is None:
        dataset = _training_only(file, loaded[0][1], str(data))
    else:
        dataset = get_dataset(test, root=data_root) if isinstance(test, str) else test
        if [str(n) for n in dataset.class_names] != file.class_names:
            raise EvaluationError(f"test dataset {dataset.name} has other classes than the data file")
    labeler = SoftLabeler.from_loaded([m for m, _ in loaded], [i for _, i in loaded], device) if loaded else None
    classes = file.classes if len(file.classes) < len(file.class_names) else None
    with tempfile.TemporaryDirectory(prefix="fadrm-soft-labels-") as folder:
        given = replace(parts or EvalParts(), dataset=dataset, labeler=labeler, targets=targets,
                        soft_label_dir=folder if cfg.soft_labels == "stored" else None)
        return evaluate_images(file.images, file.labels, job.model_copy(update={"classes": classes}), spec, given)
