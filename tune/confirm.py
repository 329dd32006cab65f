"""The sweep's best trials evaluated again before best.yaml is written, so that the best config
knows its noise.

The trials rank configs by the mean top-1 of their students, and the best of many means is
partly the luck of its seeds. So, after the trials, the `TOP` best finished trials are evaluated
again on `--confirm-seeds` student seeds that no trial trained (the trials' own students are read
back from their runs, the new ones trained), beside random real images of the same classes and
IPC on the same seeds (`fadrm_ray.evaluation.baselines`: the baseline `fadrm evaluate` compares
with, distilled into the sweep's store and evaluated with the same students). The best is the
one of them with the highest mean on the new seeds; results.md says, seed by seed, whether it is
above the runner-up and above random real images by more than two standard errors, or level with
them. With `--confirm-seeds 0` the best trial is compared on the trials' own seeds. A standard
error needs at least `MIN_SE_SEEDS` seeds to be worth writing: `--confirm-seeds` 1 and 2 are
refused (tune.request), and on fewer of the trials' own seeds no ± s.e. is written, and no
comparison is called above, below or level: the seeds cannot tell.

Each evaluation is a Ray task with a trial's resources (`evaluate_again`), all submitted at once:
random real images in one task of their own where every trial has the same ones (the seed and
the classes are not swept), first so that it starts first; else beside each trial's students.
"""
from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict

from fadrm_ray.paired import PairedGain, gain_text, paired_gain
from tune.request import MIN_SE_SEEDS
from tune.settings import Reevaluated, Reevaluation, TrialSettings

if TYPE_CHECKING:
    from tune.prepare import Prepared
    from tune.results import TrialRow

TOP = 3


def evaluate_again(task: Reevaluation, dataset, teacher_blobs: list[bytes]) -> Reevaluated:
    """A Ray task of the driver: the trial's run evaluated on `task.seeds` as the trial evaluated it
    (the students it trained are read back from the run), and random real images of its classes
    and IPC on the same seeds where asked."""
    import torch

    from fadrm_ray.evaluation.baselines import baseline_configs, baseline_eval_job, open_baseline
    from fadrm_ray.evaluation.eval_job import EvalJob, EvalParts, EvalSpec
    from fadrm_ray.evaluation.evaluate import evaluate_run, open_for_evaluation
    from fadrm_ray.settings import EvaluationError
    from tune.session import pause_point
    from tune.trainable import teacher_files

    pause_point("confirmation")
    sweep = task.sweep
    torch.set_num_threads(sweep.threads)
    paths = teacher_files(sweep, teacher_blobs)
    job = EvalJob(config=sweep.eval.model_copy(update={"seeds": list(task.seeds)}), teacher_paths=paths,
                  teacher_copies=paths, ipc=task.ipc)
    spec = EvalSpec(device=sweep.device, threads=sweep.threads, progress=False)
    run = open_for_evaluation(task.run_dir, job, spec, EvalParts(dataset=dataset), own_teachers=task.random_real)
    out = Reevaluated(trial=task.trial, run_id=run.reader.run_id, seeds=list(task.seeds), top1_per_seed=[])
    if task.students:
        result = evaluate_run(run, job, spec)
        out = out.model_copy(update={"seeds": list(result.seeds), "top1_per_seed": list(result.top1_per_seed)})
    if not task.random_real:
        return out
    try:
        if run.own_missing is not None or run.reader.config is None:
            raise EvaluationError(run.own_missing or f"{run.run_dir} has no config.yaml")
        made = open_baseline(run, baseline_configs(run.reader.config, task.ipc)["random_real"], job, spec)
        random = evaluate_run(made, baseline_eval_job(job, made.reader), spec)
    except (EvaluationError, OSError, ValueError) as exc:
        return out.model_copy(update={"random_error": " ".join(str(exc).split())})
    return out.model_copy(update={"random_real_per_seed": list(random.top1_per_seed),
                                  "random_run_id": made.reader.run_id})


class ConfirmedTrial(BaseModel):
    """One trial as the confirmation measured it, on the confirmation's seeds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trial: str
    values: dict[str, Any]
    run_id: str | None
    top1: float                         # the trials' own mean, which ranked it
    top1_per_seed: list[float]          # on Confirmation.seeds
    mean: float
    stderr: float | None                # of the mean; None on fewer than MIN_SE_SEEDS seeds


class Confirmation(BaseModel):
    """What the sweep says of its best config (module docstring); `lines` go into results.md."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seeds: list[int]                    # the seeds the comparisons are made on
    new_seeds: bool                     # seeds no trial trained (False: the trials' own)
    trials: list[ConfirmedTrial]        # best first
    best: str
    random_real_per_seed: list[float] | None = None  # on `seeds`
    random_real_error: str | None = None
    vs_runner_up: PairedGain | None = None
    vs_random: PairedGain | None = None
    lines: list[str] = []


