"""Choosing the checkpoint to deploy by task score, and noticing when training starts to hurt.

- ``summarize``: mean score of one checkpoint with a percentile-bootstrap interval (seeded, so
  the same scores always give the same interval). Failed judge rows (score None) are left out
  and counted, never averaged in as zeros.
- ``select_best``: the checkpoint with the highest mean. Equal means (an eval split the model
  has saturated cannot tell its checkpoints apart) go to the lowest held-out loss, the
  trainer's ``eval_loss`` on the same eval split, when every tied checkpoint has one; otherwise
  to the earlier step (fewer steps: less drift from the base, and it was there first).
  ``rank`` applies the same order to checkpoints of several runs and says what decided.
- ``detect_overfitting``: after the best score so far, the last ``patience`` evals are all
  more than ``margin`` below it -> an ``EarlyStop`` for the control plane.
- ``detect_plateau``: the last ``patience`` checkpoints' scores each stay within the bootstrap
  interval of the best checkpoint before them -> an ``EarlyStop``: more steps buy nothing the
  evals can tell apart from noise.
- ``decide_stop``: both rules over one run's scored checkpoints, overfitting first.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CLEAR_MARGIN = 0.15
"""Least gain of the best checkpoint's mean rubric score over the base model's (0..1 scale)
that counts as a clear win on the embedded task (tests/evals/test_margin.py, ``make demo``)."""


@dataclass(frozen=True, kw_only=True)
class StepScore:
    """One checkpoint's score."""

    step: int
    """Optimizer step (0: the base model)."""
    mean: float
    """Mean sample score, 0..1."""
    ci_low: float
    """Lower end of the bootstrap interval."""
    ci_high: float
    """Upper end of the bootstrap interval."""
    num_samples: int
    """Samples scored."""
    num_failed: int = 0
    """Samples the judge failed on (not in the mean)."""


def summarize(step: int, scores: Sequence[float | None], *, num_resamples: int = 1000,
              level: float = 0.95, seed: int = 0) -> StepScore:
    ok = [float(s) for s in scores if s is not None]
    failed = len(scores) - len(ok)
    if not ok:
        raise ValueError(f"step {step}: no successfully judged samples ({failed} failed)")
    mean = sum(ok) / len(ok)
    rng = random.Random(seed)
    n = len(ok)
    means = sorted(sum(ok[rng.randrange(n)] for _ in range(n)) / n
                   for _ in range(num_resamples))
    lo = means[int((1 - level) / 2 * (num_resamples - 1))]
    hi = means[int(round((1 + level) / 2 * (num_resamples - 1)))]
    return StepScore(step=step, mean=mean, ci_low=lo, ci_high=hi, num_samples=n,
                     num_failed=failed)


TIE = 1e-12
"""Means closer than this are equal: means of the same sample scores summed in a different order
differ in the last bits."""


def rank(candidates: Sequence[tuple[StepScore, float | None]]) -> tuple[int, str]:
    """(index of the best of ``candidates``, what decided it) for (score, held-out loss or None)
    pairs: the highest mean; among equal means the lowest loss when every one of them has a
    loss, else the earliest step, then the first listed. What decided: ``mean score``, or
    ``eval loss`` / ``earliest step`` with how many candidates tied."""
    if not candidates:
        raise ValueError("rank: no candidates")
    top = max(c.mean for c, _ in candidates)
    tied = [i for i, (c, _) in enumerate(candidates) if c.mean >= top - TIE]
    if len(tied) == 1:
        return tied[0], "mean score"
    if all(candidates[i][1] is not None for i in tied):
        return (min(tied, key=lambda i: (candidates[i][1], candidates[i][0].step, i)),
                f"eval loss ({len(tied)} checkpoints tie on the mean score)")
    return (min(tied, key=lambda i: (candidates[i][0].step, i)),
            f"earliest step ({len(tied)} checkpoints tie on the mean score, not all with an "
            "eval loss)")


def select_best(by_step: Mapping[int, Sequence[float | None]],
                eval_loss: Mapping[int, float] | None = None, **kwargs: float) -> StepScore:
    """Highest mean score; equal means go to the lowest ``eval_loss`` (step -> the trainer's
    held-out loss at that step) when each has one, else to the earlier step."""
    if not by_step:
        raise ValueError("select_best: no scored checkpoints")
    summaries = [summarize(step, scores, **kwargs)  # type: ignore[arg-type]
                 for step, scores in sorted(by_step.items())]
    losses = eval_loss or {}
    return summaries[rank([(s, losses.get(s.step)) for s in summaries])[0]]


