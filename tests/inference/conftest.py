"""One CPU server on the tiny model for the whole folder (starting one costs ~10-20 s here), and
the adapters the tests serve: random ones (``make_adapter``) and one trained to call tools
(``train_adapter``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from factory.inference import InferenceServer


def make_adapter(base: Path, dest: Path, *, seed: int, template: str | None = None) -> Path:
    """A LoRA adapter with random (non-zero) weights, saved like a trainer checkpoint's
    inference files: adapter + tokenizer carrying the trainer's chat template (or ``template``)."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.trainer.chat import install_chat_template

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        peft_model = get_peft_model(model, cfg)
    peft_model.save_pretrained(str(dest))
    tok = install_chat_template(AutoTokenizer.from_pretrained(str(base)))
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(dest))
    return dest


def train_adapter(base: Path, dest: Path, sample: dict[str, Any], *, name: str) -> Path:
    """A LoRA adapter of ``base`` trained on one canonical ``sample`` until greedy decoding
    writes its last assistant turn, saved like a trainer checkpoint's inference files (adapter +
    tokenizer carrying the trainer's chat template); built once into ``dest`` (kept across
    runs)."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.trainer.base_models import _atomic_save, is_built
    from factory.trainer.chat import encode, install_chat_template

    if is_built(dest):
        return dest

    def save(tmp: Path) -> dict[str, object]:
        tok = install_chat_template(AutoTokenizer.from_pretrained(str(base)))
        ids, labels = encode(sample["messages"], sample.get("tools"), tok)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                             "o_proj", "gate_proj", "up_proj",
                                                             "down_proj"],
                         task_type="CAUSAL_LM")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            peft_model = get_peft_model(model, cfg)
        inputs = torch.tensor([ids])
        # Position i predicts token i + 1: keep only the logits of trained targets.
        keep = torch.tensor([i - 1 for i, lab in enumerate(labels) if lab != -100])
        targets = inputs[0, keep + 1]
        opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=2e-3)
        # Until every target has probability over 0.95: each is then the argmax, so greedy
        # decoding writes the answer token by token, on any engine whose log-probs are within
        # 1e-3 of these (vLLM's fp32 CPU path: 2.6e-4).
        steps, worst = 0, float("inf")
        while worst >= 0.05 and steps < 400:
            logits = peft_model(input_ids=inputs, logits_to_keep=keep).logits[0]
            per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            opt.zero_grad()
            per_token.mean().backward()
            opt.step()
            steps, worst = steps + 1, per_token.max().item()
        assert worst < 0.05, f"not learned after {steps} steps: worst target loss {worst:.3f}"
        peft_model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        return {"name": name, "source": str(base), "steps": steps}

    return _atomic_save(dest, save)


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    wrong = ("{%- for m in messages -%}{{ '<|im_start|>' + m.role + ': ' }}"
             "{{ m.content if m.content is string else m.content[0].text }}"
             "{{ '<|im_end|>\\n' }}{%- endfor -%}"
             "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant: ' }}{%- endif -%}")
    return {"good": make_adapter(tiny_model_dir, root / "good", seed=1),
            "other": make_adapter(tiny_model_dir, root / "other", seed=2),
            "wrong_template": make_adapter(tiny_model_dir, root / "wrong", seed=1,
                                           template=wrong)}


@pytest.fixture(scope="session")
def cpu_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[InferenceServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with InferenceServer(tiny_model_dir, served_model_name="base", log_path=log,
                         startup_timeout_s=240, threads=1) as server:
        yield server
