"""The control plane: runs and their segments, kept in the lake, moved forward one tick at a time.

Every function here is idempotent over the lake's state, so the sensors (which call them) can
re-evaluate a tick, or two processes can tick at once, without launching anything twice: a
continuation or a recovery is recorded as a new segment of the run before its handle is used
again, and decisions look at the newest segment only.

A tick: ``sync_events`` (copy new lines of local events files into ``training_events``; remote
trainers reach it through the webhook receiver), ``observe`` (segment state from events and the
provider's status), ``dispatch`` (queued runs onto the ladder), ``rollover`` (a sandbox near its
deadline gets a continuation from the latest verified checkpoint, unless at its own pace it
finishes the run before the deadline; the old one is stopped once the new one reports
``started``), ``recover`` (failed, NaN or silent segments are resumed from the
last good checkpoint with bounded retries, backoff and an optional learning-rate backoff),
``early_stop`` (runs the evals flagged in ``early_stops`` are stopped after a checkpoint).

Only what can heal is retried: a segment whose trainer reported a data or configuration error
(its ``failed`` event says ``data_error``, or it exited ``DATA_ERROR`` 65 or ``INVALID_JOB`` 2)
ends ``data_error`` or ``invalid_job``, and its run fails at once with the trainer's message as
the reason. The same job would fail the same way on every attempt.

Lineage: the commit that submits a run records what the submitter read (the plan and dataset
snapshots, from the ``training_run`` asset) and names the run in its snapshot summary
(``RUN_PROPERTY``). Every later commit of that run's events and checkpoints reads that submit
snapshot, so ``factory lineage`` walks from a checkpoint back to the run, its plan and its data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import fsspec.core

from factory.control import scheduler
from factory.control.base import Handle, Provider
from factory.lake import RUN_ID, Lake, Lineage
from factory.process import is_alive
from factory.trainer import checkpoint as ckpt
from factory.trainer.config import ExitCode, TrainerJob
from factory.trainer.pids import owner_alive
from factory.trainer.webhooks import read_events

log = logging.getLogger("factory.control")
TERMINAL_EVENTS = ("finished", "failed", "nan", "preempted")
RUN_ACTIVE = ("queued", "running")
# End reasons that are our own doing or the sandbox's normal end, not faults.
NOT_A_FAULT = ("finished", "rollover", "stopped", "superseded")
NOT_RETRIED = {ExitCode.DATA_ERROR: "data_error", ExitCode.INVALID_JOB: "invalid_job",
               ExitCode.OWNER_GONE: "owner_gone"}
"""End reasons of segments that no retry can heal, by the trainer's exit code."""
FINISH_SLACK = 1.5
"""A segment near its sandbox's deadline is left to finish the run on its own (no continuation)
when its remaining steps, at its own pace so far, take at most 1/1.5 of the time to the deadline:
its pace may drop by a third. Misjudged, the deadline preempts it and recovery resumes it from its
last checkpoint; a continuation it did not need would instead race it to the last step."""
RUN_PROPERTY = "factory.training_run"
"""Snapshot-summary key naming the run a ``training_runs`` submit commit queued."""


@dataclass
class RunLineage(Lineage):
    """The lineage of a run's submit commit: the submitter's reads, plus the run's id in the
    snapshot summary so the commit can be found again (``run_origin``)."""

    training_run: str = ""

    def snapshot_properties(self) -> dict[str, str]:
        return {**super().snapshot_properties(), RUN_PROPERTY: self.training_run}


