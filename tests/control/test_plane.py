"""Control-loop policy with a scripted provider and a fake clock: heartbeats, bounded retries
with backoff, rollover hand-over (none for a segment that finishes in time; one finisher per
run), and idempotent ticks (fast, no trainer processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from factory.control.base import Handle, ProviderStatus
from factory.control.plane import (
    ControlConfig,
    ControlPlane,
    event_row,
    observe_once,
    ownerless_runs,
    store_events,
)
from factory.lake import Lake
from factory.trainer import checkpoint as ckpt
from factory.trainer.config import TrainerJob
from factory.trainer.pids import owner_token


class Scripted:
    """A provider whose processes are entries in a dict the test edits."""

    def __init__(self, name: str, *, slots: int = 2, limit_s: float | None = None) -> None:
        self.name, self.slots, self.limit_s = name, slots, limit_s
        self.cost_per_gpu_hour = 1.0
        self.state: dict[str, ProviderStatus] = {}
        self.jobs: dict[str, TrainerJob] = {}
        self.stopped: list[str] = []
        self.now = 1000.0

    @property
    def max_runtime_s(self) -> float | None:
        return self.limit_s

    def capacity(self) -> int:
        return self.slots - sum(not s.done for s in self.state.values())

    def launch(self, job: TrainerJob, *, segment_id: str, num_gpus: int = 1) -> Handle:
        self.state[segment_id] = ProviderStatus(state="running")
        self.jobs[segment_id] = job
        return Handle(provider=self.name, handle_id=segment_id, launched_at=self.now,
                      deadline=self.now + self.limit_s if self.limit_s else None)

    def status(self, handle: Handle) -> ProviderStatus:
        return self.state[handle.handle_id]

    def stop(self, handle: Handle) -> None:
        self.stopped.append(handle.handle_id)


def _emit(lake: Lake, seg: str, kind: str, step: int, t: float, **extra) -> None:
    ev = {"event_id": uuid.uuid4().hex, "run_id": seg.rsplit("-s", 1)[0], "type": kind,
          "step": step, "seq": 0, "segment": "x", "time": t, **extra}
    store_events(lake, [event_row(ev, segment_id=seg, source="webhook",
                                  received_at=datetime.fromtimestamp(t, tz=UTC))])


def _plane(provider: Scripted, **cfg) -> tuple[ControlPlane, Lake]:
    lake = Lake()
    return ControlPlane(lake, [provider], ControlConfig(**cfg),
                        clock=lambda: provider.now), lake


def test_silent_segment_is_stopped_and_recovered_after_backoff(factory_home, make_job) -> None:
    p = Scripted("local")
    plane, lake = _plane(p, heartbeat_timeout_s=60, backoff_s=10, max_recoveries=1)
    plane.submit(make_job("r"))
    plane.tick()
    _emit(lake, "r-s000", "started", 0, p.now)
    plane.tick()
    assert plane.segments("r")[0].status == "running"
    p.now += 61  # no event for longer than the heartbeat timeout
    plane.tick()
    [seg] = plane.segments("r")
    assert seg.end_reason == "heartbeat" and p.stopped == ["r-s000"]
    assert plane.runs()["r"].num_recoveries == 1
    p.now += 5  # inside the backoff: nothing launched
    plane.tick()
    assert len(plane.segments("r")) == 1
    p.now += 6
    plane.tick()
    plane.tick()  # idempotent: one recovery, not two
    segs = plane.segments("r")
    assert [s.segment_id for s in segs] == ["r-s000", "r-s001"]
    # Second fault: the budget (1) is spent, the run fails with the reason.
    p.state["r-s001"] = ProviderStatus(state="failed", exit_code=1)
    plane.tick()
    run = plane.runs()["r"]
    assert run.status == "failed" and "failed in r-s001 after 1 recoveries" in run.reason


def test_rollover_hands_over_and_stops_the_old_sandbox(factory_home, make_job) -> None:
    p = Scripted("sandbox", limit_s=20)
    plane, lake = _plane(p, rollover_margin_s=8)
    plane.submit(make_job("r"))
    plane.tick()
    _emit(lake, "r-s000", "started", 0, p.now)
    p.now += 5
    plane.tick()
    assert len(plane.segments("r")) == 1  # 15 s left > 8 s margin
    p.now += 8
    plane.tick()
    old, new = plane.segments("r")
    assert old.status == "rolling" and new.status == "launched"
    assert p.jobs["r-s001"].resume_from == "latest"
    assert p.stopped == []  # not before the new one started
    _emit(lake, "r-s001", "started", 4, p.now, resumed_from="/ckpt/step-00000004")
    plane.tick()
    assert p.stopped == ["r-s000"]
    p.state["r-s000"] = ProviderStatus(state="failed", exit_code=75)
    plane.tick()
    old, new = plane.segments("r")
    assert old.end_reason == "rollover" and new.resume_step == 4
    assert new.resume_from == "/ckpt/step-00000004"
    _emit(lake, "r-s001", "finished", 10, p.now)
    plane.tick()
    assert plane.runs()["r"].status == "finished"


def test_a_segment_that_finishes_before_its_deadline_is_not_rolled_over(
        factory_home, make_job) -> None:
    p = Scripted("sandbox", slots=4, limit_s=20)
    plane, lake = _plane(p, rollover_margin_s=8)
    plane.submit(make_job("fast", num_steps=10))
    plane.submit(make_job("slow", num_steps=10))
    plane.tick()
    for run_id in ("fast", "slow"):
        _emit(lake, f"{run_id}-s000", "started", 0, p.now, num_steps=10)
    # fast: one step a second, at step 9 with 7 s left (1 step: 1.5 s with the slack);
    # slow: one step in 4 s, at step 3 (7 steps: 28 s). Both are inside the 8 s margin.
    for t in range(1, 14):
        _emit(lake, "fast-s000", "progress", min(t, 9), p.now + t, num_steps=10)
        if t % 4 == 0:
            _emit(lake, "slow-s000", "progress", t // 4, p.now + t, num_steps=10)
    p.now += 13
    plane.tick()
    assert [s.segment_id for s in plane.segments("fast")] == ["fast-s000"]
    old, new = plane.segments("slow")
    assert old.status == "rolling" and new.status == "launched"


def test_of_two_segments_that_finish_together_one_finished_the_run(
        factory_home, make_job) -> None:
    p = Scripted("sandbox", limit_s=20)
    plane, lake = _plane(p, rollover_margin_s=8)
    job = make_job("r", num_steps=10)
    plane.submit(job)
    plane.tick()
    _emit(lake, "r-s000", "started", 0, p.now)
    p.now += 13
    plane.tick()
    assert [s.status for s in plane.segments("r")] == ["rolling", "launched"]
    # Between two ticks the continuation starts, and both trainers write step 10's checkpoint
    # (other weights: not a deterministic redo) and finish: the old sandbox's write is the
    # later one, the one on disk.
    _emit(lake, "r-s001", "started", 8, p.now, resumed_from="step-00000008")
    for value, seg in enumerate(("r-s001", "r-s000")):
        _save_checkpoint(lake, job, seg, 10, p.now, weight=float(value))
        _emit(lake, seg, "finished", 10, p.now)
        p.state[seg] = ProviderStatus(state="succeeded", exit_code=0)
        p.now += 1
    plane.tick()
    old, new = plane.segments("r")
    assert (old.end_reason, new.end_reason) == ("finished", "superseded")
    run = plane.runs()["r"]
    assert run.status == "finished" and run.reason == "finished in r-s000"
    plane.tick()
    assert [s.end_reason for s in plane.segments("r")] == ["finished", "superseded"]
    # The superseded segment's checkpoint of step 10 is no longer in its directory: its row
    # is rewritten unverified, naming the checkpoint there now; the one on disk stays verified.
    events = {r["segment_id"]: r["event_id"] for r in lake.read("training_events").to_pylist()
              if r["type"] == "checkpoint"}
    rows = {r["event_id"]: r for r in lake.read("checkpoints").to_pylist()}
    assert len(rows) == 2
    loser, winner = rows[events["r-s001"]], rows[events["r-s000"]]
    assert (loser["verified"], loser["superseded_by"]) == (False, events["r-s000"])
    assert (winner["verified"], winner["superseded_by"]) == (True, None)


def _save_checkpoint(lake: Lake, job: TrainerJob, seg: str, step: int, t: float, *,
                     weight: float) -> None:
    """Write checkpoint ``step`` of ``job`` (its adapter weights all ``weight``) as segment
    ``seg``'s trainer does, and store its ``checkpoint`` event."""
    files = {name: b"{}" for name in ckpt.REQUIRED}
    files[ckpt.ADAPTER] = save({"lora_A": torch.full((2, 2), weight)})
    info = ckpt.write_checkpoint(job.output_dir, step, files, run_id=job.run_id)
    _emit(lake, seg, "checkpoint", step, t, location=info.path,
          manifest_sha256=info.manifest_sha256)


