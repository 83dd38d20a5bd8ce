"""The embedded base model is a plain HF directory that loads and answers a chat message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.mark.slow
def test_smollm2_directory_loads_and_answers(smollm2_dir: Path) -> None:
    assert (smollm2_dir / "config.json").is_file()
    assert list(smollm2_dir.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_base_model_asset_records_row(factory_home: Path, smollm2_dir: Path) -> None:
    import dagster as dg

    from factory.assets.base_model import base_model
    from factory.lake import Lake
    from factory.resources.lake import LakeResource

    result = dg.materialize([base_model], resources={"lake": LakeResource()})
    assert result.success
    [row] = Lake().read("base_models").to_pylist()
    assert row["name"] == "smollm2-135m-instruct"
    assert row["num_parameters"] > 100_000_000
    assert len(row["sha256"]) == 64
