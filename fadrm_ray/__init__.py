"""fadrm-ray: FADRM dataset distillation (pure PyTorch library; the Ray layer lives in `actors`).

The public API, each name loaded on first use (`import fadrm_ray` imports no torch):

- settings: `make_config` (a `DistillConfig` from a preset and overrides), `EvalConfig`, `SqueezeConfig`;
- data: `get_dataset(spec)`, an `ImageDataset`;
- teachers: `ensure_teacher` (train one, or reuse the one saved there), `load_teacher`,
  `import_teacher` (`ImportSettings`: weights trained elsewhere), `create_model`;
- distillation: `distill` (in this process, or through the Ray door), or `prepare_job` then a
  door's `run` (`ExecutionSpec` says how it runs), `DistillResult`;
- the store: `open_run` (a run's images, checked), `export_imagefolder`, `export_parquet`, `export_tensors`;
- evaluation: `evaluate_store_run` (`EvalJob`, `EvalScope`); more in `fadrm_ray.evaluation`;
- `run_demo`, the main job end to end; `InputError`, the base of every bad-input error.
"""
from fadrm_ray.lazy import lazy_attributes

__version__ = "0.1.0"

_EXPORTS = {
    "DistillConfig": "fadrm_ray.config",
    "EvalConfig": "fadrm_ray.config",
    "SqueezeConfig": "fadrm_ray.config",
    "make_config": "fadrm_ray.config",
    "ImageDataset": "fadrm_ray.data",
    "get_dataset": "fadrm_ray.data",
    "create_model": "fadrm_ray.models",
    "load_teacher": "fadrm_ray.models",
    "ensure_teacher": "fadrm_ray.squeeze",
    "ImportSettings": "fadrm_ray.teacher_import",
    "import_teacher": "fadrm_ray.teacher_import",
    "ExecutionSpec": "fadrm_ray.runs.job",
    "prepare_job": "fadrm_ray.runs.job",
    "DistillResult": "fadrm_ray.runs.execute",
    "distill": "fadrm_ray.runs.execute",
    "open_run": "fadrm_ray.store",
    "export_imagefolder": "fadrm_ray.store",
    "export_parquet": "fadrm_ray.store",
    "export_tensors": "fadrm_ray.store",
    "EvalJob": "fadrm_ray.evaluation.eval_job",
    "EvalScope": "fadrm_ray.evaluation.store_run",
    "evaluate_store_run": "fadrm_ray.evaluation.store_run",
    "run_demo": "fadrm_ray.demo",
    "InputError": "fadrm_ray.errors",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)
