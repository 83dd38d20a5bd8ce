"""The must-hold behaviours, driven through the control loop the sensors call: rollover across
sandboxes that die at their deadline (20 training steps) ends bitwise equal to an uninterrupted
run; SIGKILL and NaN runs are recovered and finish; a trainer's data error fails its run after
one segment, never retried; with the first rung full a job lands on the next one on the next
tick."""

from __future__ import annotations

import json
import os
import random
import signal
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from factory.control.plane import ControlConfig, ControlPlane
from factory.control.providers import LocalProvider, SandboxProvider
from factory.lake import Lake
from factory.trainer.train import ExitCode, run_job
from tests.control.conftest import ONE_THREAD, drive

pytestmark = pytest.mark.slow


def _adapter(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step-{step:08d}" / "adapter_model.safetensors")


class StepClock:
    """Virtual seconds, one per training step the run's trainers have reported (``progress``
    events in the segments' events files): a sandbox's life is the work it did, however long a
    loaded machine took to start it, so the test waits on events, never on the wall clock."""

    def __init__(self, events_dir: Path) -> None:
        self.events_dir = events_dir

    def __call__(self) -> float:
        steps = 0
        for path in self.events_dir.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    steps += json.loads(line).get("type") == "progress"
                except json.JSONDecodeError:
                    continue  # a line still being written
        return float(steps)


def test_rollover_across_sandboxes_is_bitwise_identical(factory_home, make_job) -> None:
    num_steps = 45
    ref = make_job("ref", num_steps=num_steps, checkpoint_every_steps=3)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the sandboxes run with OMP_NUM_THREADS=1
    try:
        assert run_job(ref) == ExitCode.FINISHED
    finally:
        torch.set_num_threads(before)

    # Sandboxes live 20 steps of the run and continuations are launched 8 before the end
    # (none for the segment whose own pace finishes the run first), so 45 steps need at least
    # three. The short pause per step keeps a fast machine from running
    # past a deadline between two looks at the clock; it changes no number.
    job = make_job("roll", num_steps=num_steps, checkpoint_every_steps=3,
                   debug={"sleep_per_step_s": 0.2})
    clock = StepClock(Path(job.output_dir) / "events")  # where each segment writes
    sandbox = SandboxProvider(limit_s=20.0, grace_s=30.0, max_gpus=2, env=ONE_THREAD,
                              clock=clock)
    sandbox.warm_up()
    plane = ControlPlane(Lake(), [sandbox], ControlConfig(rollover_margin_s=8.0,
                                                          heartbeat_timeout_s=1e9,
                                                          backoff_s=0.0, max_recoveries=10),
                         clock=clock)
    plane.submit(job, experiment="demo")
    assert drive(plane, "roll", timeout_s=600.0) == "finished"

    segs = [s for s in plane.segments("roll") if s.first_step is not None]  # those that ran
    assert len(segs) >= 3, segs
    assert all(s.provider == "sandbox" and not s.live for s in plane.segments("roll"))
    reasons = [s.end_reason for s in segs]
    assert reasons.count("rollover") >= 2 and reasons.count("finished") == 1, segs
    # Each continuation resumed from the newest verified checkpoint when it started, so the
    # resume points never go back, and the run moved on across sandboxes.
    steps = [s.resume_step for s in segs]
    assert steps == sorted(steps), segs
    finisher = next(s for s in segs if s.end_reason == "finished")
    assert finisher.resume_step > 0 and finisher.resume_from
    assert finisher.last_step == num_steps
    got, want = _adapter(Path(job.output_dir), num_steps), _adapter(Path(ref.output_dir),
                                                                     num_steps)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_sigkill_and_nan_runs_are_recovered(factory_home, make_job) -> None:
    killed = make_job("killed", num_steps=12, debug={"sleep_per_step_s": 0.3})
    nan = make_job("nan", num_steps=10, debug={"nan_at_step": 5})
    local = LocalProvider(max_gpus=2, env=ONE_THREAD, warm_start=True)
    local.warm_up()
    plane = ControlPlane(Lake(), [local], ControlConfig(heartbeat_timeout_s=60.0, backoff_s=0.5,
                                                       nan_lr_backoff=0.5, max_recoveries=2))
    plane.submit(killed, experiment="demo")
    plane.submit(nan, experiment="demo")
    kill_after = random.randint(2, 8)
    state = {"killed": False}

    def maybe_kill(_: dict) -> None:
        first = plane.segments("killed")[0]
        if not state["killed"] and (first.last_step or 0) >= kill_after:
            os.kill(first.handle.info["pid"], signal.SIGKILL)
            state["killed"] = True

    assert drive(plane, "killed", timeout_s=120.0, on_tick=maybe_kill) == "finished", \
        f"SIGKILL after step {kill_after}"
    assert drive(plane, "nan", timeout_s=90.0) == "finished"

    k = plane.segments("killed")
    assert k[0].end_reason == "killed" and k[-1].end_reason == "finished"
    assert plane.runs()["killed"].num_recoveries == 1
    assert (Path(killed.output_dir) / "checkpoints" / "step-00000012").is_dir()

    n = plane.segments("nan")
    assert n[0].end_reason == "nan"
    assert n[1].resume_from is not None and n[1].resume_step < 5  # never past the bad step
    run = plane.runs()["nan"]
    assert run.learning_rate == pytest.approx(1.5e-3)  # the NaN learning-rate backoff
    assert n[1].learning_rate == pytest.approx(1.5e-3)
    history = [r["reason"] for r in Lake().read("training_runs").to_pylist()
               if r["run_id"] == "nan"]
    assert any("learning rate 0.003 -> 0.0015" in r for r in history), history


def test_a_data_error_fails_the_run_after_one_segment(factory_home, make_job,
                                                      tmp_path: Path) -> None:
    questions = tmp_path / "questions.parquet"
    msgs = [json.dumps([{"role": "user", "content": [{"type": "text", "text": f"hi {i}"}]}])
            for i in range(6)]
    pq.write_table(pa.table({"sample_id": [f"q{i}" for i in range(6)], "messages": msgs,
                             "tools": ["[]"] * 6}), questions)
    job = replace(make_job("nodata"), data_files=[str(questions)])
    local = LocalProvider(max_gpus=1, env=ONE_THREAD, warm_start=True)
    plane = ControlPlane(Lake(), [local], ControlConfig(backoff_s=0.0, max_recoveries=3))
    plane.submit(job, experiment="demo")
    assert drive(plane, "nodata", timeout_s=120.0) == "failed"

    [seg] = plane.segments("nodata")  # no s001: a data error cannot heal by retrying
    assert seg.end_reason == "data_error"
    assert local.status(seg.handle).exit_code == ExitCode.DATA_ERROR
    run = plane.runs()["nodata"]
    assert run.num_recoveries == 0
    assert run.reason == ("data or configuration error in nodata-s000 (not retried): "
                          "data_files: none of the 6 samples can train at max_seq_len 256: "
                          "6 no_target")
    for _ in range(3):  # later ticks leave it alone
        plane.tick()
    assert len(plane.segments("nodata")) == 1 and plane.runs()["nodata"].status == "failed"


def test_full_first_rung_sends_the_job_to_the_next_on_the_next_tick(factory_home, make_job) -> None:
    local = LocalProvider(max_gpus=1, env=ONE_THREAD, warm_start=True)
    sandbox = SandboxProvider(limit_s=60.0, grace_s=2.0, max_gpus=1, env=ONE_THREAD)
    plane = ControlPlane(Lake(), [local, sandbox], ControlConfig())
    first = make_job("first", num_steps=50, debug={"sleep_per_step_s": 0.5})
    second = make_job("second", num_steps=50, debug={"sleep_per_step_s": 0.5})
    try:
        plane.submit(first)
        plane.tick()
        assert local.capacity() == 0
        # The very next tick places it on the next rung: it never waits for the first rung's
        # job to end. (How soon that tick comes is the control sensors' interval.)
        plane.submit(second)
        plane.tick()
        segs = plane.segments("second")
        assert segs and segs[0].provider == "sandbox"
        rows = [r for r in Lake().read("scheduler_assignments").to_pylist()
                if r["job_id"] == "second"]
        assert rows[-1]["provider"] == "sandbox" and rows[-1]["status"] == "assigned"
        assert "local full" in rows[-1]["reason"]
    finally:
        for run_id in ("first", "second"):
            if run_id in plane.runs():
                plane.stop_run(run_id)