def _checkpoint_rows(lake: Lake) -> dict[str, dict[str, Any]]:
    """``checkpoints`` rows by the segment of their event."""
    segments = {r["event_id"]: r["segment_id"] for r in lake.read("training_events").to_pylist()}
    return {segments[r["event_id"]]: r for r in lake.read("checkpoints").to_pylist()}


def test_a_re_save_of_the_same_files_supersedes_nothing(factory_home, make_job) -> None:
    """A step written again with the same files (a deterministic redo after a resume: only the
    manifest's ``created_at`` differs) leaves the first checkpoint verified; written again
    with other weights, the first one is superseded by the checkpoint now on disk."""
    p = Scripted("local")
    plane, lake = _plane(p)
    job = make_job("r", num_steps=10)
    plane.submit(job)
    manifest = Path(ckpt.step_dir(job.output_dir, 4), ckpt.MANIFEST)
    _save_checkpoint(lake, job, "r-s000", 4, p.now, weight=1.0)
    first = json.loads(manifest.read_bytes())
    _save_checkpoint(lake, job, "r-s001", 4, p.now + 1, weight=1.0)
    again = json.loads(manifest.read_bytes())
    assert again["created_at"] > first["created_at"] and again["files"] == first["files"]
    rows = _checkpoint_rows(lake)
    assert rows["r-s000"]["manifest_sha256"] != rows["r-s001"]["manifest_sha256"]
    assert [(rows[s]["verified"], rows[s]["superseded_by"]) for s in ("r-s000", "r-s001")] \
        == [(True, None), (True, None)]

    _save_checkpoint(lake, job, "r-s002", 4, p.now + 2, weight=2.0)
    rows = _checkpoint_rows(lake)
    on_disk = rows["r-s002"]["event_id"]
    assert [(rows[s]["verified"], rows[s]["superseded_by"])
            for s in ("r-s000", "r-s001", "r-s002")] \
        == [(False, on_disk), (False, on_disk), (True, None)]


