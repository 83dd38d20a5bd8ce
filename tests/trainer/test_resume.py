"""Exact resume: a run preempted (SIGTERM) and then killed (SIGKILL) at random steps, resumed
each time from its last checkpoint, ends bitwise equal to a run never interrupted: on one source,
and mid-mixture (the mixture's position is in the checkpoint)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from factory.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from factory.trainer.config import TrainerJob
from factory.trainer.train import ExitCode, run_job
from factory.trainer.webhooks import read_events
from tests.conftest import ROOT
from tests.trainer.conftest import make_samples, write_parquet
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def start(job_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "factory.trainer", "--job", str(job_path)], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for_step(proc: subprocess.Popen[bytes], events: Path, step: int,
                  timeout_s: float = 120.0) -> None:
    """Until the trainer's events file reports ``step``; fails at once if the trainer exits."""

    def reached() -> bool:
        if any(e["type"] == "progress" and e["step"] >= step for e in read_events(events)):
            return True
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"trainer exited {proc.returncode} before step {step}:\n{out}")
        return False

    wait_until(reached, timeout_s, f"the trainer's step {step}")


def final_state(out_dir: Path) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    info = latest_checkpoint(str(out_dir))
    assert info is not None
    state = json.loads((Path(info.path) / "trainer_state.json").read_text())
    return load_file(Path(info.path) / "adapter_model.safetensors"), state["loss_history"]


@pytest.mark.parametrize("mixed", [False, True], ids=["one-source", "mixture"])
def test_sigterm_then_sigkill_then_resume_is_bitwise_identical(make_job, tmp_path: Path,
                                                              mixed: bool) -> None:
    plan = {"num_steps": 8, "checkpoint_every_steps": 3}
    job: dict[str, object] = {}
    if mixed:
        # 24 traffic rows, 3:2 against 150 general ones: every window ends where the traffic
        # wraps (~40 draws), so 8 steps of 4 micro-batches cross several windows and epochs.
        traffic = write_parquet(tmp_path / "traffic.parquet", make_samples(24))
        general = write_parquet(tmp_path / "general.parquet", make_samples(150, seed=11))
        job = {"data_files": [], "mix": [
            {"name": "traffic", "weight": 3.0, "data_files": [str(traffic)]},
            {"name": "file:general.jsonl", "weight": 2.0, "data_files": [str(general)]}]}
    ref_path = make_job("ref", plan=plan, **job)
    # In-process runs use one thread (conftest), like the OMP_NUM_THREADS=1 subprocesses.
    assert run_job(TrainerJob.from_json(ref_path)) == ExitCode.FINISHED
    ref_weights, ref_losses = final_state(tmp_path / "ref" / "out")
    assert len(ref_losses) == 8

    rng = random.Random()
    term_at, kill_at = rng.randint(1, 3), rng.randint(5, 7)
    why = f"(SIGTERM after step {term_at}, SIGKILL after step {kill_at})"
    out = tmp_path / "chain" / "out"
    events = out / "events.jsonl"
    first = make_job("chain", plan=plan, debug={"sleep_per_step_s": 0.25}, **job)

    proc = start(first, tmp_path)
    wait_for_step(proc, events, term_at)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == ExitCode.PREEMPTED, why
    preempted = [e for e in read_events(events) if e["type"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["checkpoint"], why
    stopped = verify_checkpoint(preempted[0]["checkpoint"])
    assert stopped.step >= term_at, why

    second = make_job("chain", plan=plan, resume_from="latest",
                      debug={"sleep_per_step_s": 0.25}, **job)
    proc = start(second, tmp_path)
    wait_for_step(proc, events, max(kill_at, stopped.step + 1))
    proc.kill()
    proc.wait(30)
    started = [e for e in read_events(events) if e["type"] == "started"]
    assert started[-1]["resumed_from"] == stopped.path, why

    third = make_job("chain", plan=plan, resume_from="latest", **job)
    assert run_job(TrainerJob.from_json(third)) == ExitCode.FINISHED, why
    weights, losses = final_state(out)
    assert losses == ref_losses, why
    if mixed:
        [ref_started] = [e for e in read_events(tmp_path / "ref" / "out" / "events.jsonl")
                         if e["type"] == "started"]
        assert ref_started["mix"]["file:general.jsonl"]["drawn"] > 0
        positions = [e["data_position"] for e in read_events(events) if e["type"] == "progress"]
        assert max(p["window"] for p in positions) >= 2 and \
            max(p["epoch"] for p in positions) >= 1
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), f"{key} differs {why}"


def test_a_trainer_started_with_sigterm_blocked_still_stops_on_it() -> None:
    # A blocked signal survives exec, so a trainer launched by a process that had SIGTERM
    # blocked would never see the stop it checkpoints on: its handlers unblock it.
    code = ("import os, signal\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})\n"
            "from factory.trainer.train import StopFlag, install_signal_handlers\n"
            "flag = StopFlag()\n"
            "install_signal_handlers(flag)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print(flag.event.wait(10), flag.signal)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == ["True", str(int(signal.SIGTERM))]
