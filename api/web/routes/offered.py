"""What a request may name: the operator's datasets and teachers (api.planning.catalog), and the
presets."""
from __future__ import annotations

from fastapi import APIRouter

from fadrm_ray.config import make_config
from fadrm_ray.recipes import PRESETS

from api.contract.schemas import DatasetInfo, Problem, TeacherListed
from api.contract.service_errors import Unavailable
from api.planning.catalog import UnknownName, UnusableTeacher
from api.web.routes.dependencies import AUTH, ERRORS, ServiceDep

READING_RETRY_S = 2
router = APIRouter(tags=["catalog"], dependencies=AUTH, responses=ERRORS)


@router.get("/v1/datasets", responses={503: {"model": Problem, "description": "the service is still reading its "
                                                                   "datasets as it starts (see Retry-After)"}})
async def datasets(service: ServiceDep) -> list[DatasetInfo]:
    """The datasets as the service read them when it started (api.planning.catalog.read_all): nothing is
    loaded in the request. A dataset that cannot be read is left out (the service's log says why)."""
    catalog = service.catalog
    if not catalog.read.is_set():  # then a dataset still being read is left out until it is read
        pending = catalog.pending()
        raise Unavailable(f"the service is still reading its datasets as it starts ({', '.join(pending)}); retry in "
                          f"{READING_RETRY_S} s", retry_after=READING_RETRY_S)
    return [DatasetInfo(**d) for name in catalog.dataset_names() if isinstance(d := catalog.described.get(name), dict)]


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
