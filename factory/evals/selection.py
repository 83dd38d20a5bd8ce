"""Choosing the checkpoint to deploy by task score, and noticing when training starts to hurt.

- ``summarize``: mean score of one checkpoint with a 95% interval and the method that gave it.
  Pass/fail scores (every score 0 or 1) get the Wilson score interval, which never collapses to
  a point (20 of 20 right: [0.839, 1.000], where a percentile bootstrap gives [1.000, 1.000]).
  Graded scores get the same formula with their own variance in place of p(1-p)
  (``score_interval``). Failed judge rows (score None) are left out and counted, never
  averaged in as zeros. Samples that share a phrasing cluster (the eval split holds out whole
  clusters: ``factory.curation.phrasing``) tend to pass or fail together; given each sample's
  cluster, the interval is taken on the effective sample count of the cluster-robust variance
  (``cluster_design``): measured on clusters correlated at ICC 0.1-0.6, it holds the true mean
  0.83-0.97 of the time (one cell 0.69) where the independent interval holds it 0.31-0.93.
- ``format_score``: the one way a score is printed: ``0.962 [0.921, 0.983] n=200 (Wilson)``,
  ``... n=385 in 60 clusters (Wilson, clustered)``.
- ``clusters_needed``: how many eval clusters give the precision of a number of independent
  samples, once the clusters' correlation is known.
- ``rank`` / ``select_best``: the checkpoint whose interval has the highest lower bound;
  ``rank`` says what decided, and why that rule (measured). Ties go to the lowest held-out
  loss, else the earlier step.
- ``leaders`` / ``rank_final``: the final choice. Mid-training evals may judge a subset of the
  eval set; the ``FINAL_CANDIDATES`` leading checkpoints (``leaders``, in ``rank``'s order) are
  then judged on the whole final set, and ``rank_final`` ranks only the checkpoints judged on
  the most samples, so none wins or loses for having been judged on fewer.
- ``detect_overfitting``: after the best score so far, the last ``patience`` evals are all
  more than ``margin`` below it -> an ``EarlyStop`` for the control plane.
- ``detect_plateau``: the last ``patience`` checkpoints' scores each stay within the 95%
  interval of the best checkpoint before them -> an ``EarlyStop``: more steps buy nothing the
  evals can tell apart from noise.
- ``decide_stop``: both rules over one run's scored checkpoints, overfitting first.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

CLEAR_MARGIN = 0.15
"""Least gain of the best checkpoint's mean rubric score over the base model's (0..1 scale)
that counts as a clear win on the embedded task (tests/evals/test_margin.py, ``make demo``)."""

WILSON = "wilson"
"""``method`` of an interval from pass/fail scores: the Wilson score interval."""
WILSON_GRADED = "wilson_graded"
"""``method`` of an interval from graded scores: the Wilson formula with their own variance."""
WILSON_CLUSTERED = "wilson_clustered"
"""``method`` of an interval from pass/fail scores in clusters: Wilson on the effective count."""
WILSON_GRADED_CLUSTERED = "wilson_graded_clustered"
"""``method`` of an interval from graded scores in clusters: the graded form on the effective
count."""
METHOD_NAMES = {WILSON: "Wilson", WILSON_GRADED: "Wilson, graded",
                WILSON_CLUSTERED: "Wilson, clustered",
                WILSON_GRADED_CLUSTERED: "Wilson, graded, clustered"}
"""How ``format_score`` names each method."""


@dataclass(frozen=True, kw_only=True)
class Interval:
    """A mean with its interval: a checkpoint's score, or a share such as shadow agreement."""

    mean: float
    """Mean score (or share passing), 0..1."""
    ci_low: float
    """Lower end of the 95% interval."""
    ci_high: float
    """Upper end of the 95% interval."""
    num_samples: int
    """Samples (or pairs) behind the mean."""
    method: str | None
    """``wilson``, ``wilson_graded`` or their ``_clustered`` forms; None where a stored row does
    not say."""
    num_clusters: int | None = None
    """Clusters the samples fall in, where some cluster holds more than one of them; None where
    each sample counts as independent (no clusters known, or one sample per cluster)."""


