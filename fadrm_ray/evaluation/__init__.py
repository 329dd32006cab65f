"""Evaluation: students trained on distilled images, scored on the real test set.

The pieces, each in its own module:

- `eval_job`: `EvalJob` (what is evaluated), `EvalSpec` (how its students run) and `EvalParts`
  (what a caller hands over already loaded);
- `relabel`: the teachers' soft labels of each view a student sees (`SoftLabeler`);
- `soft_labels`: stored soft labels (top-k, kept epochs, one packed file);
- `training`: one student trained (`train_student`) and the protocol that sizes it;
- `evaluate`: a student per seed on a set of images (`evaluate_images`), a store run opened for an
  evaluation and `evaluate_run`, its evaluation, cached in it;
- `store_run`: `evaluate_store_run`, the one composition every door calls (students, baselines,
  DD-Ranking, report);
- `scores`: `Evaluation` and `StudentScore`, the results as they are written;
- `baselines`: random real images and the other baselines beside a run;
- `ranking`: DD-Ranking's scores of a run;
- `from_files`: students from a downloaded set's files alone (`fadrm train-student`);
- `product`: the teacher, stored soft labels and recipe written beside an export;
- `report`: the run's report (images, curves, accuracy table).

The store (`fadrm_ray.store`) never imports this package; the run's data and teachers are found
again by `fadrm_ray.runs.reopen`.

This package's own names (`fadrm_ray.evaluation.EvalJob`, ...) are its public API, each loaded on
first use.
"""
from fadrm_ray.lazy import lazy_attributes

_EXPORTS = {
    "EvalJob": "fadrm_ray.evaluation.eval_job",
    "EvalParts": "fadrm_ray.evaluation.eval_job",
    "EvalSpec": "fadrm_ray.evaluation.eval_job",
    "EvalScope": "fadrm_ray.evaluation.store_run",
    "RunEvaluated": "fadrm_ray.evaluation.store_run",
    "evaluate_store_run": "fadrm_ray.evaluation.store_run",
    "evaluate_images": "fadrm_ray.evaluation.evaluate",
    "evaluate_run": "fadrm_ray.evaluation.evaluate",
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