@dataclass(frozen=True, kw_only=True)
class EarlyStop:
    """Training has gone past its best checkpoint."""

    peak_step: int
    """Step of the best score so far."""
    peak_score: float
    """That score."""
    last_step: int
    """Latest evaluated step."""
    last_score: float
    """Its score."""
    reason: str
    """One sentence for people and logs."""
    rule: str = "overfitting"
    """Which rule stopped it: ``overfitting`` or ``plateau``."""


def detect_overfitting(curve: Sequence[tuple[int, float]], *, margin: float = 0.02,
                       patience: int = 2) -> EarlyStop | None:
    """``curve``: (step, mean score) pairs. Stop when the last ``patience`` evals after the peak
    are each more than ``margin`` below it."""
    if patience < 1:
        raise ValueError(f"patience: must be >= 1, got {patience}")
    if margin < 0:
        raise ValueError(f"margin: must be >= 0, got {margin}")
    points = sorted(curve)
    if len(points) < patience + 1:
        return None
    peak_i = 0
    for i, (_, score) in enumerate(points):
        if score > points[peak_i][1] + 1e-12:
            peak_i = i
    after = points[peak_i + 1:]
    if len(after) < patience:
        return None
    tail = after[-patience:]
    peak_step, peak = points[peak_i]
    if all(score < peak - margin for _, score in tail):
        last_step, last = points[-1]
        return EarlyStop(peak_step=peak_step, peak_score=peak, last_step=last_step,
                         last_score=last,
                         reason=f"score fell from {peak:.3f} at step {peak_step} to "
                                f"{last:.3f} at step {last_step}: {patience} evals in a row "
                                f"more than {margin} below the peak")
    return None


PLATEAU_PATIENCE = 3
"""Checkpoints in a row that must fail to beat the best one before them by more than its
bootstrap interval before training stops on a plateau. Three, so one noisy eval (12 samples on
CPU) neither stops a run nor keeps a flat one going."""


def detect_plateau(summaries: Sequence[StepScore], *,
                   patience: int = PLATEAU_PATIENCE) -> EarlyStop | None:
    """``summaries``: one per scored checkpoint (the base model, step 0, is left out: a run that
    has not yet left the base is still warming up). Stop when each of the last ``patience``
    checkpoints scores at most the upper end of the 95% bootstrap interval of the best
    checkpoint before it: no improvement larger than that checkpoint's own noise."""
    if patience < 1:
        raise ValueError(f"patience: must be >= 1, got {patience}")
    points = sorted((s for s in summaries if s.step > 0), key=lambda s: s.step)
    if len(points) < patience + 1:
        return None
    tail_start = len(points) - patience
    best = points[0]
    for s in points[1:tail_start]:
        if s.mean > best.mean + 1e-12:
            best = s
    for s in points[tail_start:]:
        if s.mean > best.ci_high + 1e-12:
            return None
        if s.mean > best.mean + 1e-12:
            best = s
    last = points[-1]
    peak = max(points, key=lambda s: (s.mean, -s.step))
    return EarlyStop(
        peak_step=peak.step, peak_score=peak.mean, last_step=last.step, last_score=last.mean,
        rule="plateau",
        reason=f"score plateaued: the last {patience} evals (steps "
               f"{', '.join(str(s.step) for s in points[tail_start:])}) did not beat the best "
               f"before them by more than its bootstrap interval (best {peak.mean:.3f} at step "
               f"{peak.step}, interval up to {peak.ci_high:.3f})")


def decide_stop(by_step: Mapping[int, Sequence[float | None]], *, margin: float = 0.02,
                patience: int = 2, plateau_patience: int = PLATEAU_PATIENCE) -> EarlyStop | None:
    """Whether a run should stop, from its sample scores by step (step 0: the base model):
    the score fell after its peak (``detect_overfitting``), else it plateaued
    (``detect_plateau``); None keeps training."""
    summaries = [summarize(step, scores) for step, scores in sorted(by_step.items())
                 if any(x is not None for x in scores)]
    stop = detect_overfitting([(s.step, s.mean) for s in summaries], margin=margin,
                              patience=patience)
    return stop or detect_plateau(summaries, patience=plateau_patience)
