"""One CPU server on the tiny model for the whole folder (starting one costs ~10-20 s here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
