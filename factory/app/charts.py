"""The comparison page's chart: scored shadow pairs grouped into time windows, and the geometry
of the inline SVG that draws agreement and mean judge score per window as two lines.

Coordinates are computed here; ``templates/compare_chart.html`` writes them as SVG.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """Scored pairs created in one time window."""

    start: datetime
    num_scored: int
    agreement: float
    mean_score: float


# Window widths tried for the chart, smallest first; the first giving at most MAX_BUCKETS wins.
WIDTHS = [(timedelta(minutes=5), "5 minutes"), (timedelta(minutes=15), "15 minutes"),
          (timedelta(hours=1), "hour"), (timedelta(hours=6), "6 hours"),
          (timedelta(days=1), "day"), (timedelta(days=7), "week")]
MAX_BUCKETS = 48


def buckets(scored: list[tuple[datetime, float, bool]]) -> tuple[list[Bucket], str]:
    """Agreement and mean score per time window of the pairs' creation times: ``scored`` holds
    (created at, score, passed) per pair; the label names the window's width."""
    if not scored:
        return [], "hour"
    first = min(t for t, _, _ in scored)
    span = max(t for t, _, _ in scored) - first
    width, label = next(((w, lbl) for w, lbl in WIDTHS if span / w < MAX_BUCKETS), WIDTHS[-1])
    epoch = datetime(2000, 1, 1, tzinfo=UTC)
    groups: dict[int, list[tuple[float, bool]]] = defaultdict(list)
    for t, score, passed in scored:
        groups[(t - epoch) // width].append((score, passed))
    out = [Bucket(start=epoch + k * width, num_scored=len(g),
                  agreement=sum(p for _, p in g) / len(g), mean_score=sum(s for s, _ in g) / len(g))
           for k, g in sorted(groups.items())]
    return out, label


WIDTH, HEIGHT = 860, 250
"""The SVG's size in pixels."""
LEFT, RIGHT, TOP, BOTTOM = 48, 20, 22, 34
"""Margins around the plot area: the percent labels at the left, the legend at the top, the
time labels at the bottom."""
GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True, kw_only=True)
class Gridline:
    """A horizontal line at ``value`` (0..1), drawn at height ``y``."""

    value: float
    y: float


@dataclass(frozen=True, kw_only=True)
class Dot:
    """One window's value on a line, at (``x``, ``y``)."""

    x: float
    y: float
    value: float
    bucket: Bucket


@dataclass(frozen=True, kw_only=True)
class Line:
    """One figure over time."""

    name: str
    """What a dot's tooltip calls the figure."""
    legend: str
    color: str
    dots: list[Dot]


@dataclass(frozen=True, kw_only=True)
class TimeLabel:
    """A window's start written under the plot at ``x``, aligned by ``anchor``."""

    x: float
    at: datetime
    anchor: str
    """SVG ``text-anchor``: ``start``, ``middle`` or ``end``."""


@dataclass(frozen=True, kw_only=True)
class Chart:
    """What the SVG draws."""

    label: str
    """The windows' width, as :func:`buckets` names it."""
    width: int
    height: int
    left: int
    right: int
    grid: list[Gridline]
    lines: list[Line]
    times: list[TimeLabel]


def chart(points: list[Bucket], label: str) -> Chart | None:
    """Agreement and mean score (both 0..1) of ``points`` (by time, oldest first) as two lines;
    None without points.

    A dot's x is its window's start time, so a window without scored pairs leaves a gap; a
    single window sits in the middle. The time axis names the first, the middle and the last
    window."""
    if not points:
        return None
    first = points[0].start
    span = (points[-1].start - first).total_seconds()

    def x(i: int) -> float:
        at = (points[i].start - first).total_seconds()
        return LEFT + (WIDTH - LEFT - RIGHT) * (at / span if span else 0.5)

    def y(v: float) -> float:
        return TOP + (HEIGHT - TOP - BOTTOM) * (1 - v)

    lines = [Line(name=name, legend=legend, color=color,
                  dots=[Dot(x=x(i), y=y(getattr(b, key)), value=getattr(b, key), bucket=b)
                        for i, b in enumerate(points)])
             for key, name, legend, color in (
                 ("agreement", "agreement", "agreement", "#2e62d9"),
                 ("mean_score", "mean score", "mean judge score", "#d97a2e"))]
    last = len(points) - 1
    times = [TimeLabel(x=x(i), at=points[i].start, anchor=anchor)
             for i, anchor in sorted({0: "start", last // 2: "middle", last: "end"}.items())]
    return Chart(label=label, width=WIDTH, height=HEIGHT, left=LEFT, right=RIGHT,
                 grid=[Gridline(value=v, y=y(v)) for v in GRID], lines=lines, times=times)
