"""Evaluation: students trained on distilled images, scored on the real test set.

The pieces, each in its own module:

- `eval_job`: `EvalJob` (what is evaluated), `EvalSpec` (how its students run) and `EvalParts`
  (what a caller hands over already loaded);
- `relabel`: the teachers' soft labels of each view a student sees (`SoftLabeler`);
- `soft_labels`: stored soft labels (top-k, kept epochs, one packed file);
- `students`: the student trainer and `evaluate_run`, an evaluation of a store run, cached in it;
- `scores`: `Evaluation` and `StudentScore`, the results as they are written;
- `baselines`: random real images and the other baselines beside a run;
- `ranking`: DD-Ranking's scores of a run;
- `from_files`: students from a downloaded set's files alone (`fadrm train-student`);
- `product`: the teacher, stored soft labels and recipe written beside an export;
- `report`: the run's report (images, curves, accuracy table).

The store (`fadrm_ray.store`) never imports this package; the run's data and teachers are found
again by `fadrm_ray.run.reopen`.

This package's own names (`fadrm_ray.evaluation.EvalJob`, ...) are its public API, each loaded on
first use.
"""
from fadrm_ray.lazy import lazy_attributes

_EXPORTS = {
    "EvalJob": "fadrm_ray.evaluation.eval_job",
    "EvalParts": "fadrm_ray.evaluation.eval_job",
    "EvalSpec": "fadrm_ray.evaluation.eval_job",
    "EvalScope": "fadrm_ray.evaluation.measure",
    "RunEvaluated": "fadrm_ray.evaluation.measure",
    "evaluate_store_run": "fadrm_ray.evaluation.measure",
    "evaluate_images": "fadrm_ray.evaluation.students",
    "evaluate_run": "fadrm_ray.evaluation.students",
    "Evaluation": "fadrm_ray.evaluation.scores",
    "Ranking": "fadrm_ray.evaluation.scores",
    "StudentScore": "fadrm_ray.evaluation.scores",
    "SoftLabeler": "fadrm_ray.evaluation.relabel",
    "train_from_files": "fadrm_ray.evaluation.from_files",
    "export_with_product": "fadrm_ray.evaluation.product",
    "write_report": "fadrm_ray.evaluation.report",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)
