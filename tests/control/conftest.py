"""Tiny data and trainer jobs for the control-plane tests, and a control loop driver."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.control.plane import ControlPlane
from factory.trainer.config import TrainerJob
from tests.waiting import wait_until

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def write_data(path: Path, n: int = 48, seed: int = 0) -> Path:
    rng = random.Random(seed)
    ids, msgs = [], []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 12))]
        ids.append(f"s{i:04d}")
        msgs.append(json.dumps([
            {"role": "system", "content": [{"type": "text", "text": "Reverse the words."}]},
            {"role": "user", "content": [{"type": "text", "text": " ".join(words)}]},
            {"role": "assistant", "content": [{"type": "text",
                                               "text": " ".join(reversed(words))}]}]))
    pq.write_table(pa.table({"sample_id": ids, "messages": msgs, "tools": ["[]"] * n}), path)
    return path


@pytest.fixture()
def make_job(tmp_path: Path, tiny_model_dir: Path) -> Callable[..., TrainerJob]:
    """A deterministic tiny-model job; keyword arguments override plan fields."""

    def make(run_id: str, *, debug: dict[str, Any] | None = None, **plan: Any) -> TrainerJob:
        data = tmp_path / "data.parquet"
        if not data.exists():
            write_data(data)
        full = {"base_model": str(tiny_model_dir), "max_seq_len": 256, "micro_batch_size": 2,
                "grad_accum_steps": 2, "learning_rate": 3e-3, "warmup_steps": 2,
                "num_steps": 10, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.1,
                "checkpoint_every_steps": 2, "seed": 7, "deterministic": True}
        full.update(plan)
        return TrainerJob.from_dict({"run_id": run_id, "plan": full, "data_files": [str(data)],
                              "output_dir": str(tmp_path / run_id), "tracker": {"backend": "none"},
                              "debug": debug or {}})

    return make


def drive(plane: ControlPlane, run_id: str, *, timeout_s: float,
          on_tick: Callable[[dict[str, Any]], None] | None = None) -> str:
    """Tick the control loop until the run ends; returns its final status."""

    def ended() -> str | None:
        report = plane.tick()
        if on_tick is not None:
            on_tick(report)
        status = plane.runs()[run_id].status
        return None if status in ("queued", "running") else status

    try:
        return wait_until(ended, timeout_s, f"run {run_id} to end")
    except AssertionError as exc:
        segs = plane.segments(run_id)
        logs = "\n".join(Path(s.handle.info["log"]).read_text()[-2000:] for s in segs
                         if "log" in s.handle.info and Path(s.handle.info["log"]).exists())
        raise AssertionError(f"{exc}: {segs}\n{logs}") from None
