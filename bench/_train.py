"""What the training benchmarks share: a LoRA plan for SmolLM2-135M and one trainer run in a
subprocess (``python -m factory.trainer``, as the control plane launches it)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of the decoder."""


def canonical(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Canonical messages (text parts) of ``{"role", "content": str}`` messages."""
    return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
            for m in messages]


def write_triage(path: Path, n: int, seed: int) -> Path:
    """``n`` training conversations of the triage task (``factory.tasks.ticket_triage``,
    ``seed``) as a trainer data file: sample ids ``t00000``, ``t00001``..., canonical messages,
    no tools."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from factory.tasks.ticket_triage import generate_conversations

    convs = generate_conversations(n, seed)
    pq.write_table(pa.table({
        "sample_id": [f"t{i:05d}" for i in range(len(convs))],
        "messages": [json.dumps(canonical(c["messages"])) for c in convs],
        "tools": ["[]"] * len(convs)}), path)
    return path


def lora_plan(base_model: str, *, steps: int, lr: float, seq_len: int, seed: int
              ) -> dict[str, Any]:
    """Packed rows of ``seq_len``, 8 rows a step (4 x 2 accumulated), LoRA r=16 on every linear
    layer, bf16 autocast, cosine schedule, no dropout, one checkpoint at the end."""
    return {"base_model": base_model, "max_seq_len": seq_len, "packing": True,
            "micro_batch_size": 4, "grad_accum_steps": 2, "learning_rate": lr,
            "lr_schedule": "cosine", "warmup_steps": 2, "num_steps": steps, "lora_rank": 16,
            "lora_alpha": 32.0, "lora_dropout": 0.0, "lora_target_modules": TARGETS,
            "precision": "bf16-autocast", "checkpoint_every_steps": 10_000, "seed": seed}


def train(name: str, work: Path, data: dict[str, Any], plan: dict[str, Any],
          threads: int | None) -> tuple[Path, list[dict[str, Any]]]:
    """Run the trainer on ``data`` (the job's ``data_files`` or ``mix``) in a subprocess:
    (the final checkpoint's directory, the run's events)."""
    from factory.trainer.checkpoint import latest_checkpoint

    job = {"run_id": name, "output_dir": str(work / name), "plan": plan, **data}
    (work / f"{name}.json").write_text(json.dumps(job))
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "factory.trainer", "--job",
                        str(work / f"{name}.json")], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=log)
    info = latest_checkpoint(str(work / name))
    assert info is not None, f"{name}: no checkpoint"
    events = [json.loads(x) for x in (work / name / "events.jsonl").read_text().splitlines()
              if x.strip()]
    return Path(info.path), events


def start(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, str]:
    """Parse the arguments (``--threads`` sets torch's), check SmolLM2 is built and print the
    run's header line (cores, load, arguments): (the arguments, the SmolLM2 folder)."""
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from factory.base_model import smollm2_dir

    base = str(smollm2_dir())
    if not (Path(base) / "config.json").is_file():
        parser.error(f"no SmolLM2 at {base}: run `factory base-model` (or set FACTORY_MODELS_DIR)")
    print(json.dumps({"cpus": os.cpu_count(),
                      "loadavg_before": [round(x, 2) for x in os.getloadavg()], **vars(args)}),
          flush=True)
    return args, base


def load_for_scoring(base_model: str, adapter: Path | None) -> tuple[Any, Any]:
    """(tokenizer with the trainer's chat template, the model in eval mode with ``adapter``
    applied when given) for teacher-forced scoring."""
    import torch
    from transformers import AutoModelForCausalLM

    from factory.trainer.chat import install_chat_template, load_tokenizer

    tok = install_chat_template(load_tokenizer(base_model))
    model: Any = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    return tok, model
