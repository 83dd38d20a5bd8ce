"""Where a job runs: walk the provider ladder in order, assign at once where a rung has capacity,
otherwise queue by priority, and backfill short jobs that do not delay the blocked head job.

``plan`` is a pure function over a snapshot of the queue and of each rung's free GPUs, so it is
cheap to call every tick and easy to test; every decision (assigned or waiting, and why) is
returned so the caller records it in ``scheduler_assignments``.

Backfill is EASY backfill: the highest-priority job that cannot start reserves the earliest time
its rung frees enough GPUs; a lower-priority job may start now on a free slot only if it runs on
another rung or is estimated to end before that reservation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_PRIORITIES: dict[str, int] = {"train": 0, "eval": 10}
"""Lower runs first: training before evals by default (overridable in ``ControlConfig``)."""


@dataclass(frozen=True, kw_only=True)
class WorkItem:
    """One job waiting for a provider."""

    job_id: str
    """Run id (or segment id) being placed."""
    kind: str = "train"
    """``train`` or ``eval``; picks the default priority."""
    priority: int = 0
    """Lower runs first."""
    num_gpus: int = 1
    """GPU slots it needs on one rung."""
    est_runtime_s: float | None = None
    """Estimated runtime (None: unknown, never backfilled)."""
    submitted_at: float
    """Unix time it entered the queue (ties and waits)."""
    can_roll_over: bool = True
    """Training rolls over to a new sandbox; a job that cannot must fit a rung's max runtime."""


@dataclass(frozen=True, kw_only=True)
class Rung:
    """A provider's state at planning time."""

    name: str
    """Provider name."""
    free_gpus: int
    """GPU slots free now."""
    total_gpus: int
    """GPU slots in all (a job needing more never fits)."""
    max_runtime_s: float | None = None
    """Hard wall-clock limit of one launch."""
    busy_until: tuple[float, ...] = field(default_factory=tuple)
    """Expected end times of its running jobs, one per busy GPU slot (for reservations)."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One planning outcome for one job."""

    job_id: str
    kind: str
    priority: int
    provider: str | None
    """Rung it was assigned to; None while it waits."""
    backfilled: bool
    submitted_at: float
    decided_at: float
    reason: str

    @property
    def wait_s(self) -> float:
        return max(0.0, self.decided_at - self.submitted_at)


def priority_of(kind: str, priorities: Mapping[str, int] | None = None) -> int:
    table = DEFAULT_PRIORITIES if priorities is None else priorities
    if kind not in table:
        raise ValueError(f"kind: no priority configured for {kind!r} (have {sorted(table)})")
    return table[kind]


def _fits(item: WorkItem, rung: Rung) -> bool:
    if item.num_gpus > rung.total_gpus:
        return False
    if item.can_roll_over or rung.max_runtime_s is None or item.est_runtime_s is None:
        return True
    return item.est_runtime_s <= rung.max_runtime_s


def _free_at(rung: Rung, num_gpus: int, now: float) -> float:
    """Earliest time ``num_gpus`` slots are free on ``rung`` (inf if unknown)."""
    if rung.free_gpus >= num_gpus:
        return now
    ends = sorted(rung.busy_until)
    needed = num_gpus - rung.free_gpus
    if len(ends) < needed:
        return math.inf
    return max(now, ends[needed - 1])


def plan(queue: Sequence[WorkItem], rungs: Sequence[Rung], *, now: float,
         backfill: bool = True) -> list[Decision]:
    """Assign what can start now, in priority order; say why each other job waits."""
    free = {r.name: r.free_gpus for r in rungs}
    order = sorted(queue, key=lambda w: (w.priority, w.submitted_at, w.job_id))
    head: WorkItem | None = None
    reserved_rung: str | None = None
    reserved_at = math.inf
    out: list[Decision] = []

    def decide(item: WorkItem, provider: str | None, reason: str, filled: bool = False) -> None:
        out.append(Decision(job_id=item.job_id, kind=item.kind, priority=item.priority,
                            provider=provider, backfilled=filled, submitted_at=item.submitted_at,
                            decided_at=now, reason=reason))

    for item in order:
        eligible = [r for r in rungs if _fits(item, r)]
        if not eligible:
            decide(item, None, f"no rung can run {item.num_gpus} GPU(s) for "
                               f"{item.est_runtime_s} s")
            continue
        rung = next((r for r in eligible if free[r.name] >= item.num_gpus), None)
        if head is None:
            if rung is not None:
                free[rung.name] -= item.num_gpus
                skipped = [r.name for r in eligible[:eligible.index(rung)]]
                why = f"rung {rung.name}" + (f" ({', '.join(skipped)} full)" if skipped else "")
                decide(item, rung.name, why)
                continue
            head = item
            for r in eligible:
                t = _free_at(r, item.num_gpus, now)
                if t < reserved_at:
                    reserved_at, reserved_rung = t, r.name
            decide(item, None, "every rung is full: " + ", ".join(
                f"{r.name} {free[r.name]}/{r.total_gpus} free" for r in eligible))
            continue
        if rung is None:
            decide(item, None, f"queued behind {head.job_id}; no free slot")
        elif not backfill:
            decide(item, None, f"queued behind {head.job_id} (backfill off)")
        elif rung.name != reserved_rung or (
                item.est_runtime_s is not None and now + item.est_runtime_s <= reserved_at):
            free[rung.name] -= item.num_gpus
            decide(item, rung.name, f"backfilled on {rung.name} without delaying {head.job_id}",
                   filled=True)
        else:
            decide(item, None, f"would delay {head.job_id} (reserved on {reserved_rung})")
    return out