def test_a_run_whose_owner_died_is_found_and_ended_by_one_observation(
        factory_home, make_job) -> None:
    """``ownerless_runs`` names the active runs whose owner process is gone from the lake
    alone; ``observe_once`` fails them (launching nothing) and names the runs it ended."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    p = Scripted("local")
    plane, lake = _plane(p)
    plane.submit(replace(make_job("orphan"), owner=owner_token(gone.pid)))
    plane.submit(replace(make_job("followed"), owner=owner_token()))  # this process: alive
    plane.submit(make_job("unowned"))
    assert ownerless_runs(lake) == ["orphan"]
    assert observe_once(plane) == ["orphan"]
    runs = plane.runs()
    assert runs["orphan"].status == "failed" and runs["orphan"].reason.startswith("owner gone")
    assert (runs["followed"].status, runs["unowned"].status) == ("queued", "queued")
    assert p.jobs == {} and ownerless_runs(lake) == []


def test_submit_is_idempotent_and_bad_jobs_are_refused(factory_home, make_job) -> None:
    p = Scripted("local", slots=0)
    plane, _ = _plane(p)
    job = make_job("r")
    assert plane.submit(job).status == "queued"
    plane.tick()
    plane.tick()
    assert plane.submit(job).status == "queued"
    assert len([r for r in Lake().read("training_runs").to_pylist()]) == 1
    waits = Lake().read("scheduler_assignments").to_pylist()
    assert len(waits) == 1 and waits[0]["status"] == "waiting"  # recorded once, not per tick


def test_an_early_stop_from_the_evals_stops_the_run(factory_home, make_job) -> None:
    p = Scripted("local")
    plane, lake = _plane(p)
    plane.submit(make_job("r"))
    plane.tick()
    _emit(lake, "r-s000", "started", 0, p.now)
    plane.tick()
    lake.append("early_stops", [{"run_id": "r", "experiment": "demo", "peak_step": 20,
                                 "peak_score": 0.8, "last_step": 60, "last_score": 0.6,
                                 "reason": "score fell 0.2 below its peak over 3 evals",
                                 "created_at": datetime.fromtimestamp(p.now + 1, tz=UTC)}])
    p.now += 2
    report = plane.tick()
    assert report["early_stops"] == ["r"] and p.stopped == ["r-s000"]
    run = plane.runs()["r"]
    assert run.status == "stopped" and "peak at step 20" in run.reason
    p.state["r-s000"] = ProviderStatus(state="failed", exit_code=75)
    plane.tick()
    assert len(plane.segments("r")) == 1  # never recovered


class CancelledWhileAsked(Scripted):
    """Another process cancels the run at the moment this one asks about its trainer: between
    a tick's read of the segments and its write of what it saw."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.on_status: Any = None

    def status(self, handle: Handle) -> ProviderStatus:
        hook, self.on_status = self.on_status, None
        if hook is not None:
            hook()
        return super().status(handle)


