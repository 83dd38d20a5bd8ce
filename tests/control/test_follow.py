"""Following a run (``factory.control.follow``) on a real control plane over a real lake, with a
trainer stand-in: the provider's trainers write their events files as local trainers do, on the
test's script, one scripted action per pause of the follower (whose clock is the provider's).

A run that finishes gives its segments, loss curve and drop counts; a failed run its reason; a
run past its timeout is stopped; an early-stopped run waits for the checkpoint its trainer writes
as it stops; who ticks the control loop follows whether a daemon does."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from factory.control.base import Handle, ProviderStatus
from factory.control.follow import (
    DRIVER_CHECK_S,
    STOP_CHECKPOINT_S,
    Followed,
    RunTimedOut,
    follow_run,
)
from factory.control.plane import ControlConfig, ControlPlane
from factory.lake import Lake
from factory.trainer.config import TrainerJob
from factory.trainer.data import DROP_REASONS, DataStats

Action = Callable[[], object]


class StandIn:
    """A provider whose trainers are scripted: each appends to its segment's events file (as a
    local trainer does) when told, and is running until told to exit; ``stop`` only asks (a
    trainer checkpoints on SIGTERM, then exits)."""

    name = "local"
    cost_per_gpu_hour = 0.0
    max_runtime_s = None

    def __init__(self) -> None:
        self.now = 1000.0
        self.state: dict[str, ProviderStatus] = {}
        self.files: dict[str, Path] = {}
        self.stopped: list[str] = []
        self.seq = 0

    def capacity(self) -> int:
        return 4 - sum(not s.done for s in self.state.values())

    def launch(self, job: TrainerJob, *, segment_id: str, num_gpus: int = 1) -> Handle:
        assert job.events_file
        self.files[segment_id] = Path(job.events_file)
        self.state[segment_id] = ProviderStatus(state="running")
        return Handle(provider=self.name, handle_id=f"pid-{segment_id}", launched_at=self.now)

    def status(self, handle: Handle) -> ProviderStatus:
        return self.state[handle.handle_id.removeprefix("pid-")]

    def stop(self, handle: Handle) -> None:
        self.stopped.append(handle.handle_id.removeprefix("pid-"))

    def emit(self, segment_id: str, kind: str, step: int, **payload: Any) -> str:
        """The trainer of ``segment_id`` writes one event; returns its id."""
        self.seq += 1
        event = {"event_id": uuid.uuid4().hex, "run_id": segment_id.rsplit("-s", 1)[0],
                 "type": kind, "step": step, "seq": self.seq, "segment": segment_id,
                 "time": self.now, **payload}
        path = self.files[segment_id]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(event) + "\n")
        return str(event["event_id"])

    def exit(self, segment_id: str, code: int) -> None:
        self.state[segment_id] = ProviderStatus(state="succeeded" if code == 0 else "failed",
                                                exit_code=code)


class World:
    """The stand-in, a plane over a fresh lake, and the script run at the follower's pauses."""

    def __init__(self, **config: Any) -> None:
        self.trainers = StandIn()
        self.lake = Lake()
        self.plane = ControlPlane(self.lake, [self.trainers], ControlConfig(**config),
                                  clock=self.clock)
        self.script: Iterator[Action] = iter(())
        self.pauses: list[float] = []
        self.logs: list[tuple[str, str]] = []

    def clock(self) -> float:
        return self.trainers.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.trainers.now += seconds
        action = next(self.script, None)
        if action is not None:
            action()

    def info(self, msg: str) -> None:
        self.logs.append(("info", msg))

    def warning(self, msg: str) -> None:
        self.logs.append(("warning", msg))

    def follow(self, job: TrainerJob, script: list[Action], **kwargs: Any) -> Followed:
        self.script = iter(script)
        kwargs.setdefault("daemon_ticks", lambda: False)
        kwargs.setdefault("poll_s", 1.0)
        return follow_run(self.plane, job, experiment="demo", log=self, clock=self.clock,
                          sleep=self.sleep, **kwargs)


def _stats(num_samples: int, too_long: int) -> DataStats:
    return DataStats(num_samples=num_samples, num_examples=num_samples - too_long,
                     num_dropped=too_long,
                     num_dropped_by_reason={r: too_long if r == "too_long_for_plan" else 0
                                            for r in DROP_REASONS},
                     max_sample_tokens=600, num_tokens=1000, num_label_tokens=400)


