"""Following one training run from its submit to its end, for the step that asked for it
(the ``training_run`` asset).

``follow_run`` submits the job to the control plane and waits for the run to end. While no
daemon evaluates the rollover and recovery sensors it ticks the control loop itself (two tickers
of one plane would do every read and commit twice), else it watches the run's row; whether a
daemon ticks is asked again every ``DRIVER_CHECK_S``. After ``timeout_s`` it stops the run and
raises ``RunTimedOut``. A run the evals stopped early (``stopped``) is waited on until the
trainer's last checkpoint, written as it stopped, is a row of ``checkpoints``
(``await_stop_checkpoints``): the best checkpoint is selected right after, and must not miss it.

What it returns (``Followed``) is what the step shows: the run's segments (provider, sandbox id,
first and last step, why each ended), one loss curve across them (a step redone after a resume
keeps the value of its last run, bitwise the same in deterministic mode), what tokenizing kept
and dropped by reason, the trainer's shared-prefix summary and the precision it computed in.

Nothing here knows the orchestrator: the caller passes how to tell whether a daemon ticks
(``daemon_ticks``), what to do once the run is submitted (``on_submitted``) and where to log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from factory.control.plane import (
    RUN_ACTIVE,
    ControlPlane,
    Segment,
    TrainingRun,
    loss_curve,
    reported,
)
from factory.errors import FactoryError
from factory.lake import Lineage
from factory.trainer.config import TrainerJob
from factory.trainer.data import DROP_REASONS, DataStats
from factory.trainer.webhooks import read_events

WATCH_S = 2.0
"""Seconds between looks at the run while the sensors drive it: one catalog lookup of
``training_runs``' snapshot (about 1.5 ms CPU), the table re-read only when it changed, so the
run's end shows here within 2 s of the plane recording it."""
PROGRESS_EVERY_S = 30.0
"""Seconds between calls of ``follow_run``'s ``on_progress`` with the run's events."""
STOP_CHECKPOINT_S = 120.0
"""How long a stopped run's step waits for the trainer's last checkpoint to reach the lake (the
trainer's SIGTERM grace, then a sensor tick)."""
DRIVER_CHECK_S = 30.0
"""Seconds between checks of whether the daemon's sensors tick the plane (about 10 ms each)."""
ENDED_WELL = ("finished", "stopped")
"""Run statuses that end the step as it should: ``stopped`` is the evals' early stop (the score
fell after its peak), and its best checkpoint is selected like a finished run's."""


class Log(Protocol):
    """Where ``follow_run`` says what it does (a ``logging.Logger``, Dagster's ``context.log``)."""

    def info(self, msg: str) -> Any: ...

    def warning(self, msg: str) -> Any: ...


class RunTimedOut(FactoryError):
    """The run did not end within the follower's ``timeout_s``; it has been stopped."""


@dataclass(frozen=True, kw_only=True)
class Followed:
    """A run that ended, as its follower saw it."""

    run: TrainingRun
    """The run's last row."""
    segments: list[Segment]
    """Its segments, in order."""
    events: list[dict[str, Any]]
    """Its ``training_events`` rows, in segment and sequence order."""
    missing_checkpoints: list[str]
    """Checkpoint event ids of a stopped run's trainers not in ``checkpoints`` after
    ``STOP_CHECKPOINT_S`` (empty for a run that was not stopped)."""

    @property
    def failure(self) -> str | None:
        """Why the run counts as failed (``training run ID STATUS: REASON``); None when it
        ended well (``ENDED_WELL``)."""
        if self.run.status in ENDED_WELL:
            return None
        return f"training run {self.run.run_id} {self.run.status}: {self.run.reason}"

    def segments_table(self) -> str:
        """The segments as a Markdown table: provider, sandbox id, first and last step, why
        each ended."""
        rows = "".join(f"\n| {s.segment_id} | {s.provider} | {s.handle.handle_id} | "
                       f"{s.first_step} | {s.last_step} | {s.end_reason} |"
                       for s in self.segments)
        return ("| segment | provider | sandbox | first step | last step | ended |\n"
                "|---|---|---|---|---|---|" + rows)

    def metadata(self, data: DataStats) -> dict[str, Any]:
        """What the step shows besides ``segments_table``, as plain values: the run's status
        and reason, counts, the loss curve (``{"step": [...], "loss": [...]}``) and its last
        value, what tokenizing kept and dropped of ``data`` (the pre-launch check's counts of
        the primary source, by the trainer's rules: ``num_dropped_<reason>`` for every one of
        ``DROP_REASONS``), the trainer's ``shared_prefix`` summary and the precision it ran."""
        run = self.run
        curve = loss_curve(self.events)
        out: dict[str, Any] = {
            "run_id": run.run_id, "status": run.status, "reason": run.reason,
            "num_segments": len(self.segments), "num_recoveries": run.num_recoveries,
            "learning_rate": run.learning_rate,
            "loss_curve": {"step": [s for s, _ in curve], "loss": [v for _, v in curve]},
        }
        if curve:
            out["final_loss"] = curve[-1][1]
        out.update(data_metadata(vars(data)))
        # The trainer's shared_prefix summary: micro-batches of its first window (an epoch when
        # the data fits one) that computed a shared prefix once, and the tokens computed
        # against the samples' own.
        shared = reported(self.events, "shared_prefix")
        if shared:
            out["shared_prefix"] = shared
        # What the trainer computed in: the plan's precision, or fp32 on a CPU that would
        # emulate bf16 (factory.trainer.precision), with why.
        ran = reported(self.events, "precision")
        if ran:
            out["precision"] = str(ran["ran"]) + (f" ({ran['reason']})" if ran["reason"] else "")
        return out


