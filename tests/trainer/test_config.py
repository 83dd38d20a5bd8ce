"""Job validation: every bad field is named, before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from factory.trainer import train
from factory.trainer.__main__ import main
from factory.trainer.config import TrainerJob


def _job(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    data = tmp_path / "d.parquet"
    data.write_bytes(b"")
    job: dict[str, Any] = {"run_id": "r1", "output_dir": str(tmp_path / "out"),
                           "data_files": [str(data)],
                           "plan": {"base_model": "/nonexistent/model", "max_seq_len": 512,
                                    "learning_rate": 2e-4, "num_steps": 10}}
    for key, value in changes.items():
        if key.startswith("plan."):
            job["plan"][key[5:]] = value
        else:
            job[key] = value
    return job


@pytest.mark.parametrize(("changes", "field"), [
    ({"plan.learning_rate": -1}, "plan.learning_rate"),
    ({"plan.learning_rate": "fast"}, "plan.learning_rate"),
    ({"plan.max_seq_len": 0}, "plan.max_seq_len"),
    ({"plan.micro_batch_size": 1.5}, "plan.micro_batch_size"),
    ({"plan.precision": "fp8"}, "plan.precision"),
    ({"plan.num_epochs": 2}, "plan.num_steps"),
    ({"plan.lora_rnak": 8}, "plan.lora_rnak"),
    ({"plan.lora_dropout": 1.0}, "plan.lora_dropout"),
    ({"plan.parallelism": "fsdp2"}, "plan.num_devices"),
    ({"plan.lora_target_modules": "q_proj"}, "plan.lora_target_modules"),
    ({"run_id": "bad id!"}, "run_id"),
    ({"data_files": ["/no/such.parquet"]}, "data_files"),
    ({"payload_file": "/tmp/x.jsonl"}, "data_files"),
    ({"resume_from": "/no/such/checkpoint"}, "resume_from"),
    ({"webhook_url": "http://x"}, "webhook_key_id"),
    ({"webhook_url": "http://x", "webhook_key_id": "k", "webhook_secret_env": "NOT_SET_ANYWHERE"},
     "webhook_secret_env"),
    ({"output_dir": "s3://bucket/run"}, "events_file"),
    ({"tracker": {"backend": "wandb"}}, "tracker.backend"),
    ({"debug": {"nan_at_step": 0}}, "debug.nan_at_step"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_field_is_named(tmp_path: Path, changes: dict[str, Any], field: str) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_job(tmp_path, **changes)))
    with pytest.raises(ValueError, match=rf"^{field.replace('.', '[.]')}:"):
        TrainerJob.from_json(path)


def test_cli_rejects_a_bad_job_before_loading_anything(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("run_job must not be reached with an invalid job")

    monkeypatch.setattr(train, "run_job", boom)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_job(tmp_path, **{"plan.warmup_steps": -3})))
    assert main(["--job", str(path)]) == 2
    assert "plan.warmup_steps: must be an integer >= 0" in capsys.readouterr().err
    path.write_text(json.dumps(_job(tmp_path)))
    assert main(["--job", str(path), "--check"]) == 0
    assert main(["--job", str(tmp_path / "missing.json")]) == 2


def test_a_valid_job_round_trips(tmp_path: Path) -> None:
    job = TrainerJob.from_dict(_job(tmp_path, **{"plan.packing": False}))
    assert TrainerJob.from_dict(json.loads(json.dumps(job.to_dict()))) == job
    assert job.events_path == tmp_path / "out" / "events.jsonl"