@dataclass(frozen=True, kw_only=True)
class StepScore(Interval):
    """One checkpoint's score."""

    step: int
    """Optimizer step (0: the base model)."""
    num_failed: int = 0
    """Samples the judge failed on (not in the mean)."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any], *, step: int = 0) -> StepScore:
        """A stored score back: a ``best_checkpoints`` row or a checkpoint eval's metadata
        (``mean_score``, ``ci_low``, ``ci_high``, ``num_samples``; ``ci_method`` and
        ``num_clusters``, empty or missing where not recorded)."""
        stored_step = row.get("step")
        return cls(step=int(stored_step) if stored_step is not None else step,
                   mean=float(row["mean_score"]), ci_low=float(row["ci_low"]),
                   ci_high=float(row["ci_high"]), num_samples=int(row["num_samples"]),
                   num_failed=int(row.get("num_failed") or 0),
                   method=row.get("ci_method") or None,
                   num_clusters=int(row["num_clusters"]) if row.get("num_clusters") else None)


def format_score(score: Interval) -> str:
    """``0.962 [0.921, 0.983] n=200 (Wilson)``: the mean, its 95% interval, the samples behind
    it (``n=385 in 60 clusters`` where they fall in clusters), the judge failures left out, if
    any, and the method. Every place that shows a score to a person prints it this way, so no
    bare 1.000 hides that it came from 12 samples, or from 3 ways of asking."""
    failed = getattr(score, "num_failed", 0)
    clusters = (f" in {score.num_clusters} cluster{'s' if score.num_clusters > 1 else ''}"
                if score.num_clusters is not None else "")
    text = (f"{score.mean:.3f} [{score.ci_low:.3f}, {score.ci_high:.3f}] n={score.num_samples}"
            + clusters
            + (f" +{failed} judge failure{'s' if failed > 1 else ''}" if failed else ""))
    if score.method is not None:
        text += f" ({METHOD_NAMES.get(score.method, score.method)})"
    return text


def score_interval(mean: float, variance: float, num_samples: float, *,
                   level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval's formula for a mean of ``num_samples`` scores in [0, 1] (an
    effective count, not always whole, where the scores are clustered: ``cluster_design``) whose
    per-sample variance is ``variance``: center (m + z²/2n) / (1 + z²/n), half-width
    z / (1 + z²/n) * sqrt(variance / n + z² / 4n²). With 0/1 scores the variance is m(1 - m)
    and this is the Wilson interval (Wilson 1927); graded scores vary less than that (a score
    in [0, 1] has at most m(1 - m)), and their own variance gives a narrower interval.
    The z²/4n² term keeps it open when every score is the same.

    Measured on graded scores (a share exactly right, the rest Beta-distributed; 400 draws per
    cell, means 0.5, 0.8, 0.95, 0.99, 12, 50 and 200 samples; tests/evals/test_selection.py):
    it held the true mean 0.81-0.97 of the time (0.81 at a mean of 0.99 over 12 samples). A
    percentile bootstrap (200 resamples) on the same draws held it 0.21-0.96 of the time (0.21
    there, its interval 0.03 wide: the overconfident 1.000 this replaces), at the same width as
    this interval's at a mean of 0.5 (0.379 against 0.380 over 12 samples)."""
    if not 0 < level < 1:
        raise ValueError(f"level: must be in (0, 1), got {level}")
    if num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
    z = NormalDist().inv_cdf((1 + level) / 2)
    n = num_samples
    denom = 1 + z * z / n
    center = (mean + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(max(0.0, variance) / n + z * z / (4 * n * n))
    # A mean of 0 or 1 has every score at that end: the formula lands there up to rounding.
    low = 0.0 if mean <= 0 else max(0.0, center - half)
    high = 1.0 if mean >= 1 else min(1.0, center + half)
    return low, high


def wilson_interval(num_passed: int, num_samples: int, *,
                    level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of ``num_passed`` of ``num_samples``. Unlike the normal
    approximation and the bootstrap it stays open at 0 and at ``num_samples`` passed
    (20 of 20: [0.839, 1.000]) and keeps near its nominal coverage down to a dozen samples,
    where the evals of a CPU run live."""
    if not 0 <= num_passed <= num_samples:
        raise ValueError(f"wilson_interval: {num_passed} passed of {num_samples}")
    p = num_passed / num_samples if num_samples else 0.0
    return score_interval(p, p * (1 - p), num_samples, level=level)


@dataclass(frozen=True, kw_only=True)
class ClusterDesign:
    """How clustered samples' mean compares with that of as many independent samples."""

    design_effect: float
    """Variance of the mean, cluster-robust, over the variance the same scores would give if
    independent; at least 1."""
    num_clusters: int
    """Clusters the samples fall in."""
    cluster_size: float
    """Their size-weighted mean size, sum(size²) / samples: the size the design effect
    ``1 + (size - 1) * ICC`` of unequal clusters goes by (Kish 1965)."""

    @property
    def icc(self) -> float:
        """The intraclass correlation this design effect implies (0 with no cluster of two)."""
        if self.cluster_size <= 1:
            return 0.0
        return (self.design_effect - 1) / (self.cluster_size - 1)


def cluster_design(scores: Sequence[float], clusters: Sequence[str]) -> ClusterDesign:
    """The design effect of ``scores`` (judged, in [0, 1]) in ``clusters`` (one id a score):
    the cluster-robust ("sandwich") variance of the mean, sum over clusters of (sum of the
    cluster's deviations from the mean)² / n², over the independent one, variance / n; at
    least 1, and exactly 1 when every cluster holds one score or every score is the same (the
    correlation cannot be told from scores that do not vary). The effective count
    ``n / design_effect`` is then n when each sample is its own cluster and k when k equal
    clusters pass or fail whole.

    Why this, measured (tests/evals/test_clustered_intervals.py measures four such cells
    again): 0/1 scores of 8 to 77 clusters of 5 to 20 samples (equal or uneven sizes), each
    cluster's pass rate drawn from a Beta of intraclass correlation (ICC) 0, 0.1, 0.3 or 0.6
    around 0.5, 0.8 or 0.95; 400 draws per cell. Where the ICC is above 0 the independent
    Wilson interval held the true mean 0.31-0.93 of the time (0.57 at ICC 0.6 over 40 clusters
    of 10); Wilson on the effective count held it 0.83-0.97 in every cell but one, 20 clusters
    of about 20 at 0.95 and ICC 0.6 (0.69 against 0.31: one or two clusters carry every failure
    there, and a variance estimated from so few clusters is itself noisy). Where the ICC is 0
    it held 0.94-0.97 (independent: 0.92-0.97). The small-sample factor k / (k - 1) added at
    most 0.02 and would give k - 1, not k, for clusters that pass or fail whole; an ANOVA
    estimate of the ICC in ``1 + (mean size - 1) * ICC`` held 0.71-0.97, below this on uneven
    sizes."""
    if len(scores) != len(clusters):
        raise ValueError(f"clusters: one per score, got {len(clusters)} for {len(scores)} "
                         "scores")
    n = len(scores)
    if n == 0:
        raise ValueError("cluster_design: no scores")
    mean = sum(scores) / n
    deviation: dict[str, float] = defaultdict(float)
    size: Counter[str] = Counter(clusters)
    for score, cluster in zip(scores, clusters, strict=True):
        deviation[cluster] += score - mean
    independent = sum((s - mean) ** 2 for s in scores)
    robust = sum(d * d for d in deviation.values())
    effect = 1.0 if len(size) == n or independent <= 0 else max(1.0, robust / independent)
    return ClusterDesign(design_effect=effect, num_clusters=len(size),
                         cluster_size=sum(k * k for k in size.values()) / n)


def clusters_needed(num_samples: int, *, cluster_size: float, icc: float) -> int:
    """Eval clusters of ``cluster_size`` samples (``ClusterDesign.cluster_size``) whose mean is
    as precise as that of ``num_samples`` independent ones (the planner's
    ``eval_samples_needed``: 385 for a 95% interval of ±0.05): a cluster is worth
    ``cluster_size / (1 + (cluster_size - 1) * icc)`` independent samples. The ICC comes from
    an earlier eval on the same eval set (``ClusterDesign.icc`` of its scores and
    ``split_group``s); at ICC 0.3, 385 samples' precision takes 170 clusters of 5 (850 samples)
    or 143 of 10 (1,430): more clusters, not more samples a cluster, buy precision."""
    if num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
    if cluster_size < 1:
        raise ValueError(f"cluster_size: must be >= 1, got {cluster_size}")
    if not 0 <= icc <= 1:
        raise ValueError(f"icc: must be in [0, 1], got {icc}")
    return math.ceil(num_samples * (1 + (cluster_size - 1) * icc) / cluster_size - 1e-9)


def summarize(step: int, scores: Sequence[float | None], *,
              clusters: Sequence[str] | None = None, level: float = 0.95) -> StepScore:
    """``step``'s mean score over the judged samples of ``scores`` (None: the judge failed),
    with its ``level`` interval: Wilson when every score is 0 or 1, else the same formula with
    the scores' own variance (``score_interval``). ``clusters``: each score's cluster (the
    eval sample's phrasing cluster, ``dataset_eval.split_group``); where some cluster holds
    more than one judged sample, the interval is taken on the effective count
    ``n / design_effect`` (``cluster_design``) and the method is the ``_clustered`` one. Without
    them, or with one sample per cluster, every sample counts as independent."""
    if clusters is not None and len(clusters) != len(scores):
        raise ValueError(f"step {step}: {len(clusters)} cluster ids for {len(scores)} scores; "
                         "pass one cluster id per score (None scores included)")
    ok = [float(s) for s in scores if s is not None]
    failed = len(scores) - len(ok)
    if not ok:
        raise ValueError(f"step {step}: no successfully judged samples ({failed} failed)")
    n = len(ok)
    mean = sum(ok) / n
    effective, num_clusters = float(n), None
    if clusters is not None:
        design = cluster_design(ok, [c for c, s in zip(clusters, scores, strict=True)
                                     if s is not None])
        if design.num_clusters < n:
            effective, num_clusters = n / design.design_effect, design.num_clusters
    clustered = num_clusters is not None
    pass_fail = all(s in (0.0, 1.0) for s in ok)
    if pass_fail and not clustered:
        method = WILSON
        lo, hi = wilson_interval(round(sum(ok)), n, level=level)
    else:
        method = (WILSON_CLUSTERED if pass_fail else WILSON_GRADED_CLUSTERED) if clustered \
            else WILSON_GRADED
        variance = mean * (1 - mean) if pass_fail else sum((s - mean) ** 2 for s in ok) / n
        lo, hi = score_interval(mean, variance, effective, level=level)
    return StepScore(step=step, mean=mean, ci_low=lo, ci_high=hi, num_samples=n,
                     num_failed=failed, method=method, num_clusters=num_clusters)


TIE = 1e-12
"""Bounds closer than this are equal: the same scores summed in a different order differ in the
last bits."""


def rank(candidates: Sequence[tuple[StepScore, float | None]]) -> tuple[int, str]:
    """(index of the best of ``candidates``, what decided it) for (score, held-out loss or None)
    pairs: the highest lower bound of the 95% interval; among equal lower bounds the lowest loss
    when every one of them has a loss, else the earliest step, then the first listed.

    Why the lower bound, measured (tests/evals/test_selection.py measures it again): eight
    checkpoints on four true-accuracy curves (rising then flat, peaking then falling, saturated
    at 0.99, still rising), 0/1 scores drawn on 300 seeds; how often the pick is within 2
    points of the truly best checkpoint, and the pick's mean true accuracy. With every
    checkpoint scored on the same number of samples (50) the highest lower bound picks exactly
    what the highest mean picks (the Wilson bound rises with the count passed): within 2 points
    0.61-0.91 of the time, true accuracy 0.782-0.978. "The earliest checkpoint whose mean is not
    below the best one's lower bound" gives up 3-7 points of true accuracy (within 2 points
    0.09-0.31 of the time), "the earliest whose interval reaches the best mean" 0-5 points:
    the evals could see those checkpoints were worse. Where the sample counts differ (judge
    failures, a sweep's runs sized differently; 12 or 50 samples at random), the highest mean
    falls for a lucky small sample and the lower bound does not: within 2 points 0.55-0.92 of
    the time against 0.52-0.77 (0.92 against 0.61 on the saturated curve)."""
    if not candidates:
        raise ValueError("rank: no candidates")
    if len(candidates) == 1:
        return 0, "the only scored checkpoint"
    top = max(c.ci_low for c, _ in candidates)
    tied = [i for i, (c, _) in enumerate(candidates) if c.ci_low >= top - TIE]
    on = f"the 95% interval's lower bound {top:.3f}"
    if len(tied) == 1:
        runner_up = max(c.ci_low for i, (c, _) in enumerate(candidates) if i != tied[0])
        return tied[0], f"{on}, the highest (next {runner_up:.3f})"
    if all(candidates[i][1] is not None for i in tied):
        return (min(tied, key=lambda i: (candidates[i][1], candidates[i][0].step, i)),
                f"eval loss ({len(tied)} checkpoints tie on {on})")
    return (min(tied, key=lambda i: (candidates[i][0].step, i)),
            f"earliest step ({len(tied)} checkpoints tie on {on}, not all with an eval loss)")


FINAL_CANDIDATES = 3
"""Leading checkpoints judged on the whole final eval set before the choice, when mid-training
evals judged a subset. Measured (tests/evals/test_selection.py): eight checkpoints on four
true-accuracy curves, 0/1 scores on 300 seeds, every checkpoint judged on 43 samples, the
leaders on 385: the pick is within 2 points of the truly best checkpoint 0.94-1.00 of the time
with 3 leaders, 0.84-0.99 with 2, 0.95-1.00 with 4 or all 8, against 0.60-0.90 on the 43 alone
(1 leader adds nothing: it is already the pick). Each leader costs the final set's remaining
answers (342 here), so the fourth buys at most 0.01."""


def leaders(candidates: Sequence[tuple[StepScore, float | None]], k: int) -> list[int]:
    """Indices of the first ``k`` of ``candidates`` in ``rank``'s order: its pick, then its pick
    of the rest, and so on."""
    if k < 0:
        raise ValueError(f"k: must be >= 0, got {k}")
    rest = list(range(len(candidates)))
    out: list[int] = []
    while rest and len(out) < k:
        out.append(rest.pop(rank([candidates[i] for i in rest])[0]))
    return out


def rank_final(candidates: Sequence[tuple[StepScore, float | None]],
               num_judged: Sequence[int]) -> tuple[int, str]:
    """``rank`` among the candidates judged on the most samples (``num_judged``: the distinct
    samples each was judged on, judge failures included); the others are left out, so a
    checkpoint neither wins nor loses because it was judged on fewer (each count takes the first
    samples of one order: equal counts, equal samples). With every count equal this is
    ``rank``."""
    if len(candidates) != len(num_judged):
        raise ValueError(f"rank_final: {len(candidates)} candidates, {len(num_judged)} counts")
    if not candidates:
        raise ValueError("rank_final: no candidates")
    most = max(num_judged)
    kept = [i for i, n in enumerate(num_judged) if n == most]
    pick, why = rank([candidates[i] for i in kept])
    if len(kept) < len(candidates):
        why += (f"; among the {len(kept)} of {len(candidates)} checkpoints judged on the final "
                f"eval set ({most} samples), the others on fewer")
    return kept[pick], why


def select_best(by_step: Mapping[int, Sequence[float | None]],
                eval_loss: Mapping[int, float] | None = None, *,
                clusters: Mapping[int, Sequence[str]] | None = None,
                level: float = 0.95) -> StepScore:
    """The checkpoint ``rank`` picks: highest lower bound of the 95% interval; ties go to the
    lowest ``eval_loss`` (step -> the trainer's held-out loss at that step) when each has one,
    else to the earlier step. ``clusters``: step -> each score's cluster (``summarize``)."""
    if not by_step:
        raise ValueError("select_best: no scored checkpoints")
    of = clusters or {}
    summaries = [summarize(step, scores, clusters=of.get(step), level=level)
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
95% interval before training stops on a plateau. Three, so one noisy eval (12 samples on
CPU) neither stops a run nor keeps a flat one going."""


def detect_plateau(summaries: Sequence[StepScore], *,
                   patience: int = PLATEAU_PATIENCE) -> EarlyStop | None:
    """``summaries``: one per scored checkpoint (the base model, step 0, is left out: a run that
    has not yet left the base is still warming up). Stop when each of the last ``patience``
    checkpoints scores at most the upper end of the 95% interval of the best
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
               f"before them by more than its 95% interval (best at step {peak.step}: "
               f"{format_score(peak)})")


def decide_stop(by_step: Mapping[int, Sequence[float | None]], *, margin: float = 0.02,
                patience: int = 2, plateau_patience: int = PLATEAU_PATIENCE,
                clusters: Mapping[int, Sequence[str]] | None = None) -> EarlyStop | None:
    """Whether a run should stop, from its sample scores by step (step 0: the base model):
    the score fell after its peak (``detect_overfitting``), else it plateaued
    (``detect_plateau``); None keeps training. ``clusters``: step -> each score's cluster
    (``summarize``)."""
    of = clusters or {}
    summaries = [summarize(step, scores, clusters=of.get(step))
                 for step, scores in sorted(by_step.items())
                 if any(x is not None for x in scores)]
    stop = detect_overfitting([(s.step, s.mean) for s in summaries], margin=margin,
                              patience=patience)
    return stop or detect_plateau(summaries, patience=plateau_patience)