def test_a_cancel_during_another_processs_tick_stays_cancelled(factory_home, make_job) -> None:
    """A sensor's tick read the segment running, a cancel ended it, then the tick wrote the
    step it saw: the segment is still ended (``stopped``), the run cancelled, nothing is
    relaunched, and the provider is not asked to stop it twice."""
    p = CancelledWhileAsked("local")
    sensor, lake = _plane(p)
    cancelling, _ = _plane(p)
    sensor.submit(make_job("r"))
    sensor.tick()
    _emit(lake, "r-s000", "started", 0, p.now)
    sensor.tick()
    _emit(lake, "r-s000", "progress", 5, p.now + 1)
    p.now += 2

    def cancel() -> None:
        cancelling.stop_run("r", reason="interrupted")
        p.now += 1  # the tick writes after the cancel

    p.on_status = cancel
    [stale] = sensor.observe()  # the step it saw, written after the cancel
    assert (stale.status, stale.last_step) == ("running", 5)
    [seg] = sensor.segments("r")
    assert (seg.status, seg.end_reason) == ("ended", "stopped")
    assert cancelling.runs()["r"].status == "cancelled"
    p.state["r-s000"] = ProviderStatus(state="failed", exit_code=-15)
    p.now += 100
    sensor.tick()
    assert [(s.segment_id, s.status, s.end_reason) for s in sensor.segments("r")] == \
        [("r-s000", "ended", "stopped")]
    assert sensor.runs()["r"].status == "cancelled" and p.stopped == ["r-s000"]


