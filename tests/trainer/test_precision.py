"""bf16 autocast only where the CPU computes bf16: on a CPU that would emulate it (an AVX2-only
x86, 22x slower per step than fp32 in ``bench/cpu_precision.py``), the trainer runs fp32 and its
``started`` event says why; elsewhere it runs the plan's precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factory.trainer import precision
from factory.trainer.config import TrainerJob
from factory.trainer.train import ExitCode, run_job
from factory.trainer.webhooks import read_events


@pytest.mark.parametrize(("machine", "flags", "native", "says"), [
    ("x86_64", {"fpu", "avx", "avx2", "fma"}, False, "avx2 without avx512_bf16 or amx_bf16"),
    ("x86_64", {"avx2", "avx512f"}, False, "avx512f without"),
    ("x86_64", {"avx2", "avx512f", "avx512_bf16"}, True, "avx512_bf16"),
    ("x86_64", {"avx2", "amx_bf16", "amx_tile"}, True, "amx_bf16"),
    ("aarch64", {"fp", "asimd", "bf16"}, True, "Arm BF16 extension"),
    ("aarch64", {"fp", "asimd"}, False, "Arm without the BF16 extension"),
])
def test_the_cpu_flags_say_whether_bf16_is_native(monkeypatch: pytest.MonkeyPatch, machine: str,
                                                  flags: set[str], native: bool,
                                                  says: str) -> None:
    monkeypatch.delenv("FACTORY_CPU_BF16", raising=False)
    monkeypatch.setattr(precision.platform, "machine", lambda: machine)
    monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
    got, what = precision.cpu_bf16()
    assert got is native and says in what
    run, note = precision.effective_precision("bf16-autocast", "cpu")
    assert run == ("bf16-autocast" if native else "fp32")
    assert (note is None) is native
    # Only CPU bf16 autocast is resolved: a GPU, or another precision, runs as planned.
    assert precision.effective_precision("bf16-autocast", "cuda") == ("bf16-autocast", None)
    assert precision.effective_precision("fp32", "cpu") == ("fp32", None)
    assert precision.effective_precision("bf16", "cpu") == ("bf16", None)


def test_this_machines_flags_are_read() -> None:
    flags = precision._cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    assert flags & {"fpu", "fp", "sse2", "asimd"}  # the flags line, split into names


@pytest.mark.parametrize(("cpu", "ran"), [("emulated", "fp32"), ("native", "bf16-autocast")])
def test_the_trainer_runs_and_reports_the_precision_of_its_cpu(
        make_job, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpu: str, ran: str) -> None:
    monkeypatch.setenv("FACTORY_CPU_BF16", cpu)
    seen: list[bool] = []
    real = torch.autocast

    def spy(device_type: str, *args, **kwargs):  # what each forward ran under
        ctx = real(device_type, *args, **kwargs)
        seen.append(bool(ctx._enabled))
        return ctx

    monkeypatch.setattr(torch, "autocast", spy)
    job = TrainerJob.from_json(make_job(f"p-{cpu}", plan={"num_steps": 2,
                                                   "precision": "bf16-autocast"}))
    assert run_job(job) == ExitCode.FINISHED
    [started] = [e for e in read_events(job.events_path) if e["type"] == "started"]
    assert (started["precision"]["planned"], started["precision"]["ran"]) == \
        ("bf16-autocast", ran)
    if ran == "fp32":
        assert "bf16-autocast planned, fp32 run" in started["precision"]["reason"]
        assert "FACTORY_CPU_BF16=emulated" in started["precision"]["reason"]
    else:
        assert started["precision"]["reason"] is None
    assert seen and all(enabled == (ran == "bf16-autocast") for enabled in seen)
