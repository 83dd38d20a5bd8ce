"""Best checkpoint by mean score with a bootstrap interval; overfitting -> early stop."""

from __future__ import annotations

import pytest

from factory.evals import detect_overfitting, select_best, summarize
from factory.evals.selection import rank


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


def test_equal_means_go_to_the_lowest_eval_loss_when_each_has_one() -> None:
    scores = {10: [1.0, 1.0], 20: [1.0, 1.0], 30: [1.0, 1.0], 5: [0.5, 1.0]}
    assert select_best(scores, {5: 0.001, 10: 0.3, 20: 0.1, 30: 0.2}).step == 20
    assert select_best(scores, {10: 0.3, 30: 0.2}).step == 10  # step 20 has no loss
    assert select_best(scores, {}).step == 10
    a, b = summarize(40, [1.0]), summarize(10, [1.0])
    assert rank([(a, 0.1), (b, 0.1)])[0] == 1  # equal losses: the earlier step
    assert rank([(a, 0.1), (b, None)])[0] == 1
    assert rank([(a, 0.1), (b, 0.2)])[0] == 0
    with pytest.raises(ValueError, match="no candidates"):
        rank([])
    assert rank([(a, 0.1), (summarize(20, [0.5]), 0.01)]) == (0, "mean score")
    assert rank([(a, 0.1), (b, 0.2)]) == (0, "eval loss (2 checkpoints tie on the mean score)")


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


def test_plateau_stops_when_no_checkpoint_beats_the_best_by_more_than_its_interval() -> None:
    from factory.evals import decide_stop, detect_plateau

    noisy = [0.5, 0.7, 0.9, 0.6, 0.8, 0.7]          # mean 0.7, interval about +-0.1
    flat = {0: [0.1] * 6, 4: noisy, 8: [x + 0.02 for x in noisy],
            12: [x - 0.03 for x in noisy], 16: [x + 0.05 for x in noisy]}
    stop = decide_stop(flat)
    assert stop is not None and stop.rule == "plateau"
    assert (stop.peak_step, stop.last_step) == (16, 16)
    assert "steps 8, 12, 16" in stop.reason and "bootstrap interval" in stop.reason
    # One checkpoint fewer: not enough evals to call it.
    assert decide_stop({k: v for k, v in flat.items() if k != 16}) is None
    # A real gain in the window (beyond the best's interval) keeps training.
    rising = dict(flat)
    rising[12] = [min(1.0, x + 0.3) for x in noisy]
    assert decide_stop(rising) is None
    # The base model (step 0) is not a checkpoint: a run still at the base keeps going.
    summaries = [summarize(s, v) for s, v in sorted(flat.items()) if s <= 8]
    assert detect_plateau(summaries, patience=2) is None
    with pytest.raises(ValueError, match="patience"):
        detect_plateau(summaries, patience=0)


def test_overfitting_is_decided_before_the_plateau() -> None:
    from factory.evals import decide_stop

    falling = {0: [0.1, 0.1], 10: [0.7, 0.7], 20: [0.6, 0.6], 30: [0.55, 0.55],
               40: [0.5, 0.5]}
    stop = decide_stop(falling, margin=0.05)
    assert stop is not None and stop.rule == "overfitting" and stop.peak_step == 10