class CancelledWhileLaunching(Scripted):
    """Another process cancels the run while this one launches its trainer: a dispatch that
    read the run queued, beside a cancel."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.on_launch: Any = None

    def launch(self, job: TrainerJob, *, segment_id: str, num_gpus: int = 1) -> Handle:
        hook, self.on_launch = self.on_launch, None
        if hook is not None:
            hook()
        return super().launch(job, segment_id=segment_id, num_gpus=num_gpus)


def test_a_trainer_launched_as_its_run_is_cancelled_is_stopped(factory_home, make_job) -> None:
    """The dispatch's "running" write after the cancel is ignored and the next tick stops the
    trainer it launched; a new submission of the run id then queues it again."""
    p = CancelledWhileLaunching("local")
    dispatcher, _ = _plane(p)
    cancelling, _ = _plane(p)
    job = make_job("r")
    dispatcher.submit(job)

    def cancel() -> None:
        cancelling.stop_run("r", reason="interrupted")
        p.now += 1  # the dispatch writes after the cancel

    p.on_launch = cancel
    dispatcher.dispatch()
    assert dispatcher.runs()["r"].status == "cancelled"
    assert [s.status for s in dispatcher.segments("r")] == ["launched"] and p.stopped == []
    report = dispatcher.tick()
    assert report["reaped"] == ["r-s000"] and p.stopped == ["r-s000"]
    [seg] = dispatcher.segments("r")
    assert (seg.status, seg.end_reason) == ("ended", "stopped")
    p.state["r-s000"] = ProviderStatus(state="failed", exit_code=-15)
    assert dispatcher.tick()["reaped"] == [] and dispatcher.runs()["r"].status == "cancelled"
    assert dispatcher.submit(job).status == "queued"
    assert dispatcher.runs()["r"].status == "queued"
    dispatcher.tick()
    assert dispatcher.runs()["r"].status == "running"
    assert [s.segment_id for s in dispatcher.segments("r") if s.live] == ["r-s001"]


class ExitsWhenAsked(Scripted):
    """Its trainers write their last event and exit at the moment their status is read: the
    race between reading a segment's events file and asking its provider about it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.dying: dict[str, dict] = {}  # segment -> the event it writes as it exits

    def status(self, handle: Handle) -> ProviderStatus:
        last = self.dying.pop(handle.handle_id, None)
        if last is not None:
            path = Path(self.jobs[handle.handle_id].events_file or "")
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(last) + "\n")
            self.state[handle.handle_id] = ProviderStatus(state="failed", exit_code=3)
        return self.state[handle.handle_id]


def test_a_trainer_that_writes_nan_and_exits_during_a_tick_is_a_nan_segment(
        factory_home, make_job) -> None:
    p = ExitsWhenAsked("local")
    plane, _ = _plane(p, heartbeat_timeout_s=60, backoff_s=0, nan_lr_backoff=0.5,
                      max_recoveries=1)
    plane.submit(make_job("r"))
    plane.tick()
    assert [s.segment_id for s in plane.segments("r")] == ["r-s000"]
    p.dying["r-s000"] = {"event_id": uuid.uuid4().hex, "run_id": "r", "type": "nan",
                         "step": 5, "seq": 3, "segment": "x", "time": p.now}
    plane.tick()
    first = plane.segments("r")[0]
    assert first.end_reason == "nan"  # not "failed": its event was read after the status
    assert [e["type"] for e in plane.events("r")] == ["nan"]
    assert plane.segments("r")[-1].learning_rate < first.learning_rate  # the NaN backoff


