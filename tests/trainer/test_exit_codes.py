"""The trainer's exit status says whether retrying can heal a failure: data or configuration
errors exit ``DATA_ERROR`` (65) with a ``failed`` event marked ``data_error``; a crash while
training stays ``FAILED`` (1), the control plane's to recover."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from factory.trainer.config import TrainerJob
from factory.trainer.train import ExitCode, run_job
from factory.trainer.webhooks import read_events
from tests.conftest import ROOT


def _no_answers(path: Path, n: int = 5) -> Path:
    """Conversations that end before any assistant turn: nothing to train on."""
    msgs = [json.dumps([{"role": "user", "content": [{"type": "text", "text": f"hi {i}"}]}])
            for i in range(n)]
    pq.write_table(pa.table({"sample_id": [f"q{i}" for i in range(n)], "messages": msgs,
                             "tools": ["[]"] * n}), path)
    return path


def test_data_without_a_usable_sample_exits_with_the_data_error_code(
        make_job, tmp_path: Path) -> None:
    data = _no_answers(tmp_path / "questions.parquet")
    job_path = make_job("nodata", data_files=[str(data)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "factory.trainer", "--job", str(job_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == ExitCode.DATA_ERROR == 65, proc.stderr[-3000:]
    message = ("data_files: none of the 5 samples can train at max_seq_len 320: "
               "5 no_target")
    assert f"trainer: data or configuration error: {message}" in proc.stderr
    [failed] = [e for e in read_events(TrainerJob.from_json(job_path).events_path)
                if e["type"] == "failed"]
    assert failed["data_error"] is True and failed["error"] == message
    assert failed["data"]["num_dropped_by_reason"]["no_target"] == 5


def test_a_setting_the_base_model_cannot_take_is_a_data_error(make_job) -> None:
    job = TrainerJob.from_json(make_job("badmodules",
                                        plan={"lora_target_modules": ["no_such_proj"]}))
    assert run_job(job) == ExitCode.DATA_ERROR
    [failed] = [e for e in read_events(job.events_path) if e["type"] == "failed"]
    assert failed["data_error"] is True and "no_such_proj" in failed["error"]
    # Setup got as far as the data: its counts are in the report.
    assert failed["data"]["num_examples"] == 24


def test_a_crash_while_training_stays_retryable(make_job, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the checkpoints' folder should be")
    job = TrainerJob.from_json(make_job("crash", output_dir=str(blocker / "out"),
                                 events_file=str(tmp_path / "crash-events.jsonl")))
    assert run_job(job) == ExitCode.FAILED
    events = read_events(job.events_path)
    assert [e["type"] for e in events][0] == "started"
    [failed] = [e for e in events if e["type"] == "failed"]
    assert failed["data_error"] is False and failed["error"].startswith("NotADirectoryError")
    assert failed["step"] == 2  # the first checkpoint step: it trained, then the write failed
