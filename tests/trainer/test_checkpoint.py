"""A checkpoint directory is an inference-ready adapter: plain transformers + PEFT load it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from factory.trainer.chat import CHAT_TEMPLATE, render
from factory.trainer.checkpoint import latest_checkpoint, read_checkpoint, verify_checkpoint
from factory.trainer.config import TrainerJob
from factory.trainer.train import ExitCode, run_job


def test_checkpoint_loads_in_transformers_and_peft_and_generates(make_job, tiny_model_dir: Path
                                                                  ) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = TrainerJob.from_json(make_job("load", plan={"num_steps": 2, "checkpoint_every_steps": 2,
                                               "learning_rate": 5e-2}))
    assert run_job(job) == ExitCode.FINISHED
    info = latest_checkpoint(job.output_dir)
    assert info is not None and info.step == 2
    path = Path(info.path)
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template == CHAT_TEMPLATE
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    with warnings.catch_warnings():  # peft 0.21 probes a deprecated transformers property
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        model = PeftModel.from_pretrained(base, path)
    trained = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert trained and any(p.abs().sum() > 0 for p in trained.values())

    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "red cat"}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == render(messages, [], add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=5, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_checkpoints_go_to_any_fsspec_filesystem(make_job, tmp_path: Path) -> None:
    job = TrainerJob.from_json(make_job("mem", plan={"num_steps": 1, "checkpoint_every_steps": 1},
                                 output_dir="memory://factory-test/run",
                                 events_file=str(tmp_path / "mem-events.jsonl")))
    assert run_job(job) == ExitCode.FINISHED
    info = latest_checkpoint(job.output_dir)
    assert info is not None and info.path == "memory://factory-test/run/checkpoints/step-00000001"
    assert verify_checkpoint(info.path).manifest_sha256 == info.manifest_sha256
    files = read_checkpoint(info.path)
    state = json.loads(files["trainer_state.json"])
    assert state["step"] == 1 and state["data_position"]["microbatch"] == 2
    assert torch.get_rng_state().dtype == torch.uint8