def data_metadata(stats: dict[str, Any]) -> dict[str, Any]:
    """``factory.trainer.data.DataStats`` (as the trainer reports it) as flat counts, one per
    drop reason."""
    by_reason = stats.get("num_dropped_by_reason") or {}
    out: dict[str, Any] = {k: stats[k] for k in ("num_samples", "num_examples", "num_dropped",
                                                  "max_sample_tokens") if k in stats}
    out.update({f"num_dropped_{r}": int(by_reason.get(r, 0)) for r in DROP_REASONS})
    return out


def _no_op() -> None:
    return None


def follow_run(plane: ControlPlane, job: TrainerJob, *, experiment: str = "",
               lineage: Lineage | None = None, daemon_ticks: Callable[[], bool],
               poll_s: float = 5.0, timeout_s: float | None = None, drive: bool | None = None,
               on_submitted: Callable[[], None] = _no_op,
               on_progress: Callable[[list[dict[str, Any]]], object] | None = None,
               log: Log = logging.getLogger("factory.control"),
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> Followed:
    """Submit ``job`` and follow its run to the end.

    ``lineage``: who submits and what it read (``ControlPlane.submit``). ``daemon_ticks``: whether
    a daemon evaluates the rollover and recovery sensors now. ``drive``: tick the control loop
    while waiting; None: only while ``daemon_ticks()`` says no, asked every
    ``DRIVER_CHECK_S``. ``poll_s``: seconds between ticks while driving (between looks at the
    run: ``min(poll_s, WATCH_S)`` while watching). ``timeout_s``: stop the run and raise
    ``RunTimedOut`` after this long; None waits for the end. ``on_submitted`` runs once the run
    is queued (to tag the caller's own run with it, say). ``on_progress`` gets the run's
    events every ``PROGRESS_EVERY_S`` while it runs (the planner's pace correction, say).
    ``clock`` and ``sleep`` pace the wait.
    """
    plane.submit(job, experiment=experiment, lineage=lineage)
    on_submitted()
    run_id = job.run_id
    start = clock()
    driving, decided = bool(drive), None
    seen: int | None = None  # the training_runs snapshot the run was last read at
    progressed = start
    while True:
        if drive is None and (decided is None or clock() - decided >= DRIVER_CHECK_S):
            now_driving = not daemon_ticks()
            if decided is None or now_driving != driving:
                log.info(f"training run {run_id}: " + (
                    "this step ticks the control loop" if now_driving
                    else "the daemon's rollover and recovery sensors tick the control loop"))
            driving, decided = now_driving, clock()
        if driving:
            plane.tick()
        snapshot = plane.lake.snapshot_id("training_runs")
        if snapshot is None or snapshot != seen:
            seen = snapshot
            run = plane.runs()[run_id]
            if run.status not in RUN_ACTIVE:
                break
        if on_progress is not None and clock() - progressed >= PROGRESS_EVERY_S:
            progressed = clock()
            on_progress(plane.events(run_id))
        if timeout_s is not None and clock() - start > timeout_s:
            plane.stop_run(run_id, reason=f"timeout after {timeout_s} s")
            raise RunTimedOut(f"training run {run_id} did not end in {timeout_s} s")
        sleep(poll_s if driving else min(poll_s, WATCH_S))
    missing: list[str] = []
    if run.status == "stopped":
        # An early stop marks the run at once, and the trainer then writes a checkpoint of
        # where it stopped: that checkpoint must be in the lake before the step ends, or the
        # best checkpoint is selected before its evaluation is even requested.
        missing = await_stop_checkpoints(plane, run_id, drive=driving, clock=clock, sleep=sleep)
        if missing:
            log.warning(f"training run {run_id}: {len(missing)} checkpoint event(s) of the "
                        f"stopped trainer not in the lake after {STOP_CHECKPOINT_S:.0f} s")
    return Followed(run=run, segments=plane.segments(run_id), events=plane.events(run_id),
                    missing_checkpoints=missing)


def await_stop_checkpoints(plane: ControlPlane, run_id: str, *, drive: bool,
                           wait_s: float = STOP_CHECKPOINT_S,
                           clock: Callable[[], float] = time.monotonic,
                           sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Wait (up to ``wait_s``) until the run's stopped trainers have exited and every
    checkpoint event in their events files is a row of ``checkpoints``; sync the events here
    when no sensor does (``drive``). Returns the event ids still missing."""
    deadline = clock() + wait_s
    segs = plane.segments(run_id)
    lake = plane.lake
    while True:
        running = [s for s in segs if s.provider in plane.by_name
                   and not plane.by_name[s.provider].status(s.handle).done]
        wanted = {ev["event_id"] for s in segs if s.handle.info.get("events_file")
                  for ev in read_events(s.handle.info["events_file"])
                  if ev.get("type") == "checkpoint" and ev.get("event_id")}
        if not running:
            if drive:
                plane.sync_events()
            have = set()
            if wanted and lake.exists("checkpoints"):
                have = {r["event_id"] for r in lake.sql(
                    "SELECT event_id FROM checkpoints WHERE run_id = ?", [run_id]).to_pylist()}
            missing = sorted(wanted - have)
            if not missing:
                return []
        else:
            missing = sorted(wanted)
        if clock() > deadline:
            return missing
        sleep(WATCH_S)