def test_a_finished_run_gives_its_segments_loss_curve_and_drops(factory_home, make_job) -> None:
    world = World()
    t = world.trainers
    submitted: list[str] = []
    shared = {"num_micro_batches": 3, "tokens": 120, "tokens_computed": 120}
    followed = world.follow(make_job("r", num_steps=3), [
        lambda: t.emit("r-s000", "started", 0, shared_prefix=shared,
                       precision={"ran": "fp32", "reason": "this CPU emulates bf16"}),
        lambda: t.emit("r-s000", "progress", 1, loss=2.5),
        lambda: (t.emit("r-s000", "progress", 2, loss=2.0),
                 t.emit("r-s000", "progress", 3, loss=1.25)),
        lambda: (t.emit("r-s000", "finished", 3), t.exit("r-s000", 0)),
    ], on_submitted=lambda: submitted.extend(world.plane.runs()))
    assert submitted == ["r"]  # called once the run is queued
    assert followed.failure is None and followed.missing_checkpoints == []
    md = followed.metadata(_stats(100, 1))
    assert (md["run_id"], md["status"], md["reason"]) == ("r", "finished", "finished in r-s000")
    assert (md["num_segments"], md["num_recoveries"], md["learning_rate"]) == (1, 0, 3e-3)
    assert md["loss_curve"] == {"step": [1, 2, 3], "loss": [2.5, 2.0, 1.25]}
    assert md["final_loss"] == 1.25
    assert (md["num_samples"], md["num_examples"], md["num_dropped"],
            md["max_sample_tokens"]) == (100, 99, 1, 600)
    assert {k: v for k, v in md.items() if k.startswith("num_dropped_")} == {
        f"num_dropped_{r}": int(r == "too_long_for_plan") for r in DROP_REASONS}
    assert md["shared_prefix"] == shared
    assert md["precision"] == "fp32 (this CPU emulates bf16)"
    assert followed.segments_table().splitlines()[2:] == [
        "| r-s000 | local | pid-r-s000 | 0 | 3 | finished |"]
    # This follower drove the loop (no daemon), one tick per poll_s.
    assert world.pauses == [1.0] * 4
    assert world.logs == [("info", "training run r: this step ticks the control loop")]


def test_a_failed_run_says_why(factory_home, make_job) -> None:
    world = World(backoff_s=0, max_recoveries=3)
    t = world.trainers
    followed = world.follow(make_job("bad"), [
        lambda: (t.emit("bad-s000", "failed", 0, data_error=True,
                        error="plan.lora_target_modules: the model has no module 'x'"),
                 t.exit("bad-s000", 65)),
    ])
    assert followed.run.status == "failed"
    assert followed.failure == (
        "training run bad failed: data or configuration error in bad-s000 (not retried): "
        "plan.lora_target_modules: the model has no module 'x'")
    assert followed.metadata(_stats(10, 0))["reason"] == followed.run.reason
    assert [s.segment_id for s in followed.segments] == ["bad-s000"]  # never retried


def test_a_run_past_its_timeout_is_stopped(factory_home, make_job) -> None:
    world = World()
    t = world.trainers
    with pytest.raises(RunTimedOut, match=r"^training run slow did not end in 5\.0 s$"):
        world.follow(make_job("slow"), [lambda: t.emit("slow-s000", "started", 0)],
                     timeout_s=5.0)
    run = world.plane.runs()["slow"]
    assert (run.status, run.reason) == ("cancelled", "timeout after 5.0 s")
    assert t.stopped == ["slow-s000"]
    assert 5.0 < sum(world.pauses) <= 7.0  # given up at the first look past the timeout


def _early_stop(world: World, run_id: str) -> None:
    world.lake.append("early_stops", [{
        "run_id": run_id, "experiment": "demo", "peak_step": 2, "peak_score": 0.9,
        "last_step": 4, "last_score": 0.7, "reason": "score fell after its peak",
        "created_at": datetime.fromtimestamp(world.clock(), tz=UTC)}])


