"""The planner's eval sample count: enough that the 95% interval ``summarize`` gives the
selected checkpoint's score reaches at most ``EVAL_HALF_WIDTH`` to each side, even with 0/1
scores at an even split."""

from __future__ import annotations

from factory.evals.selection import summarize
from factory.planner.plan import EVAL_HALF_WIDTH, eval_samples_needed, interval_half_width


def _scores(n: int, accuracy: float) -> list[float]:
    right = round(accuracy * n)
    return [1.0] * right + [0.0] * (n - right)


def test_the_planned_count_keeps_the_interval_within_five_points() -> None:
    n = eval_samples_needed()
    assert n == 385 and interval_half_width(n) <= EVAL_HALF_WIDTH == 0.05
    for accuracy in (0.5, 0.8, 0.95, 1.0):
        s = summarize(1, _scores(n, accuracy))
        assert s.ci_high - s.mean <= EVAL_HALF_WIDTH and s.mean - s.ci_low <= EVAL_HALF_WIDTH
    # One sample fewer than the bound asks would not be enough at the widest spread.
    assert interval_half_width(n - 1) > EVAL_HALF_WIDTH
    # 12 samples (what the checkpoint that scored 0.97 was judged on): up to +-0.28; Wilson's
    # interval of 6 of 12 is [0.254, 0.746].
    assert round(interval_half_width(12), 2) == 0.28
    few = summarize(1, _scores(12, 0.5))
    assert (round(few.ci_low, 3), round(few.ci_high, 3)) == (0.254, 0.746)
