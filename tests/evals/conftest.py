"""Eval test helpers: an experiment with an eval set in the lake, and inference-ready adapters.

An adapter directory here has the inference files of a trainer checkpoint
(``trainer/checkpoint.py``): the PEFT adapter, the tokenizer carrying the trainer's chat template,
and a ``trainer_state.json`` with the loss history the report plots.
"""

from __future__ import annotations

import json
import warnings
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from factory.tasks import generate_conversations


def canonical_rows(n: int, *, seed: int, experiment: str = "support",
                   split: str = "eval") -> list[dict[str, Any]]:
    """``dataset_eval``/``dataset_train`` rows of the embedded extraction task."""
    rows = []
    for i, conv in enumerate(generate_conversations(n, seed)):
        messages = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                    for m in conv["messages"]]
        sid = f"{split}-{seed}-{i:03d}"
        rows.append({"experiment": experiment, "sample_id": sid, "raw_trace_id": sid,
                     "source": "upload", "provider": "openai", "model": "gpt-4o",
                     "messages": json.dumps(messages), "tools": "[]", "num_turns": 1,
                     "has_images": False, "has_tool_calls": False, "project": "support",
                     "tags": [("project", "support")], "split": split, "split_group": sid,
                     "language": "en"})
    return rows


def write_experiment(home: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                     name: str = "support") -> Path:
    exps = home / "experiments"
    exps.mkdir(exist_ok=True)
    path = exps / f"{name}.yaml"
    path.write_text(text)
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(exps))
    return path


def make_adapter(base: Path, dest: Path, *, seed: int,
                 loss_history: list[list[float]] | None = None) -> Path:
    """A LoRA adapter with random (non-zero) weights, saved with the inference files of a
    trainer checkpoint."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.trainer.chat import install_chat_template

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft 0.21 probes a deprecated transformers property
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        peft_model = get_peft_model(model, cfg)
    peft_model.save_pretrained(str(dest))
    install_chat_template(AutoTokenizer.from_pretrained(str(base))).save_pretrained(str(dest))
    history = loss_history or []
    (dest / "trainer_state.json").write_text(json.dumps({
        "step": int(history[-1][0]) if history else 0, "loss_history": history}))
    return dest


class JudgeHandler(BaseHTTPRequestHandler):
    """A judge model on 127.0.0.1: 9/10 for answers mentioning refund, 2/10 otherwise, and
    never the JSON asked for when the prompt says BROKEN."""

    calls: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        user = body["messages"][1]["content"]
        if "BROKEN" in user:
            content = "I think it is a 7/10."  # never the JSON asked for
        else:
            names = [ln[2:].split(":")[0] for ln in user.split("## Criteria\n")[1].splitlines()]
            good = "refund" in user.split("## Answer to judge")[1]
            content = json.dumps({"criteria": [
                {"name": n, "score": 9 if good else 2, "assessment": "judged by the stub"}
                for n in names]})
        reply = json.dumps({"choices": [{"message": {"role": "assistant",
                                                     "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
