"""What an evaluation reports, as models: each student, their summary, the baselines and the gains.

`training.train_student` returns a `StudentScore`, `evaluate.evaluate_images` and `evaluate_run`
an `Evaluation`, `baselines.evaluate_with_baselines` the same with its baselines, gains and
`Ranking` (ranking.py) filled in. They are written as JSON (the evaluation cache inside a run,
report/evaluation.json, the service's evaluation file) and read back with `model_validate_json`,
so every reader sees the same fields. Unknown keys are ignored on reading: a file written with more fields (the CLI
adds the report's paths) still reads.
"""
from __future__ import annotations

import statistics

from pydantic import BaseModel, ConfigDict

from fadrm_ray.config import EvalConfig
from fadrm_ray.paired import PairedGain  # defined below the evaluation: the pilot reports it too

Curve = list[tuple[int, float]]  # (epoch, test top-1 in percent) at each test evaluation


class _Score(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, protected_namespaces=())


class StudentScore(_Score):
    """One student (one seed) trained on a set of images."""

    seed: int
    final_top1: float
    best_top1: float            # the best test top-1 seen (selects on the test set; for comparison only)
    curve: Curve
    epochs: int
    steps: int
    seconds: float


class BaselineScore(_Score):
    """A baseline's evaluation in brief, or why it could not be built."""

    run_id: str | None = None
    run_dir: str | None = None
    preset: str | None = None
    top1_mean: float | None = None
    top1_std: float | None = None
    top1_per_seed: list[float] = []
    best_top1_mean: float | None = None
    error: str | None = None
    same_as: str | None = None   # the very images of that baseline (one set of students, one row)


class Ranking(_Score):
    """DD-Ranking's scores of a set (ranking.py): top-1 values and differences in points, LRS
    and ARS in [0, 1], each a mean over seeds. A score is None where what it needs was not
    measured; `missing` says which and why."""

    full_hard_top1: float | None = None   # a student on the whole training split, hard labels
    full_source: str | None = None        # where that figure comes from: a student, or the teachers' record
    hard_top1_per_seed: list[float] = []  # students on the set, hard labels
    hlr: float | None = None              # hard-label recovery: full_hard_top1 minus the set's hard-label top-1
    ior: float | None = None              # improvement over random: the set minus random real images
    lrs: float | None = None              # label-robust score
    plain_ior: float | None = None        # IOR of students that see the images as they are
    ars: float | None = None              # augmentation-robust score
    weight: float = 0.5                   # w of LRS and gamma of ARS
    missing: list[str] = []

    def hard_label_text(self) -> str | None:
        """'41.20 ± 1.30%': the set's top-1 with hard labels only (no teacher), where measured."""
        values = self.hard_top1_per_seed
        if not values:
            return None
        mean = statistics.fmean(values)
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{mean:.2f} ± {spread:.2f}%"


class Evaluation(_Score):
    """Students trained on one set of images, tested on the real test images of its classes."""

    top1_mean: float
    top1_std: float             # sample standard deviation over seeds (0 with one seed)
    top1_per_seed: list[float]
    best_top1_mean: float
    best_top1_std: float
    best_top1_per_seed: list[float]
    curves: list[Curve]
    student: str
    student_kwargs: dict = {}
    epochs: int
    steps_per_seed: int
    seeds: list[int]
    seeds_reused: list[int] = []
    seconds: float              # students trained now, plus the training time of those reused
    images: int
    images_per_class: list[int] | None = None
    dataset: str
    # The classes the students were tested on, their outputs restricted to them; None: every class.
    classes: list[int] | None = None
    test_size: int              # test images the students were scored on
    teachers: list[str]
    config: EvalConfig          # the settings, with the epochs and stretch that ran made explicit
    augment: bool = True        # False: the students saw the images as they are (no crop, flip or CutMix)
    # Set when the images are a store run (evaluate_run).
    run_id: str | None = None
    run_dir: str | None = None
    preset: str | None = None
    ipc: int | None = None
    content_hash: str | None = None
    complete: bool | None = None
    cached: bool = False        # read from the run's evaluation cache, not trained now
    # Set by baselines.evaluate_with_baselines.
    baselines: dict[str, BaselineScore] = {}
    gains: dict[str, float] = {}
    paired_gains: dict[str, PairedGain] = {}
    ranking: Ranking | None = None  # DD-Ranking's scores, beside the baselines
    # One line each on what the baselines say against the set (`baselines.below_random`).
    warnings: list[str] = []

    @property
    def students(self) -> list[StudentScore]:
        """Each student again, as `train_student` reported it (its seconds an even share)."""
        share = self.seconds / max(1, len(self.seeds))
        return [StudentScore(seed=s, final_top1=f, best_top1=b, curve=c, epochs=self.epochs, steps=self.steps_per_seed,
                             seconds=share)
                for s, f, b, c in zip(self.seeds, self.top1_per_seed, self.best_top1_per_seed, self.curves)]

    def brief(self) -> BaselineScore:
        """This evaluation as a baseline of another run reports it."""
        return BaselineScore(run_id=self.run_id, run_dir=self.run_dir, preset=self.preset, top1_mean=self.top1_mean,
                             top1_std=self.top1_std, top1_per_seed=self.top1_per_seed,
                             best_top1_mean=self.best_top1_mean)