def run_origin(lake: Lake, run_id: str) -> tuple[int, dict[str, str]] | None:
    """The ``training_runs`` snapshot that submitted ``run_id`` (the newest submit, if it was
    submitted again) and its summary properties; None for a run submitted before lineage."""
    if not run_id or not lake.exists("training_runs"):
        return None
    for snap in reversed(lake.table("training_runs").metadata.snapshots):
        props = dict(snap.summary.additional_properties) if snap.summary else {}
        if props.get(RUN_PROPERTY) == run_id:
            return snap.snapshot_id, props
    return None


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """Policy of the control loop."""

    rollover_margin_s: float = 3600.0
    """Launch a continuation when a sandbox's deadline is this close."""
    heartbeat_timeout_s: float = 900.0
    """A running segment silent this long is stopped and recovered."""
    max_recoveries: int = 3
    """Recoveries (failures, NaNs, lost heartbeats) before the run is marked failed."""
    backoff_s: float = 30.0
    """Wait before the first recovery; multiplied by ``backoff_factor`` for each next one."""
    backoff_factor: float = 2.0
    """Growth of the recovery backoff."""
    max_backoff_s: float = 1800.0
    """Cap on the recovery backoff."""
    nan_lr_backoff: float | None = 0.5
    """Multiply the learning rate by this when resuming after a NaN (None: keep it)."""
    priorities: dict[str, int] = field(default_factory=lambda: dict(scheduler.DEFAULT_PRIORITIES))
    """Queue priority per job kind (lower first)."""
    backfill: bool = True
    """Let short jobs use free slots that do not delay the blocked head job."""
    webhook_url: str | None = None
    """The gateway's ``/v1/trainer/events`` URL given to trainers (None: events files only)."""
    webhook_key_id: str | None = None
    """Key id the trainers sign with."""
    webhook_secret_env: str | None = None
    """Environment variable holding that key's secret, in the trainer's environment."""

    def validate(self) -> None:
        for name in ("rollover_margin_s", "heartbeat_timeout_s", "backoff_s", "max_backoff_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_recoveries < 0:
            raise ValueError(f"max_recoveries: must be >= 0, got {self.max_recoveries}")
        if self.nan_lr_backoff is not None and not 0 < self.nan_lr_backoff <= 1:
            raise ValueError(f"nan_lr_backoff: must be in (0, 1], got {self.nan_lr_backoff}")


@dataclass(frozen=True, kw_only=True)
class TrainingRun:
    """The latest row of a training run (lake ``training_runs``): one trainer job to its end,
    across its segments."""

    run_id: str
    experiment: str
    kind: str
    priority: int
    status: str
    job: TrainerJob
    num_recoveries: int
    learning_rate: float
    reason: str
    submitted_at: float
    not_before: float | None = None


@dataclass(frozen=True, kw_only=True)
class Segment:
    """The latest row of a segment."""

    segment_id: str
    run_id: str
    seq: int
    provider: str
    handle: Handle
    status: str  # launched | running | rolling | ended
    launched_at: float
    deadline: float | None
    resume_from: str | None
    resume_step: int
    first_step: int | None = None
    last_step: int | None = None
    end_reason: str | None = None
    ended_at: float | None = None
    learning_rate: float | None = None

    @property
    def live(self) -> bool:
        return self.status != "ended"


def _dt(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=UTC)


def _t(d: Any) -> float | None:
    return None if d is None else d.timestamp()


def _latest(rows: list[dict[str, Any]], key: str,
            stale: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None
            ) -> dict[str, dict[str, Any]]:
    """The newest row (by ``updated_at``) of each ``key``; a row for which ``stale(the row it
    would replace, it)`` holds is skipped."""
    out: dict[str, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: r["updated_at"]):
        prev = out.get(row[key])
        if stale is not None and prev is not None and stale(prev, row):
            continue
        out[row[key]] = row
    return out


def _stale_run(prev: dict[str, Any], row: dict[str, Any]) -> bool:
    """An ended submission stays ended: once a run is finished, failed, cancelled or stopped, a
    later row of the same submission (the same ``submitted_at``) is a stale read of another
    process (a dispatch that read it queued and wrote it running after a cancel). A new
    submission (``submit``: queued, reason ``submitted``) is not."""
    return prev["status"] not in RUN_ACTIVE and row["submitted_at"] == prev["submitted_at"] \
        and (row["status"], row["reason"]) != ("queued", "submitted")


def _stale_segment(prev: dict[str, Any], row: dict[str, Any]) -> bool:
    """``ended`` is final: a segment id is never launched twice, so a live row after an ended
    one is a stale read of another process (a sensor's tick that read the segment running,
    written after a cancel ended it). A later ended row (its events synced) is not."""
    return prev["status"] == "ended" and row["status"] != "ended"


STOPPED_EXIT_WAIT_S = 30.0
"""How long an observation that failed an ownerless run waits for the trainers it stopped to
checkpoint and exit (a local provider SIGKILLs after its ``grace_s``, 10 s by default)."""


def events_file_for(job: TrainerJob, segment_id: str) -> str:
    """Each segment writes its own events file, so events map to segments exactly."""
    if job.is_local_output:
        base = job.output_dir[len("file://"):] if job.output_dir.startswith("file://") \
            else job.output_dir
        return str(Path(base) / "events" / f"{segment_id}.jsonl")
    return f"/tmp/factory-events/{segment_id}.jsonl"


class ControlPlane:
    """The loop over one lake and one provider ladder (ordered: the first rung is preferred)."""

    def __init__(self, lake: Lake, ladder: Sequence[Provider],
                 config: ControlConfig | None = None, *, clock: Any = time.time) -> None:
        if not ladder:
            raise ValueError("ladder: configure at least one provider")
        self.lake = lake
        self.ladder = list(ladder)
        self.by_name = {p.name: p for p in self.ladder}
        if len(self.by_name) != len(self.ladder):
            raise ValueError("ladder: provider names must be unique")
        self.config = config or ControlConfig()
        self.config.validate()
        self.clock = clock
        self._last_stamp = 0.0

    def _stamp(self) -> float:
        """``updated_at`` of a new row: strictly increasing, so the latest row always wins."""
        self._last_stamp = max(self.clock(), self._last_stamp + 1e-3)
        return self._last_stamp

    def _rows(self, name: str) -> list[dict[str, Any]]:
        """Rows of a control table (``Lake.log_rows``: ticks are frequent, and only what was
        appended since this process's last read is read)."""
        return self.lake.log_rows(name)

    # -- state -------------------------------------------------------------------------------
    def runs(self) -> dict[str, TrainingRun]:
        rows = _latest(self._rows("training_runs"), "run_id", _stale_run)
        return {k: TrainingRun(run_id=k, experiment=r["experiment"], kind=r["kind"],
                               priority=r["priority"], status=r["status"],
                               job=TrainerJob.from_dict(json.loads(r["job"])),
                               num_recoveries=r["num_recoveries"],
                               learning_rate=r["learning_rate"], reason=r["reason"] or "",
                               submitted_at=_t(r["submitted_at"]) or 0.0,
                               not_before=_t(r["not_before"]))
                for k, r in rows.items()}

    def segments(self, run_id: str | None = None) -> list[Segment]:
        rows = _latest(self._rows("training_segments"), "segment_id", _stale_segment)
        segs = [Segment(segment_id=r["segment_id"], run_id=r["run_id"], seq=r["seq"],
                        provider=r["provider"], handle=Handle.from_json(r["handle"]),
                        status=r["status"], launched_at=_t(r["launched_at"]) or 0.0,
                        deadline=_t(r["deadline"]), resume_from=r["resume_from"],
                        resume_step=r["resume_step"] or 0, first_step=r["first_step"],
                        last_step=r["last_step"], end_reason=r["end_reason"],
                        ended_at=_t(r["ended_at"]), learning_rate=r["learning_rate"])
                for r in rows.values()]
        if run_id is not None:
            segs = [s for s in segs if s.run_id == run_id]
        return sorted(segs, key=lambda s: (s.run_id, s.seq))

    def events(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Stored events (each once, by event_id), in segment and sequence order."""
        seen: set[str] = set()
        out = []
        for row in self._rows("training_events"):
            if row["event_id"] in seen or (run_id is not None and row["run_id"] != run_id):
                continue
            seen.add(row["event_id"])
            out.append(dict(row))  # the lake's rows are shared (``Lake.log_rows``)
        return sorted(out, key=lambda r: (r["event_time"], r["segment_id"] or "", r["seq"]))

    def _write_run(self, run: TrainingRun, lineage: Lineage | None = None) -> None:
        now = self._stamp()
        row = {"run_id": run.run_id, "experiment": run.experiment, "kind": run.kind,
               "priority": run.priority, "status": run.status,
               "job": json.dumps(run.job.to_dict(), sort_keys=True),
               "num_recoveries": run.num_recoveries, "learning_rate": run.learning_rate,
               "reason": run.reason, "submitted_at": _dt(run.submitted_at),
               "updated_at": _dt(now), "not_before": _dt(run.not_before)}
        self.lake.append("training_runs", [row], lineage=lineage)

    def _write_segments(self, segs: Iterable[Segment]) -> None:
        now = self._stamp()
        rows = [{
            "segment_id": s.segment_id, "run_id": s.run_id, "seq": s.seq,
            "provider": s.provider, "handle": s.handle.to_json(), "status": s.status,
            "launched_at": _dt(s.launched_at), "deadline": _dt(s.deadline),
            "resume_from": s.resume_from, "resume_step": s.resume_step,
            "first_step": s.first_step, "last_step": s.last_step, "end_reason": s.end_reason,
            "ended_at": _dt(s.ended_at), "learning_rate": s.learning_rate,
            "updated_at": _dt(now)} for s in segs]
        if rows:
            self.lake.append("training_segments", rows)

    # -- submit --------------------------------------------------------------------------------
    def submit(self, job: TrainerJob, *, experiment: str = "", kind: str = "train",
               priority: int | None = None, lineage: Lineage | None = None) -> TrainingRun:
        """Queue a run (idempotent per run id: an active run is returned as is).

        ``lineage``: who submits and what it read (the plan and dataset snapshots); the submit
        commit records it, and the run's events and checkpoints point back at that commit.
        """
        job.validate()
        existing = self.runs().get(job.run_id)
        if existing is not None and existing.status in RUN_ACTIVE:
            return existing
        run = TrainingRun(run_id=job.run_id, experiment=experiment, kind=kind,
                          priority=scheduler.priority_of(kind, self.config.priorities)
                          if priority is None else priority,
                          status="queued", job=job, num_recoveries=0,
                          learning_rate=job.plan.learning_rate, reason="submitted",
                          submitted_at=self.clock())
        self._write_run(run, RunLineage(
            run_id=lineage.run_id if lineage else "", asset_key=lineage.asset_key if lineage
            else "training_run", reads=dict(lineage.reads) if lineage else {},
            training_run=job.run_id))
        return run

    # -- events ------------------------------------------------------------------------------
    def sync_events(self) -> int:
        """Copy events of local segments' files into ``training_events``; returns how many."""
        segs = self.segments()
        runs = self.runs()
        known = {r["event_id"] for r in self._rows("training_events")}
        rows = []
        now = datetime.fromtimestamp(self.clock(), tz=UTC)
        for seg in segs:
            if seg.status == "ended" and seg.handle.info.get("events_synced"):
                continue
            path = seg.handle.info.get("events_file")
            run = runs.get(seg.run_id)
            if not path or run is None or not run.job.is_local_output:
                continue
            for ev in read_events(path):
                if ev.get("event_id") in known:
                    continue
                known.add(ev["event_id"])
                rows.append(event_row(ev, segment_id=seg.segment_id, source="events_file",
                                      received_at=now))
        store_events(self.lake, rows)
        return len(rows)

    def pulse(self) -> str:
        """A cheap fingerprint of what a tick acts on at once: the run and segment tables'
        snapshots (a run submitted, a segment written) and whether each live segment's trainer
        still runs (one that exited has events to sync and a segment to end). Unchanged, a tick
        would find nothing new but what time alone brings (a sandbox nearing its deadline, a
        backoff ending, capacity freed elsewhere)."""
        parts = [str(self.lake.snapshot_id("training_runs")),
                 str(self.lake.snapshot_id("training_segments"))]
        parts += [f"{seg_id}:{int(status.done)}"
                  for seg_id, status in sorted(self.provider_states().items())]
        return "|".join(parts)

    def exited(self) -> list[str]:
        """Live segments (their ids) whose trainer has exited: their last events (a final
        checkpoint) are in their files, and no ``observe`` has ended them yet."""
        return [seg_id for seg_id, status in self.provider_states().items() if status.done]

    # -- observe -------------------------------------------------------------------------------
    def provider_states(self) -> dict[str, Any]:
        """The provider's status of each live segment, by segment id."""
        out = {}
        for seg in self.segments():
            provider = self.by_name.get(seg.provider)
            if seg.live and provider is not None:
                out[seg.segment_id] = provider.status(seg.handle)
        return out

    def observe(self, states: dict[str, Any] | None = None) -> list[Segment]:
        """Move segments forward from their events and provider status; returns changed ones.

        ``states`` (``provider_states``), when given, were read before the events were
        synced: a trainer writes its last event before it exits, so a segment seen done then
        has its terminal event in the table now. Reading the status after the events let a
        trainer write its ``nan`` event and exit in between, and the segment was called
        ``failed`` without it.
        """
        now = self.clock()
        by_seg: dict[str, list[dict[str, Any]]] = {}
        for ev in self.events():
            by_seg.setdefault(ev["segment_id"], []).append(ev)
        runs = self.runs()
        changed: list[Segment] = []
        segs = self.segments()
        for seg in segs:
            if not seg.live:
                continue
            evs = by_seg.get(seg.segment_id, [])
            new = seg
            steps = [e["step"] for e in evs if e["step"] is not None]
            types = [e["type"] for e in evs]
            if "started" in types and seg.status == "launched":
                new = replace(new, status="running")
            if "started" in types:
                started = next(e for e in evs if e["type"] == "started")
                payload = json.loads(started["payload"])
                new = replace(new, first_step=started["step"], resume_step=started["step"] or 0,
                              resume_from=payload.get("resumed_from"))
            if steps:
                new = replace(new, last_step=max(steps))
            terminal = next((e for e in evs if e["type"] in TERMINAL_EVENTS), None)
            reason = None
            if terminal is not None:
                reason = terminal["type"]
                if reason == "preempted" and seg.status == "rolling":
                    reason = "rollover"
                elif reason == "failed" and json.loads(terminal["payload"]).get("data_error"):
                    reason = NOT_RETRIED[ExitCode.DATA_ERROR]
                elif reason == "failed" and json.loads(terminal["payload"]).get("owner_gone"):
                    reason = NOT_RETRIED[ExitCode.OWNER_GONE]
            else:
                provider = self.by_name.get(seg.provider)
                if states is not None and seg.segment_id in states:
                    status = states[seg.segment_id]
                else:
                    status = provider.status(seg.handle) if provider else None
                if status is not None and status.done:
                    if seg.status == "rolling":
                        reason = "rollover"
                    elif status.state == "succeeded":
                        reason = "finished"
                    elif status.exit_code in NOT_RETRIED:
                        reason = NOT_RETRIED[ExitCode(status.exit_code)]
                    else:
                        reason = "killed" if (status.exit_code or 0) < 0 or \
                            status.state == "lost" else "failed"
                else:
                    last = max([_t(e["received_at"]) or 0.0 for e in evs] + [seg.launched_at])
                    if now - last > self.config.heartbeat_timeout_s:
                        if provider is not None:
                            provider.stop(seg.handle)
                        reason = "heartbeat"
            if reason is not None:
                info = {**seg.handle.info, "events_synced": True}
                new = replace(new, status="ended", end_reason=reason, ended_at=now,
                              handle=replace(seg.handle, info=info))
            if new != seg:
                changed.append(new)
        changed = self._one_finisher(changed, by_seg)
        self._write_segments(changed)
        # Runs: finished when a segment finished, failed when one cannot be retried; stop
        # every other live segment then.
        all_segs = {s.segment_id: s for s in segs}
        all_segs.update({s.segment_id: s for s in changed})
        for run in runs.values():
            if run.status != "running":
                continue
            mine = sorted((s for s in all_segs.values() if s.run_id == run.run_id),
                          key=lambda s: s.seq)
            finisher = next((s for s in mine if s.end_reason == "finished"), None)
            if finisher is not None:
                self._stop_live(mine, now)
                self._write_run(replace(run, status="finished",
                                        reason=f"finished in {finisher.segment_id}"))
                continue
            newest = mine[-1] if mine else None
            if newest is not None and newest.end_reason in NOT_RETRIED.values():
                self._stop_live(mine, now)
                self._fail_unhealable(run, newest, by_seg.get(newest.segment_id, []))
                continue
            self._fail_ownerless(run, mine, now)
        for run in runs.values():
            if run.status == "queued":
                self._fail_ownerless(run, [], now)
        return changed

    def _fail_ownerless(self, run: TrainingRun, segs: list[Segment], now: float) -> None:
        """Fail ``run`` when the process following it (``TrainerJob.owner``, on this host) is
        gone: its live segments are stopped (a trainer checkpoints the step it is at on
        SIGTERM) and it is never resumed. Its trainer, when it notices first, ends ``owner_gone`` itself."""
        if owner_alive(run.job.owner) is not False:
            return
        stopped = self._stop_live(segs, now)
        self._write_run(replace(run, status="failed", not_before=None,
                                reason=f"owner gone: the process following the run "
                                       f"({run.job.owner}, its training_run step) died"))
        # Nothing follows the run any more: the checkpoint a stopped trainer writes as it exits
        # reaches training_events only if this observation syncs it.
        self._sync_after_exit(stopped)

    def _sync_after_exit(self, segs: list[Segment]) -> None:
        """Wait for the local trainers of ``segs`` (just stopped) to exit, at most
        ``STOPPED_EXIT_WAIT_S``, and sync the events they wrote on the way out."""
        pids = [p for s in segs if isinstance(p := s.handle.info.get("pid"), int)]
        if not pids:
            return
        deadline = time.monotonic() + STOPPED_EXIT_WAIT_S
        while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.sync_events()

    def _one_finisher(self, changed: list[Segment],
                      by_seg: dict[str, list[dict[str, Any]]]) -> list[Segment]:
        """``changed`` with at most one ``finished`` segment per run. Two segments of a run
        can finish between two looks (a continuation that started near the end, beside the
        sandbox it replaces); both wrote the last step's checkpoint, and the later write is
        the one on disk. The segment whose last checkpoint is the one on disk finished the
        run (the newest, when none is); the others end ``superseded``."""
        finished: dict[str, list[Segment]] = {}
        for s in changed:
            if s.end_reason == "finished":
                finished.setdefault(s.run_id, []).append(s)
        losers: set[str] = set()
        for segs in finished.values():
            if len(segs) < 2:
                continue
            on_disk = [s for s in segs if _wrote_checkpoint_on_disk(by_seg.get(s.segment_id, []))]
            winner = max(on_disk or segs, key=lambda s: s.seq)
            losers.update(s.segment_id for s in segs if s is not winner)
        return [replace(s, end_reason="superseded") if s.segment_id in losers else s
                for s in changed]

    def _stop_live(self, segs: Iterable[Segment], now: float) -> list[Segment]:
        """Stop the live ones of ``segs`` and record them ended; returns them."""
        stopped = []
        for s in segs:
            if s.live:
                if s.provider in self.by_name:
                    self.by_name[s.provider].stop(s.handle)
                stopped.append(replace(s, status="ended", end_reason="stopped", ended_at=now))
        self._write_segments(stopped)
        return stopped

    def _fail_unhealable(self, run: TrainingRun, seg: Segment,
                         events: list[dict[str, Any]]) -> None:
        """Mark ``run`` failed for ``seg``'s data or configuration error, with the trainer's
        message: its ``failed`` event's error, else the last ``trainer:`` line of its log."""
        failed = [json.loads(e["payload"]) for e in events if e["type"] == "failed"]
        message = str(failed[-1].get("error") or "") if failed else ""
        if not message:
            message = _trainer_log_line(seg.handle) or "no message; see the trainer's log"
        what = {"invalid_job": "invalid job", "owner_gone": "owner gone"}.get(
            seg.end_reason or "", "data or configuration error")
        reason = f"{what} in {seg.segment_id} (not retried): {' '.join(message.split())}"
        self._write_run(replace(run, status="failed", not_before=None, reason=reason))

    # -- launching -----------------------------------------------------------------------------
    def _launch(self, run: TrainingRun, provider: Provider, *, seq: int,
                resume: ckpt.CheckpointInfo | None, learning_rate: float,
                resume_latest: bool = False) -> Segment:
        segment_id = f"{run.run_id}-s{seq:03d}"
        job = run.job
        plan = job.plan if learning_rate == job.plan.learning_rate else \
            replace(job.plan, learning_rate=learning_rate)
        url = None
        if self.config.webhook_url:
            url = f"{self.config.webhook_url}?segment={quote(segment_id)}"
        resume_from = "latest" if resume_latest else (resume.path if resume else None)
        seg_job = replace(job, plan=plan, resume_from=resume_from,
                          events_file=events_file_for(job, segment_id),
                          webhook_url=url or job.webhook_url,
                          webhook_key_id=self.config.webhook_key_id if url
                          else job.webhook_key_id,
                          webhook_secret_env=self.config.webhook_secret_env if url
                          else job.webhook_secret_env)
        handle = provider.launch(seg_job, segment_id=segment_id, num_gpus=run.job.plan.num_devices)
        handle = replace(handle, info={**handle.info, "events_file": seg_job.events_file})
        seg = Segment(segment_id=segment_id, run_id=run.run_id, seq=seq, provider=provider.name,
                      handle=handle, status="launched", launched_at=handle.launched_at,
                      deadline=handle.deadline, resume_from=resume_from,
                      resume_step=resume.step if resume else 0, learning_rate=learning_rate)
        self._write_segments([seg])
        return seg

    def _rungs(self) -> list[scheduler.Rung]:
        live = [s for s in self.segments() if s.live]
        rungs = []
        for p in self.ladder:
            mine = [s for s in live if s.provider == p.name]
            busy = tuple(s.deadline for s in mine if s.deadline is not None)
            free = p.capacity()
            rungs.append(scheduler.Rung(name=p.name, free_gpus=free,
                                        total_gpus=free + len(mine),
                                        max_runtime_s=p.max_runtime_s, busy_until=busy))
        return rungs

    def _place(self, items: list[scheduler.WorkItem]) -> list[scheduler.Decision]:
        decisions = scheduler.plan(items, self._rungs(), now=self.clock(),
                                   backfill=self.config.backfill)
        # A job that keeps waiting for the same reason is recorded once, not once per tick.
        last = _latest([{**r, "updated_at": r["decided_at"]}
                        for r in self._rows("scheduler_assignments")], "job_id")
        record = [d for d in decisions if d.provider is not None or d.job_id not in last
                  or last[d.job_id]["reason"] != d.reason]
        self.lake.append("scheduler_assignments", [{
            "job_id": d.job_id, "kind": d.kind, "priority": d.priority, "provider": d.provider,
            "status": "assigned" if d.provider else "waiting", "backfilled": d.backfilled,
            "submitted_at": _dt(d.submitted_at), "decided_at": _dt(d.decided_at),
            "wait_s": d.wait_s, "reason": d.reason} for d in record])
        return decisions

    def dispatch(self) -> list[scheduler.Decision]:
        """Place queued runs on the ladder and launch those assigned."""
        queued = [r for r in self.runs().values() if r.status == "queued"]
        if not queued:
            return []
        items = [scheduler.WorkItem(job_id=r.run_id, kind=r.kind, priority=r.priority,
                                    num_gpus=r.job.plan.num_devices, submitted_at=r.submitted_at,
                                    can_roll_over=r.kind == "train") for r in queued]
        decisions = self._place(items)
        by_id = {r.run_id: r for r in queued}
        for d in decisions:
            if d.provider is None:
                continue
            run = by_id[d.job_id]
            resume = None
            try:
                if run.job.resume_from == "latest":
                    resume = ckpt.latest_checkpoint(run.job.output_dir)
                elif run.job.resume_from:
                    resume = ckpt.verify_checkpoint(run.job.resume_from)
            except ckpt.CheckpointError as e:
                self._write_run(replace(run, status="failed", reason=f"resume_from: {e}"))
                continue
            try:
                self._launch(run, self.by_name[d.provider], seq=len(self.segments(run.run_id)),
                             resume=resume, learning_rate=run.learning_rate)
            except Exception as e:  # a provider's API down: the run stays queued, reason kept
                log.warning("launch of %s on %s failed: %s", run.run_id, d.provider, e)
                self._write_run(replace(run, reason=f"launch on {d.provider} failed: {e}"))
                continue
            self._write_run(replace(run, status="running", reason=f"assigned to {d.provider}"))
        return decisions

    def _continue(self, run: TrainingRun, *, seq: int, resume: ckpt.CheckpointInfo | None,
                  learning_rate: float, resume_latest: bool = False) -> Segment | None:
        """Launch a continuation on the best rung with capacity (None: all full)."""
        item = scheduler.WorkItem(job_id=f"{run.run_id}-s{seq:03d}", kind=run.kind,
                                  priority=run.priority, num_gpus=run.job.plan.num_devices,
                                  submitted_at=self.clock())
        decision = self._place([item])[0]
        if decision.provider is None:
            return None
        return self._launch(run, self.by_name[decision.provider], seq=seq, resume=resume,
                            learning_rate=learning_rate, resume_latest=resume_latest)

    # -- rollover ------------------------------------------------------------------------------
    def rollover(self) -> list[Segment]:
        """Continuations for segments near their deadline; stop the old once the new started."""
        now = self.clock()
        runs = self.runs()
        launched: list[Segment] = []
        by_run: dict[str, list[Segment]] = {}
        for s in self.segments():
            by_run.setdefault(s.run_id, []).append(s)
        for run_id, segs in by_run.items():
            run = runs.get(run_id)
            if run is None or run.status != "running":
                continue
            newest = segs[-1]
            rolling = [s for s in segs[:-1] if s.status == "rolling"]
            if newest.status == "running":
                for old in rolling:  # the successor reported started: stop the old one
                    if old.provider in self.by_name:
                        self.by_name[old.provider].stop(old.handle)
            # A sandbox still loading when its deadline nears is doomed too: roll it over.
            if newest.status not in ("launched", "running") or newest.deadline is None or \
                    newest.deadline - now > self.config.rollover_margin_s:
                continue
            if self._finishes_in_time(newest, self.events(run_id), now):
                continue
            # "latest": the continuation picks the newest verified checkpoint when it has
            # loaded (seconds from now), not the one there is at launch, so less is redone.
            seg = self._continue(run, seq=newest.seq + 1, resume=None, resume_latest=True,
                                 learning_rate=newest.learning_rate or run.learning_rate)
            if seg is not None:
                self._write_segments([replace(newest, status="rolling")])
                launched.append(seg)
        return launched

    def _finishes_in_time(self, seg: Segment, events: list[dict[str, Any]],
                          now: float) -> bool:
        """Whether ``seg`` reaches its run's last step before its deadline, with
        ``FINISH_SLACK``, at its own pace: steps per second of this plane's clock between the
        first and the last time its ``progress`` events were received (the plane stamps the
        events it syncs with its clock; the receiver stamps webhooks with the wall clock, the
        production clock). False while that pace is unknown."""
        assert seg.deadline is not None
        reached: dict[float, int] = {}  # receipt time -> highest step received by then
        num_steps = None
        for ev in events:
            if ev["segment_id"] != seg.segment_id or ev["type"] not in ("started", "progress"):
                continue
            num_steps = json.loads(ev["payload"]).get("num_steps", num_steps)
            t = _t(ev["received_at"])
            if ev["type"] == "progress" and ev["step"] is not None and t is not None:
                reached[t] = max(reached.get(t, 0), int(ev["step"]))
        if not isinstance(num_steps, int) or len(reached) < 2:
            return False
        (t0, first), (t1, last) = min(reached.items()), max(reached.items())
        if last <= first:
            return False
        pace = (last - first) / (t1 - t0)
        return now + (num_steps - last) / pace * FINISH_SLACK <= seg.deadline

    # -- recovery ------------------------------------------------------------------------------
    def recover(self) -> list[Segment]:
        """Resume runs whose newest segment ended in a fault, within the retry budget; a data or
        configuration error (``NOT_RETRIED``) fails its run instead."""
        now = self.clock()
        launched: list[Segment] = []
        for run in self.runs().values():
            if run.status != "running":
                continue
            segs = self.segments(run.run_id)
            if not segs or segs[-1].live:
                continue
            last = segs[-1]
            if last.end_reason in ("finished", "stopped"):
                continue
            if last.end_reason in NOT_RETRIED.values():  # observe fails such runs; never resume
                self._fail_unhealable(run, last, [e for e in self.events(run.run_id)
                                                  if e["segment_id"] == last.segment_id])
                continue
            counts = last.end_reason not in ("rollover", "preempted")
            if counts and run.not_before is None:
                if run.num_recoveries >= self.config.max_recoveries:
                    self._write_run(replace(run, status="failed", reason=(
                        f"{last.end_reason} in {last.segment_id} after "
                        f"{run.num_recoveries} recoveries")))
                    continue
                delay = min(self.config.max_backoff_s, self.config.backoff_s
                            * self.config.backoff_factor ** run.num_recoveries)
                run = replace(run, not_before=(last.ended_at or now) + delay,
                              num_recoveries=run.num_recoveries + 1,
                              reason=f"recovering from {last.end_reason} in {last.segment_id}")
                self._write_run(run)
            if run.not_before is not None and now < run.not_before:
                continue
            lr = last.learning_rate or run.learning_rate
            resume = self._good_checkpoint(run, last)
            if last.end_reason == "nan" and self.config.nan_lr_backoff is not None:
                lr = lr * self.config.nan_lr_backoff
            seg = self._continue(run, seq=last.seq + 1, resume=resume, learning_rate=lr)
            if seg is None:
                continue
            launched.append(seg)
            note = f"; learning rate {run.learning_rate:g} -> {lr:g}" if lr != run.learning_rate \
                else ""
            self._write_run(replace(run, not_before=None, learning_rate=lr,
                                    reason=f"resumed in {seg.segment_id} from step "
                                           f"{seg.resume_step}{note}"))
        return launched

    def _good_checkpoint(self, run: TrainingRun, last: Segment) -> ckpt.CheckpointInfo | None:
        """The newest verified checkpoint; after a NaN, one strictly before the bad step."""
        limit = None
        if last.end_reason == "nan":
            nan = [e for e in self.events(run.run_id) if e["segment_id"] == last.segment_id
                   and e["type"] == "nan"]
            if nan:
                limit = int(nan[-1]["step"]) - 1
            elif last.last_step is not None:
                limit = last.last_step
        for step, path in reversed(ckpt.list_checkpoints(run.job.output_dir)):
            if limit is not None and step > limit:
                continue
            try:
                return ckpt.verify_checkpoint(path)
            except ckpt.CheckpointError:
                continue
        return None

    def early_stop(self) -> list[str]:
        """Stop running runs the evals flagged in ``early_stops`` (score fell after its peak):
        SIGTERM makes the trainer checkpoint first, and the run ends ``stopped``."""
        if not self.lake.exists("early_stops"):
            return []
        flagged: dict[str, dict[str, Any]] = {}
        for row in self.lake.read("early_stops").to_pylist():
            flagged[row["run_id"]] = row
        out = []
        for run in self.runs().values():
            row = flagged.get(run.run_id)
            if run.status != "running" or row is None or \
                    (_t(row["created_at"]) or 0.0) < run.submitted_at:
                continue
            self.stop_run(run.run_id, reason=f"early stop: {row['reason']} (peak at step "
                                             f"{row['peak_step']})", status="stopped")
            out.append(run.run_id)
        return out

    def stop_run(self, run_id: str, reason: str = "stopped", status: str = "cancelled") -> None:
        """Cancel a run: stop every live segment and mark it ``status``."""
        run = self.runs()[run_id]
        ended = []
        for s in self.segments(run_id):
            if s.live and s.provider in self.by_name:
                self.by_name[s.provider].stop(s.handle)
                ended.append(replace(s, status="ended", end_reason="stopped",
                                     ended_at=self.clock()))
        self._write_segments(ended)
        self._write_run(replace(run, status=status, reason=reason))

    def tick(self) -> dict[str, Any]:
        """One full pass, in order; returns what happened (for logs and sensor metadata)."""
        states = self.provider_states()  # before the events: see observe
        synced = self.sync_events()
        changed = self.observe(states)
        reaped = self.reap()
        stopped = self.early_stop()
        decisions = self.dispatch()
        rolled = self.rollover()
        recovered = self.recover()
        return {"events": synced, "changed": [s.segment_id for s in changed],
                "assigned": [d.job_id for d in decisions if d.provider],
                "rollovers": [s.segment_id for s in rolled],
                "recoveries": [s.segment_id for s in recovered], "early_stops": stopped,
                "reaped": [s.segment_id for s in reaped]}

    def reap(self) -> list[Segment]:
        """Stop the live segments of runs no longer active: a trainer launched by a process
        that read its run queued or running just before another ended it (a dispatch beside a
        cancel) must not train on for a cancelled run."""
        runs = self.runs()
        orphans = [s for s in self.segments() if s.live and s.run_id in runs
                   and runs[s.run_id].status not in RUN_ACTIVE]
        for s in orphans:
            log.warning("stopping %s: its run %s is %s", s.segment_id, s.run_id,
                        runs[s.run_id].status)
        self._stop_live(orphans, self.clock())
        return orphans


def cancel_run(plane: ControlPlane, run_id: str, *, reason: str,
               wait_s: float = 60.0) -> list[Segment]:
    """Cancel an active run (``stop_run``: its providers SIGTERM the trainers, which checkpoint
    and exit, SIGKILL after their grace) and wait up to ``wait_s`` for the trainers to be gone.

    Returns the segments still running afterwards: empty unless a provider could not stop one
    within ``wait_s`` (a local trainer launched by another process is stopped by its pid).
    """
    run = plane.runs().get(run_id)
    if run is None:
        return []
    live = [s for s in plane.segments(run_id) if s.live]
    if run.status in RUN_ACTIVE:
        plane.stop_run(run_id, reason=reason, status="cancelled")
    deadline = time.monotonic() + wait_s
    while True:
        # Providers stop asynchronously: the caller (often about to exit) waits here so the
        # SIGTERM, and the SIGKILL after the grace, are really sent.
        live = [s for s in live if s.provider in plane.by_name
                and not plane.by_name[s.provider].status(s.handle).done]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.1)


def ownerless_runs(lake: Lake) -> list[str]:
    """Training runs, as the plane reads them, recorded queued or running whose following
    process (``TrainerJob.owner``, on this host) is gone: a cheap look at ``training_runs``
    alone (no provider, no events), to tell whether ``observe_once`` has anything to end."""
    if not lake.exists("training_runs"):
        return []
    rows = _latest(lake.read("training_runs", columns=[
        "run_id", "status", "reason", "job", "submitted_at", "updated_at"]).to_pylist(),
        "run_id", _stale_run)
    return sorted(k for k, r in rows.items() if r["status"] in RUN_ACTIVE
                  and owner_alive(json.loads(r["job"]).get("owner")) is False)


def observe_once(plane: ControlPlane) -> list[str]:
    """Sync the events and observe once, nothing launched (no dispatch, rollover or recovery):
    a run whose owner or trainers died ends. The runs that ended (their ids)."""
    before = {k for k, r in plane.runs().items() if r.status in RUN_ACTIVE}
    states = plane.provider_states()  # before the events, as ``tick`` reads them
    plane.sync_events()
    plane.observe(states)
    after = plane.runs()
    return sorted(k for k in before if after[k].status not in RUN_ACTIVE)


def _wrote_checkpoint_on_disk(events: list[dict[str, Any]]) -> bool:
    """Whether the newest checkpoint a segment reported (its ``checkpoint`` events) is the one
    at its location now: same manifest, not replaced by another segment's write of that step."""
    reports = [json.loads(e["payload"]) for e in events if e["type"] == "checkpoint"]
    if not reports or not isinstance(reports[-1].get("location"), str):
        return False
    try:
        info = ckpt.verify_checkpoint(reports[-1]["location"])
    except (ckpt.CheckpointError, OSError):
        return False
    return info.manifest_sha256 == reports[-1].get("manifest_sha256")


def _trainer_log_line(handle: Handle) -> str | None:
    """The last ``trainer: ...`` line of a local segment's log (what the trainer said when it
    exited without an event, as for an invalid job); None when there is no readable log."""
    path = handle.info.get("log")
    if not isinstance(path, str):
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [line for line in tail.splitlines() if line.startswith("trainer: ")]
    return lines[-1] if lines else None


def reported(events: Iterable[dict[str, Any]], key: str,
             types: tuple[str, ...] = ("started",)) -> dict[str, Any] | None:
    """The object the newest of ``events`` (``training_events`` rows) of one of ``types``
    reports under ``key``; None when none does."""
    out = None
    for ev in events:
        if ev["type"] in types:
            value = json.loads(ev["payload"]).get(key)
            if isinstance(value, dict):
                out = value
    return out


def data_stats(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """What the trainer's tokenizing kept and dropped (``factory.trainer.data.DataStats`` as a dict),
    from the newest ``started`` or ``failed`` event that reports it; None when none does."""
    return reported(events, "data", ("started", "failed"))


def event_row(event: dict[str, Any], *, segment_id: str | None, source: str,
              received_at: datetime, key_id: str | None = None) -> dict[str, Any]:
    """A ``training_events`` row for one trainer event."""
    step = event.get("step")
    return {"event_id": str(event.get("event_id") or uuid.uuid4().hex),
            "run_id": str(event.get("run_id", "")), "segment_id": segment_id,
            "trainer_segment": event.get("segment"), "type": event.get("type"),
            "seq": event.get("seq"), "step": step if isinstance(step, int) else None,
            "event_time": _dt(float(event["time"])) if isinstance(event.get("time"),
                                                                  int | float) else received_at,
            "received_at": received_at, "source": source, "key_id": key_id,
            "payload": json.dumps(event, sort_keys=True)}


def store_events(lake: Lake, rows: list[dict[str, Any]]) -> None:
    """Append event rows; each ``checkpoint`` event also becomes a ``checkpoints`` row, verified
    (manifest, hashes, finite weights) where its location is reachable from here.

    One commit per run and table: the events commit reads the run's submit snapshot of
    ``training_runs`` (``run_origin``) and the checkpoints commit reads the events commit, so
    lineage goes checkpoint -> events -> run -> plan and dataset snapshots.
    """
    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_run.setdefault(row["run_id"], []).append(row)
    for run_id, run_rows in by_run.items():
        _store_run_events(lake, run_id, run_rows)


def _store_run_events(lake: Lake, run_id: str, rows: list[dict[str, Any]]) -> None:
    origin = run_origin(lake, run_id)
    writer = origin[1].get(RUN_ID, "") if origin else ""
    reads = {"training_runs": origin[0]} if origin else {}
    ckpt_rows = []
    experiments: dict[str, str] | None = None
    for row in rows:
        if row["type"] != "checkpoint":
            continue
        if experiments is None:
            latest = _latest(lake.read("training_runs", columns=[
                "run_id", "experiment", "updated_at"]).to_pylist(), "run_id")
            experiments = {k: v["experiment"] for k, v in latest.items()}
        event = json.loads(row["payload"])
        location = event.get("location")
        verified, files_sha256 = False, None
        if isinstance(location, str):
            try:
                info = ckpt.verify_checkpoint(location)
                verified = info.manifest_sha256 == event.get("manifest_sha256")
                files_sha256 = _files_sha256(location, info.manifest_sha256) if verified else None
            except (ckpt.CheckpointError, OSError):
                verified = False
        ckpt_rows.append({"run_id": row["run_id"], "experiment": experiments.get(row["run_id"]),
                          "step": row["step"], "path": location,
                          "manifest_sha256": event.get("manifest_sha256"),
                          "files_sha256": files_sha256,
                          "verified": verified, "received_at": row["received_at"],
                          "event_id": row["event_id"]})
    # Stamped with the Dagster run that submitted the training run: its trainer wrote these.
    events_snap = lake.append("training_events", rows, lineage=Lineage(
        run_id=writer, asset_key="training_run", reads=reads))
    if ckpt_rows:
        superseded = _superseded(lake, run_id, ckpt_rows)
        lake.append("checkpoints", ckpt_rows, lineage=Lineage(
            run_id=writer, asset_key="checkpoints",
            reads={"training_events": events_snap} if events_snap is not None else {}))
        if superseded:
            ids = ", ".join(f"'{r['event_id']}'" for r in superseded)
            lake.overwrite("checkpoints", superseded, where=f"event_id IN ({ids})",
                           lineage=Lineage(run_id=writer, asset_key="checkpoints"))


def _files_sha256(location: str, manifest_sha256: str) -> str | None:
    """sha256 of the file list (each file's name, size and sha256) of the checkpoint manifest
    at ``location``: it names the checkpoint's content, so a re-save of the same files has the
    same one, though its ``manifest_sha256`` differs (the manifest holds ``created_at``). None
    when the manifest there is no longer the one ``manifest_sha256`` names."""
    fs, path = fsspec.core.url_to_fs(location)
    data = fs.cat_file(path.rstrip("/") + "/" + ckpt.MANIFEST)
    if hashlib.sha256(data).hexdigest() != manifest_sha256:
        return None
    files = json.loads(data)["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _same_files(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``checkpoints`` rows name checkpoints of the same files: the same manifest,
    or the same ``files_sha256`` (a row stored without one compares by its manifest alone)."""
    return a["manifest_sha256"] == b["manifest_sha256"] \
        or (a.get("files_sha256") is not None and a.get("files_sha256") == b.get("files_sha256"))


def _superseded(lake: Lake, run_id: str, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stored verified checkpoints of ``run_id`` whose directory now holds one of ``new``
    with other files (a later segment wrote the same step: a continuation racing the sandbox
    it replaced, or a resume from an earlier checkpoint), rewritten unverified with
    ``superseded_by`` naming the checkpoint event now on disk. Never selected, scored or
    deployed again: every reader takes verified rows only. A re-save of the same files (a
    deterministic redo: the same ``files_sha256``, a later ``created_at``) supersedes nothing."""
    on_disk = {r["path"]: r for r in new if r["verified"] and r["path"]}
    if not on_disk or not lake.exists("checkpoints"):
        return []
    out = []
    for row in lake.sql("SELECT * FROM checkpoints WHERE run_id = ? AND verified",
                        [run_id]).to_pylist():
        now = on_disk.get(row["path"])
        if now is None or row["event_id"] == now["event_id"] or _same_files(row, now):
            continue
        out.append({**row, "verified": False, "superseded_by": now["event_id"]})
    return out


def loss_curve(events: Iterable[dict[str, Any]]) -> list[tuple[int, float]]:
    """One loss per step across segments (a step re-run after a resume keeps its last value)."""
    curve: dict[int, float] = {}
    for ev in events:
        if ev["type"] == "progress":
            payload = json.loads(ev["payload"])
            if isinstance(payload.get("loss"), int | float) and ev["step"] is not None:
                curve[int(ev["step"])] = float(payload["loss"])
    return sorted(curve.items())
