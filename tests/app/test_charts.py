"""The comparison page's chart (factory.app.charts): scored pairs grouped into time windows,
and where the SVG puts each window's agreement and mean score."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from factory.app.charts import BOTTOM, HEIGHT, LEFT, RIGHT, TOP, WIDTH, Bucket, buckets, chart

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
PLOT_WIDTH = WIDTH - LEFT - RIGHT


def test_buckets_pick_the_narrowest_window_giving_at_most_48() -> None:
    assert buckets([]) == ([], "hour")
    # 150 minutes / 5 = 30 windows; a day / 15 minutes = 96 > 48, / 1 hour = 24.
    assert buckets([(T0, 1.0, True), (T0 + timedelta(minutes=150), 0.0, False)])[1] == "5 minutes"
    assert buckets([(T0, 1.0, True), (T0 + timedelta(days=1), 0.0, False)])[1] == "hour"
    # Ten years exceed 48 weeks: the widest window still serves.
    assert buckets([(T0, 1.0, True), (T0 + timedelta(days=3650), 0.0, False)])[1] == "week"


def test_a_window_holds_its_pairs_agreement_and_mean_score() -> None:
    scored = [(T0, 1.0, True), (T0 + timedelta(minutes=1), 0.5, False),
              (T0 + timedelta(minutes=4), 0.0, True), (T0 + timedelta(minutes=20), 0.2, False)]
    points, label = buckets(scored)
    assert label == "5 minutes"
    assert [(b.start, b.num_scored) for b in points] == [(T0, 3), (T0 + timedelta(minutes=20), 1)]
    assert points[0].agreement == pytest.approx(2 / 3)
    assert points[0].mean_score == pytest.approx(0.5)
    assert (points[1].agreement, points[1].mean_score) == (0.0, 0.2)


def _bucket(minutes: int, agreement: float, mean_score: float) -> Bucket:
    return Bucket(start=T0 + timedelta(minutes=minutes), num_scored=2, agreement=agreement,
                  mean_score=mean_score)


def test_no_points_no_chart() -> None:
    assert chart([], "hour") is None


def test_dots_sit_at_their_time_and_value() -> None:
    # Windows at 0, 10 and 40 minutes: the empty windows between leave a gap, so the middle
    # dot sits a quarter of the way, not half.
    points = [_bucket(0, 1.0, 0.5), _bucket(10, 0.0, 0.25), _bucket(40, 0.5, 1.0)]
    drawn = chart(points, "5 minutes")
    assert drawn is not None and drawn.label == "5 minutes"
    agreement, mean_score = drawn.lines
    assert (agreement.name, mean_score.name) == ("agreement", "mean score")
    assert [d.x for d in agreement.dots] == pytest.approx(
        [LEFT, LEFT + PLOT_WIDTH / 4, WIDTH - RIGHT])
    assert [d.x for d in mean_score.dots] == [d.x for d in agreement.dots]
    # 1.0 at the top of the plot, 0 at its bottom.
    assert [d.y for d in agreement.dots] == pytest.approx(
        [TOP, HEIGHT - BOTTOM, (TOP + HEIGHT - BOTTOM) / 2])
    assert [d.value for d in mean_score.dots] == [0.5, 0.25, 1.0]
    assert [d.bucket for d in mean_score.dots] == points
    assert [(g.value, g.y) for g in drawn.grid][::4] == [(0.0, HEIGHT - BOTTOM), (1.0, TOP)]


def test_the_time_axis_names_the_first_middle_and_last_window() -> None:
    points = [_bucket(5 * i, 1.0, 1.0) for i in range(5)]
    drawn = chart(points, "5 minutes")
    assert drawn is not None
    assert [(t.at, t.anchor) for t in drawn.times] == [
        (points[0].start, "start"), (points[2].start, "middle"), (points[4].start, "end")]
    assert [t.x for t in drawn.times] == pytest.approx([LEFT, LEFT + PLOT_WIDTH / 2,
                                                        WIDTH - RIGHT])


def test_a_single_window_sits_in_the_middle() -> None:
    drawn = chart([_bucket(0, 0.5, 0.5)], "hour")
    assert drawn is not None
    assert [d.x for line in drawn.lines for d in line.dots] == [LEFT + PLOT_WIDTH / 2] * 2
    assert [t.x for t in drawn.times] == [LEFT + PLOT_WIDTH / 2]