def test_an_early_stopped_run_waits_for_its_stop_checkpoint(factory_home, make_job) -> None:
    world = World()
    t = world.trainers
    written: list[str] = []

    def checkpoint_and_exit() -> None:
        # SIGTERM reached the trainer: it checkpoints where it is, then exits (75).
        assert t.stopped == ["stop-s000"]
        written.append(t.emit("stop-s000", "checkpoint", 5, location="/nowhere/step-5",
                              manifest_sha256="0" * 64))
        t.exit("stop-s000", 75)

    followed = world.follow(make_job("stop", num_steps=100), [
        lambda: t.emit("stop-s000", "started", 0),
        lambda: t.emit("stop-s000", "progress", 5, loss=1.0),
        lambda: _early_stop(world, "stop"),
        lambda: None,  # the trainer has not reacted to the stop yet: the follower waits
        checkpoint_and_exit,
    ])
    assert followed.run.status == "stopped" and followed.failure is None
    assert followed.missing_checkpoints == []
    rows = world.lake.read("checkpoints").to_pylist()
    assert [r["event_id"] for r in rows] == written and rows[0]["step"] == 5


def test_a_stop_checkpoint_that_never_arrives_is_reported(factory_home, make_job) -> None:
    # Nobody syncs the events (a daemon's sensors drive; this follower only watches, and the
    # daemon is gone): the checkpoint event stays in its file.
    world = World()
    t = world.trainers
    event: list[str] = []

    def daemon_stops_the_run() -> None:
        world.plane.tick()  # dispatch, as the daemon's sensor would
        t.emit("late-s000", "started", 0)
        world.plane.tick()
        _early_stop(world, "late")
        world.plane.tick()
        event.append(t.emit("late-s000", "checkpoint", 1, location="/nowhere",
                            manifest_sha256="0" * 64))
        t.exit("late-s000", 75)

    followed = world.follow(make_job("late"), [daemon_stops_the_run], drive=False)
    assert followed.run.status == "stopped"
    assert followed.missing_checkpoints == event
    assert ("warning", f"training run late: 1 checkpoint event(s) of the stopped trainer not "
                       f"in the lake after {STOP_CHECKPOINT_S:.0f} s") in world.logs
    assert sum(world.pauses) >= STOP_CHECKPOINT_S


def test_the_follower_ticks_only_while_no_daemon_does(factory_home, make_job) -> None:
    world = World()
    t = world.trainers
    daemon = {"ticks": True}
    daemon_plane = ControlPlane(world.lake, [t], clock=world.clock)

    def daemon_tick() -> None:
        if daemon["ticks"]:
            daemon_plane.tick()

    def daemon_dies() -> None:
        daemon["ticks"] = False

    watching = [daemon_tick] * 3 + [daemon_dies]
    followed = world.follow(make_job("w"), [
        *watching,
        *[lambda: None] * 15,  # nobody ticks until the follower looks again
        lambda: t.emit("w-s000", "started", 0),
        lambda: (t.emit("w-s000", "finished", 1), t.exit("w-s000", 0)),
    ], daemon_ticks=lambda: daemon["ticks"], poll_s=5.0)
    assert followed.run.status == "finished"
    assert [m for _, m in world.logs] == [
        "training run w: the daemon's rollover and recovery sensors tick the control loop",
        "training run w: this step ticks the control loop"]
    # Watching: a look every WATCH_S (2 s), until DRIVER_CHECK_S told it the daemon was gone;
    # then a tick every poll_s.
    first_tick = world.pauses.index(5.0)
    assert set(world.pauses[:first_tick]) == {2.0}
    assert sum(world.pauses[:first_tick]) >= DRIVER_CHECK_S
    assert set(world.pauses[first_tick:]) == {5.0}


def test_the_follower_hands_the_runs_events_over_as_it_trains(factory_home, make_job) -> None:
    world = World()
    t = world.trainers
    seen: list[tuple[float, list[int]]] = []

    def on_progress(events: list[dict[str, Any]]) -> None:
        seen.append((world.clock(), [e["step"] for e in events if e["type"] == "progress"]))

    start = world.clock()
    world.follow(make_job("r", num_steps=3), [
        lambda: t.emit("r-s000", "started", 0),
        lambda: t.emit("r-s000", "progress", 1, loss=2.5),
        lambda: t.emit("r-s000", "progress", 2, loss=2.0),
        lambda: None,
        lambda: t.emit("r-s000", "progress", 3, loss=1.25),
        lambda: None,
        lambda: (t.emit("r-s000", "finished", 3), t.exit("r-s000", 0)),
    ], poll_s=10.0, on_progress=on_progress)
    # Every PROGRESS_EVERY_S (30 s) of the follower's clock, with what the lake holds then.
    assert [at - start for at, _ in seen] == [30.0, 60.0]
    assert seen[0][1] == [1, 2] and seen[1][1] == [1, 2, 3]