def test_a_data_error_fails_the_run_at_once_and_is_never_retried(factory_home, make_job) -> None:
    p = Scripted("local", slots=5)
    plane, lake = _plane(p, backoff_s=0, max_recoveries=3)
    for run_id in ("event", "code", "invalid", "crash"):
        plane.submit(make_job(run_id))
    plane.tick()
    # The trainer's report says data error; or only its exit status is known (its events lost).
    _emit(lake, "event-s000", "failed", 0, p.now, data_error=True,
          error="data_files: none of the 5 samples can train at max_seq_len 256: 5 no_target")
    p.state["event-s000"] = ProviderStatus(state="failed", exit_code=65)
    p.state["code-s000"] = ProviderStatus(state="failed", exit_code=65)
    p.state["invalid-s000"] = ProviderStatus(state="failed", exit_code=2)
    p.state["crash-s000"] = ProviderStatus(state="failed", exit_code=1)
    plane.tick()
    plane.tick()
    runs = plane.runs()
    assert runs["event"].status == "failed" and runs["event"].reason == (
        "data or configuration error in event-s000 (not retried): data_files: none of the 5 "
        "samples can train at max_seq_len 256: 5 no_target")
    assert runs["code"].status == "failed"
    assert runs["code"].reason.startswith("data or configuration error in code-s000")
    assert runs["invalid"].status == "failed"
    assert runs["invalid"].reason.startswith("invalid job in invalid-s000 (not retried)")
    for run_id, reason in (("event", "data_error"), ("code", "data_error"),
                           ("invalid", "invalid_job")):
        [seg] = plane.segments(run_id)  # one segment: no s001
        assert seg.end_reason == reason and runs[run_id].num_recoveries == 0
    # A crash is transient: recovered as before.
    assert runs["crash"].status == "running" and runs["crash"].num_recoveries == 1
    assert [s.segment_id for s in plane.segments("crash")] == ["crash-s000", "crash-s001"]


_TRAINER = """
import json, os, signal, sys, time
path, run_id, seg = sys.argv[1:4]
os.makedirs(os.path.dirname(path), exist_ok=True)

def stop(*_):
    time.sleep(0.5)  # the checkpoint takes a while: the observation must wait for it
    with open(path, "a") as f:
        f.write(json.dumps({"event_id": "ckpt-" + seg, "run_id": run_id, "type": "checkpoint",
                            "step": 3, "seq": 1, "segment": seg, "time": time.time()}) + "\\n")
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(120)
"""


class Stoppable(Scripted):
    """``Scripted``, each segment a real process that writes a checkpoint event to its events
    file when it is told to stop (SIGTERM), as a trainer does, and then exits."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def launch(self, job: TrainerJob, *, segment_id: str, num_gpus: int = 1) -> Handle:
        handle = super().launch(job, segment_id=segment_id, num_gpus=num_gpus)
        assert job.events_file
        proc = subprocess.Popen([sys.executable, "-c", _TRAINER, job.events_file, job.run_id,
                                 segment_id], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        self.procs[segment_id] = proc
        return replace(handle, info={**handle.info, "pid": proc.pid})

    def stop(self, handle: Handle) -> None:
        super().stop(handle)
        self.procs[handle.handle_id].terminate()


def test_the_checkpoint_a_stopped_trainer_of_an_ownerless_run_writes_is_synced(
        factory_home, make_job) -> None:
    """The observation that fails a run whose owner died stops its trainer and waits for the
    checkpoint the trainer writes on its way out: nothing follows the run afterwards to sync it."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    p = Stoppable("local")
    plane, lake = _plane(p)
    try:
        plane.submit(replace(make_job("r"), owner=owner_token(owner.pid)))
        plane.tick()
        [seg] = plane.segments("r")
        assert seg.live and "pid" in seg.handle.info
        owner.kill()
        owner.wait()
        plane.tick()
        assert plane.runs()["r"].reason.startswith("owner gone")
        assert p.stopped == ["r-s000"] and p.procs["r-s000"].poll() == 0
        events = {e["type"] for e in lake.read("training_events").to_pylist()
                  if e["run_id"] == "r"}
        assert "checkpoint" in events
    finally:
        owner.kill()
        for proc in p.procs.values():
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
