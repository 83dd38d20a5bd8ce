"""The planner's eval sample count: enough that the bootstrap intervals ``summarize`` computes
tell apart two checkpoints ``EVAL_GAP`` apart, even with 0/1 scores at an even split."""

from __future__ import annotations

from factory.evals.selection import summarize
from factory.planner.plan import EVAL_GAP, eval_samples_needed, resolvable_gap


def _scores(n: int, accuracy: float) -> list[float]:
    right = round(accuracy * n)
    return [1.0] * right + [0.0] * (n - right)


def test_the_planned_count_separates_checkpoints_the_gap_apart() -> None:
    n = eval_samples_needed()
    assert n == 475 and resolvable_gap(n) <= EVAL_GAP
    lo, hi = summarize(1, _scores(n, 0.45)), summarize(2, _scores(n, 0.45 + EVAL_GAP))
    assert lo.ci_high < hi.ci_low
    # 12 samples (what the checkpoint that scored 0.97 was judged on) resolve only ~0.63
    assert round(resolvable_gap(12), 2) == 0.63
    few_lo, few_hi = summarize(1, _scores(12, 0.45)), summarize(2, _scores(12, 0.55))
    assert few_lo.ci_high >= few_hi.ci_low