def _on(seeds: list[int], values: list[float], wanted: list[int]) -> list[float]:
    by_seed = dict(zip(seeds, values))
    return [by_seed[s] for s in wanted]


def _stderr(values: list[float]) -> float | None:
    """The standard error of the mean of `values`; None on fewer than MIN_SE_SEEDS of them."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) >= MIN_SE_SEEDS else None


def _gain(run: list[float], base: list[float]) -> PairedGain:
    """The paired gain of `run` over `base`, without a standard error on fewer than MIN_SE_SEEDS
    seeds (it is then never clearly above or below)."""
    gain = paired_gain(run, base)
    return gain if gain.seeds >= MIN_SE_SEEDS else gain.model_copy(update={"stderr": None})


def run_confirmation(p: "Prepared", rows: "list[TrialRow]", settings: TrialSettings, dataset_ref, blobs_ref,
                     wait: Callable[[list], list]) -> tuple[Confirmation | None, dict[str, Reevaluated]]:
    """Evaluate the best finished trials again (module docstring), each a Ray task waited on with
    `wait`; returns the confirmation (None where no trial finished) and each evaluation by trial.
    The dataset and the teachers' bytes are in Ray's object store once (`dataset_ref`,
    `blobs_ref`: ray.put by the caller), and every task is given those references, not copies."""
    import ray

    done = sorted((r for r in rows if r.state == "done" and r.top1 is not None and r.run_id),
                  key=lambda r: -(r.top1 or 0.0))
    if not done:
        return None, {}
    req = p.request
    trial_seeds = p.eval_cfg.seed_list
    new = [max(trial_seeds) + 1 + i for i in range(req.confirm_seeds)]
    top = done[:TOP] if new else done[:1]
    shared = not ({"seed", "classes"} & set(p.swept))  # random real images alike for every trial
    task = ray.remote(evaluate_again).options(num_cpus=req.cpus_per_trial, num_gpus=req.trial_gpus)

    def submit(row: "TrialRow", students: bool, random_real: bool):
        from tune.space import trial_config

        job = Reevaluation(sweep=settings, trial=row.trial, run_dir=str(p.store / row.run_id),
                           ipc=trial_config(p.base, row.values).ipc, seeds=trial_seeds + new, students=students,
                           random_real=random_real)
        return task.remote(job, dataset_ref, blobs_ref)

    refs = [submit(top[0], False, True)] if shared else []
    refs += [submit(row, True, not shared) for row in top]
    measured = wait(refs)
    again = {m.trial: m for m in measured[len(refs) - len(top):]}
    if shared:  # the random real images, beside the best trial's students
        again[top[0].trial] = again[top[0].trial].model_copy(update={
            k: getattr(measured[0], k) for k in ("random_real_per_seed", "random_run_id", "random_error")})
    return judge(p, done, top, again, trial_seeds, new, shared), again


def judge(p: "Prepared", done: "list[TrialRow]", top: "list[TrialRow]", again: dict[str, Reevaluated],
          trial_seeds: list[int], new: list[int], shared: bool) -> Confirmation:
    """The confirmation of `top` from their evaluations `again`: the best by its mean on the new
    seeds (the trials' own where there are none), compared with the runner-up and random real
    images seed by seed."""
    seeds = new or trial_seeds
    confirmed = []
    for row in top:
        m = again.get(row.trial)
        values = _on(m.seeds, m.top1_per_seed, seeds) if m is not None else list(row.top1_per_seed or [])
        confirmed.append(ConfirmedTrial(trial=row.trial, values=row.values, run_id=row.run_id, top1=row.top1,
                                        top1_per_seed=values, mean=statistics.fmean(values), stderr=_stderr(values)))
    if not new and len(done) > 1:  # no new seeds: the runner-up as the trials measured it
        runner = done[1]
        values = list(runner.top1_per_seed or [])
        if len(values) == len(seeds):
            confirmed.append(ConfirmedTrial(trial=runner.trial, values=runner.values, run_id=runner.run_id,
                                            top1=runner.top1, top1_per_seed=values, mean=statistics.fmean(values),
                                            stderr=_stderr(values)))
    confirmed.sort(key=lambda c: -c.mean)
    best = confirmed[0]
    source = again.get(top[0].trial) if shared else again.get(best.trial)
    random, random_error = None, None
    if source is not None and source.random_real_per_seed is not None:
        random = _on(source.seeds, source.random_real_per_seed, seeds)
    elif source is not None:
        random_error = source.random_error
    vs_runner = _gain(best.top1_per_seed, confirmed[1].top1_per_seed) if len(confirmed) > 1 else None
    vs_random = _gain(best.top1_per_seed, random) if random is not None else None
    result = Confirmation(seeds=seeds, new_seeds=bool(new), trials=confirmed, best=best.trial,
                          random_real_per_seed=random, random_real_error=random_error, vs_runner_up=vs_runner,
                          vs_random=vs_random)
    return result.model_copy(update={"lines": describe(result, top[0], p.swept)})


def _level(gain: PairedGain | None, them: str) -> str:
    if gain is None:
        return ""
    text = gain_text(gain)
    if gain.stderr is None:
        few = "one seed gives" if gain.seeds == 1 else f"{gain.seeds} seeds give"
        return f"{text}: {few} no usable standard error, so the seeds cannot tell it from {them}"
    if gain.clearly_above:
        return f"{text}: above {them} by more than two standard errors"
    if gain.clearly_below:
        return f"{text}: below {them} by more than two standard errors"
    return f"{text}: level with {them} (within two standard errors)"


def describe(c: Confirmation, leader: "TrialRow", swept) -> list[str]:
    """What results.md says of the confirmation."""
    from tune.space import shown_values

    seeds = ", ".join(map(str, c.seeds))
    which = (f"{len(c.seeds)} student seed{'s' if len(c.seeds) != 1 else ''} that no trial trained (seeds {seeds})"
             if c.new_seeds else f"the trials' own student seeds ({seeds}); `--confirm-seeds N` adds new ones")
    spread_head = "mean ± s.e." if len(c.seeds) >= MIN_SE_SEEDS else f"mean; no usable s.e. on {len(c.seeds)} seeds"
    lines = [f"The {len(c.trials)} best finished trial{'s' if len(c.trials) != 1 else ''} evaluated again on "
             f"{which}, beside random real images of the same classes and IPC on the same seeds:", "",
             f"| trial | values | top-1, trials' seeds | top-1, these seeds ({spread_head}) |", "|---|---|---|---|"]
    for t in c.trials:
        spread = f" ± {t.stderr:.2f}" if t.stderr is not None else ""
        lines.append(f"| {t.trial} | {shown_values(t.values, swept)} | {t.top1:.2f} | {t.mean:.2f}{spread} |")
    if c.random_real_per_seed is not None:
        r = c.random_real_per_seed
        spread = f" ± {_stderr(r):.2f}" if _stderr(r) is not None else ""
        lines.append(f"| random real images | | | {statistics.fmean(r):.2f}{spread} |")
    best = c.trials[0]
    spread = f" ± {best.stderr:.2f} s.e." if best.stderr is not None else ""
    lines += ["", f"**Best: trial {best.trial}** ({shown_values(best.values, swept)}), top-1 {best.mean:.2f}{spread} on "
                  f"these seeds; its config is best.yaml."]
    if best.trial != leader.trial:
        lines.append(f"Trial {leader.trial} led on the trials' own seeds; on these seeds trial {best.trial} is ahead.")
    if c.vs_runner_up is not None:
        runner = c.trials[1]
        lines.append(f"- Against the runner-up, trial {runner.trial} ({shown_values(runner.values, swept)}): "
                     f"{_level(c.vs_runner_up, 'the runner-up')}.")
    else:
        lines.append("- No runner-up: one trial finished.")
    if c.vs_random is not None:
        lines.append(f"- Against random real images: {_level(c.vs_random, 'random real images')}.")
    else:
        lines.append(f"- Against random real images: not compared ({c.random_real_error or 'not measured'}).")
    return lines


def random_real_note(p: "Prepared", rows: "list[TrialRow]", again: dict) -> tuple[str, list[float] | None]:
    """Mark each finished row against random real images on the trials' seeds (measured beside
    the best trials by the confirmation); returns the summary's line and, where every trial has
    the same random real images, their top-1 on those seeds (for the plots)."""
    from tune.results import mark_random

    seeds = p.eval_cfg.seed_list
    shared = not ({"seed", "classes"} & set(p.swept))
    measured, error = {}, None
    for m in again.values():
        if m.random_real_per_seed is not None:
            by_seed = dict(zip(m.seeds, m.random_real_per_seed))
            measured["" if shared else m.trial] = [by_seed[s] for s in seeds]
        error = error or m.random_error
    below = mark_random(rows, seeds, measured)
    if not any(r.state == "done" for r in rows):
        return "not compared: no trial finished", None
    if not shared:
        return ("not compared: the trials sweep the seed or the classes, so random real images differ between them; "
                "the best trials are compared with their own"), None
    if "" not in measured:
        return f"not compared: the random real images' students failed ({error or 'not measured'})", None
    random = measured[""]
    return (f"random real images: {sum(random) / len(random):.2f} top-1 over seeds "
            f"{', '.join(f'{v:.2f}' for v in random)}; {below} finished trial{'s' if below != 1 else ''} "
            f"clearly below them (paired, more than two standard errors)"), random
