"""The ladder: in order, priority queue, EASY backfill, and why each job waits."""

from __future__ import annotations

import pytest

from factory.control.scheduler import Rung, WorkItem, plan, priority_of


def _item(job_id: str, *, kind: str = "train", gpus: int = 1, est: float | None = None,
          t: float = 0.0, roll: bool = True) -> WorkItem:
    return WorkItem(job_id=job_id, kind=kind, priority=priority_of(kind), num_gpus=gpus,
                    est_runtime_s=est, submitted_at=t, can_roll_over=roll)


def test_first_rung_with_capacity_wins_and_says_why() -> None:
    rungs = [Rung(name="local", free_gpus=0, total_gpus=1),
             Rung(name="sandbox", free_gpus=2, total_gpus=2, max_runtime_s=60)]
    [d] = plan([_item("a", t=1.0)], rungs, now=3.0)
    assert d.provider == "sandbox" and "local full" in d.reason and d.wait_s == 2.0


def test_training_goes_before_evals_and_priorities_are_configurable() -> None:
    rungs = [Rung(name="local", free_gpus=1, total_gpus=1)]
    out = plan([_item("ev", kind="eval", t=0.0), _item("tr", t=5.0)], rungs, now=6.0)
    assert [(d.job_id, d.provider) for d in out] == [("tr", "local"), ("ev", None)]
    with pytest.raises(ValueError, match="no priority"):
        priority_of("other")


def test_backfill_only_when_it_does_not_delay_the_head() -> None:
    # The head needs 2 GPUs; one is free now, the other frees at t=100.
    rungs = [Rung(name="local", free_gpus=1, total_gpus=2, busy_until=(100.0,))]
    queue = [_item("head", gpus=2, t=0), _item("long", kind="eval", est=500, t=1),
             _item("short", kind="eval", est=50, t=2)]
    out = {d.job_id: d for d in plan(queue, rungs, now=10.0)}
    assert out["head"].provider is None and "full" in out["head"].reason
    assert out["short"].provider == "local" and out["short"].backfilled
    assert out["long"].provider is None and "delay head" in out["long"].reason
    off = {d.job_id: d for d in plan(queue, rungs, now=10.0, backfill=False)}
    assert off["short"].provider is None


def test_a_job_that_cannot_roll_over_must_fit_the_runtime_limit() -> None:
    rungs = [Rung(name="sandbox", free_gpus=1, total_gpus=1, max_runtime_s=60)]
    [d] = plan([_item("ev", kind="eval", est=600, roll=False)], rungs, now=0.0)
    assert d.provider is None and "no rung" in d.reason
