"""FSDP2 (``fully_shard``) on CPU: two gloo processes train like one process with the same
global batch, their checkpoint holds the gathered adapter only, and a sharded run resumed from
it ends bitwise equal."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from factory.trainer.checkpoint import latest_checkpoint
from factory.trainer.config import TrainerJob
from factory.trainer.train import ExitCode, run_job
from factory.trainer.webhooks import read_events
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def run(job: Path, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "factory.trainer", "--job", str(job)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]


def test_two_gloo_processes_match_one_process(make_job, tmp_path: Path) -> None:
    common = {"num_steps": 2, "checkpoint_every_steps": 1, "lora_dropout": 0.0}
    sharded = make_job("fsdp", plan={**common, "num_devices": 2, "parallelism": "fsdp2",
                                     "grad_accum_steps": 1})
    run(sharded, tmp_path)

    single = TrainerJob.from_json(make_job("single", plan={**common, "grad_accum_steps": 2}))
    assert run_job(single) == ExitCode.FINISHED

    def losses(out: Path) -> list[float]:
        return [e["loss"] for e in read_events(out / "events.jsonl") if e["type"] == "progress"]

    started = [e for e in read_events(tmp_path / "fsdp" / "out" / "events.jsonl")
               if e["type"] == "started"]
    assert started[0]["world_size"] == 2
    sharded_losses, single_losses = losses(tmp_path / "fsdp" / "out"), losses(
        tmp_path / "single" / "out")
    assert len(sharded_losses) == 2
    # Same global batch, different reduction order (reduce-scatter vs local accumulation).
    assert sharded_losses == pytest.approx(single_losses, rel=1e-5)
    a = latest_checkpoint(str(tmp_path / "fsdp" / "out"))
    b = latest_checkpoint(single.output_dir)
    assert a is not None and b is not None
    wa = load_file(Path(a.path) / "adapter_model.safetensors")
    wb = load_file(Path(b.path) / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all("lora_" in k for k in wa)
    for k in wa:
        assert wa[k].shape == wb[k].shape  # gathered, not a shard
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)

    # Resume the sharded run from its step-1 checkpoint (copied away) in a fresh output: the
    # sharded adapter and optimizer state load back and step 2 comes out bitwise the same.
    step1 = tmp_path / "step1"
    shutil.copytree(tmp_path / "fsdp" / "out" / "checkpoints" / "step-00000001", step1)
    resumed = make_job("fsdp", plan={**common, "num_devices": 2, "parallelism": "fsdp2",
                                     "grad_accum_steps": 1},
                       output_dir=str(tmp_path / "resumed"), resume_from=str(step1))
    run(resumed, tmp_path)
    c = latest_checkpoint(str(tmp_path / "resumed"))
    assert c is not None and c.step == 2
    wc = load_file(Path(c.path) / "adapter_model.safetensors")
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    assert losses(tmp_path / "resumed") == sharded_losses[1:]
