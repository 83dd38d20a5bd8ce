"""Best checkpoint by mean score with a bootstrap interval; overfitting -> early stop."""

from __future__ import annotations

import pytest

from factory.evals import detect_overfitting, select_best, summarize


def test_summary_interval_contains_mean_and_ignores_failed() -> None:
    s = summarize(10, [0.2, 0.4, 0.6, 0.8, None])
    assert s.mean == pytest.approx(0.5) and s.num_samples == 4 and s.num_failed == 1
    assert s.ci_low < s.mean < s.ci_high
    assert summarize(10, [0.2, 0.4, 0.6, 0.8]) == summarize(10, [0.2, 0.4, 0.6, 0.8])
    with pytest.raises(ValueError, match="no successfully judged"):
        summarize(3, [None, None])


def test_best_is_highest_mean_ties_to_earlier_step() -> None:
    best = select_best({0: [0.1, 0.2], 20: [0.7, 0.9], 40: [0.9, 0.7], 60: [0.5, 0.5]})
    assert best.step == 20 and best.mean == pytest.approx(0.8)
    assert select_best({30: [0.3], 10: [0.3]}).step == 10


def test_overfitting() -> None:
    rising = [(0, 0.1), (10, 0.5), (20, 0.7), (30, 0.71)]
    assert detect_overfitting(rising) is None
    one_dip = [(0, 0.1), (10, 0.7), (20, 0.6)]
    assert detect_overfitting(one_dip, margin=0.05, patience=2) is None
    falling = [(0, 0.1), (10, 0.7), (20, 0.6), (30, 0.55)]
    stop = detect_overfitting(falling, margin=0.05, patience=2)
    assert stop is not None and stop.peak_step == 10 and stop.last_step == 30
    assert "fell from 0.700" in stop.reason
    within_margin = [(0, 0.1), (10, 0.7), (20, 0.69), (30, 0.68)]
    assert detect_overfitting(within_margin, margin=0.05, patience=2) is None
