"""What a request may name: the operator's datasets and teachers, and the presets."""
from __future__ import annotations

import logging

from fastapi import APIRouter

from fadrm_ray.config import make_config
from fadrm_ray.recipes import PRESETS

from api.catalog import UnknownName, UnusableTeacher
from api.models import DatasetInfo, TeacherListed
from api.routes.common import AUTH, ERRORS, ServiceDep

log = logging.getLogger("fadrm.api")
router = APIRouter(tags=["catalog"], dependencies=AUTH, responses=ERRORS)


@router.get("/v1/datasets")
def datasets(service: ServiceDep) -> list[DatasetInfo]:
    out = []
    for name in service.catalog.dataset_names():
        try:
            d = service.catalog.dataset(name).describe()
        except Exception as exc:  # an operator's dataset that cannot be read now: listed by name only
            log.warning("dataset %s: %s", name, exc)
            continue
        out.append(DatasetInfo(**{**d, "name": name}))
    return out


@router.get("/v1/teachers")
def teachers(service: ServiceDep) -> list[TeacherListed]:
    out = []
    for name in service.catalog.teacher_names():  # those that load (each file read once per version)
        try:
            info = service.catalog.teacher(name).info
        except (UnknownName, UnusableTeacher):  # changed since it was listed
            continue
        out.append(TeacherListed(name=name, model=info.model_name, dataset=info.dataset, num_classes=info.num_classes,
                               class_names=list(info.class_names), image_size=info.image_size,
                               in_chans=info.in_chans, test_accuracy=info.test_accuracy))
    return out


@router.get("/v1/presets")
def presets() -> dict[str, dict]:
    return {name: make_config(name).to_dict() for name in PRESETS}
