"""The loop bench's trainer pace (``bench/loop.py``'s ``step_pace``, issue 46 item 1): the first
window after warm-up against the last, and peak RSS, from progress events of known timings."""

from __future__ import annotations

from typing import Any

import pytest

from bench import loop


def _events(secs: list[float], rss: list[float]) -> list[dict[str, Any]]:
    t, out = 1000.0, [{"type": "started", "step": 0, "time": 999.0}]
    for step, (s, r) in enumerate(zip(secs, rss, strict=True), start=1):
        t += s
        out.append({"type": "progress", "step": step, "time": t,
                    "memory": {"peak_rss_bytes": int(r * 1e9)}})
    return out


def test_pace_compares_the_first_window_after_warm_up_with_the_last() -> None:
    # 100 steps: 6 slow warm-up steps, then 1.0 s a step creeping to 1.5 s over the last 30
    secs = [5.0] * 6 + [1.0] * 64 + [1.5] * 30
    rss = [1.0] * 10 + [2.0] * 60 + [2.5] * 30
    pace = loop.step_pace(_events(secs, rss))
    assert pace is not None
    assert pace["first_window"] == [7, 36] and pace["steps"] == 100
    assert pace["first_s"] == pytest.approx(1.0) and pace["last_s"] == pytest.approx(1.5)
    assert pace["pace_ratio"] == pytest.approx(1.5)
    assert pace["rss_first_window_gb"] == pytest.approx(2.0)
    assert pace["rss_ratio"] == pytest.approx(1.25)


def test_a_resumed_step_counts_once_and_a_short_run_has_no_pace() -> None:
    events = _events([1.0] * 80, [1.0] * 80)
    # a second segment repeats steps 40-41 after a restart, later in time: the last report wins
    redo = [dict(e, time=e["time"] + 0.5) for e in events if e.get("step") in (40, 41)]
    pace = loop.step_pace(events + redo)
    assert pace is not None and pace["steps"] == 80
    assert loop.step_pace(_events([1.0] * 60, [1.0] * 60)) is None


def test_the_held_out_loss_pass_of_a_step_is_not_its_training_time() -> None:
    # The last step also computes the held-out loss (15 s, reported in its event): without
    # leaving it out, the last window's mean would read 1.5 s for steps of 1.0 s.
    secs = [5.0] * 6 + [1.0] * 93 + [16.0]
    events = _events(secs, [1.0] * 100)
    events[-1]["eval_loss_s"] = 15.0
    pace = loop.step_pace(events)
    assert pace is not None
    assert pace["last_s"] == pytest.approx(1.0) and pace["pace_ratio"] == pytest.approx(1.0)
    del events[-1]["eval_loss_s"]
    assert loop.step_pace(events)["pace_ratio"] == pytest.approx(1.5)  # type: ignore[index]
