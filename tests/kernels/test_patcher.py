"""apply_kernels on tiny transformers models: same logits, same loss and grads, stock state dict."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from factory.kernels import patcher
from factory.kernels.gated_rms_norm import GatedRMSNorm
from factory.kernels.patcher import KernelsWarning, apply_kernels
from factory.kernels.rms_norm import RMSNorm

transformers = pytest.importorskip("transformers")

# peft 0.21 calls transformers 5's deprecated ``is_gradient_checkpointing`` in get_peft_model.
PEFT_DEPRECATION = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

# float32 throughout: patched and stock differ only in summation order inside the kernels
# (observed <= 1e-6 on these models); a few 1e-6 relative errors compound over two layers.
TOL = {"rtol": 1e-4, "atol": 1e-5}
VOCAB = 211
# One decoder layer: every interpreted kernel launch costs ~50 ms, and a second layer would
# exercise the same modules again.
COMMON: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 96,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64}


def _build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=12))
    if family == "gemma3_text":
        config = transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 2}, head_dim=12, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"])
        model = transformers.Gemma3ForCausalLM(config)
        _scramble_norms(model)
        return model
    assert family == "qwen3_5_text"
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    config = Qwen3_5TextConfig(
        **{**COMMON, "num_hidden_layers": 2}, head_dim=12,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=12,
        linear_value_head_dim=12,
    )
    model = Qwen3_5ForCausalLM(config)
    _scramble_norms(model)
    return model


def _scramble_norms(model: torch.nn.Module) -> None:
    with torch.no_grad():  # zero-init offset weights would hide a wrong offset
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)


def _batch(device):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :4] = -100  # assistant-only: the prompt half carries no loss
    return ids, labels


def _loss_and_grads(model, ids, labels, **kw):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_5_text", "gemma3_text"])
def test_patched_model_matches_stock(family, device):
    stock = _build(family).to(device)
    patched = copy.deepcopy(stock)
    report = apply_kernels(patched, lora=False)
    assert report.model_type == family and report.cross_entropy is not None
    num_norms = sum(isinstance(m, RMSNorm | GatedRMSNorm) for m in patched.modules())
    assert num_norms == len(report.rms_norm) + len(report.gated_rms_norm) >= 3
    if family == "qwen3_5_text":
        assert report.gated_rms_norm and all(isinstance(patched.get_submodule(n), GatedRMSNorm)
                                             for n in report.gated_rms_norm)
    ids, labels = _batch(device)

    stock.eval()
    patched.eval()
    with torch.no_grad():
        logits = stock(input_ids=ids).logits
        torch.testing.assert_close(patched(input_ids=ids).logits, logits, **TOL)
        # The patched state dict is the stock layout: it loads strictly and gives the same logits.
        fresh = _build(family).to(device)
        fresh.load_state_dict(patched.state_dict(), strict=True)
        fresh.eval()
        torch.testing.assert_close(fresh(input_ids=ids).logits, logits, **TOL)
        assert sorted(patched.state_dict()) == sorted(stock.state_dict())

    want, want_grads = _loss_and_grads(stock, ids, labels)
    got, got_grads = _loss_and_grads(patched, ids, labels)
    assert got.logits is None  # training with labels never builds the logits
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_num_items_in_batch_and_eval_mode_follow_transformers(device):
    stock = _build("llama").to(device)
    patched = copy.deepcopy(stock)
    apply_kernels(patched, lora=False, cross_entropy_chunk_size=3)
    ids, labels = _batch(device)
    num_items = torch.tensor(7, device=device)
    want, _ = _loss_and_grads(stock, ids, labels, num_items_in_batch=num_items)
    got, _ = _loss_and_grads(patched, ids, labels, num_items_in_batch=num_items)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    patched.eval()
    with torch.no_grad():  # eval with labels: the stock path, logits included
        out = patched(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.shape == (2, 9, VOCAB)


def _peft(model, dropout=0.0):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"])
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():  # B starts at zero, which would hide a wrong adapter path
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return wrapped


@PEFT_DEPRECATION
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v carry a frozen bias
def test_peft_lora_layers_are_fused(family, device):
    stock = _peft(_build(family).to(device))
    patched = copy.deepcopy(stock)
    report = apply_kernels(patched)
    assert len(report.lora) == 7 and report.rms_norm and report.cross_entropy
    assert all("lora" not in n for n in report.rms_norm)
    ids, labels = _batch(device)
    want, want_grads = _loss_and_grads(stock, ids, labels)
    got, got_grads = _loss_and_grads(patched, ids, labels)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert got_grads.keys() == want_grads.keys()
    assert all("lora_" in n for n in got_grads)  # frozen base weights never get a grad
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # Disabled adapters fall back to PEFT's own forward: the base model's logits.
    patched.eval()
    stock.eval()
    with torch.no_grad(), patched.disable_adapter(), stock.disable_adapter():
        torch.testing.assert_close(patched(input_ids=ids).logits, stock(input_ids=ids).logits,
                                   **TOL)
    assert sorted(patched.state_dict()) == sorted(stock.state_dict())


@PEFT_DEPRECATION
def test_peft_under_bf16_autocast_matches_stock(device):
    stock = _peft(_build("llama").to(device))
    patched = copy.deepcopy(stock)
    apply_kernels(patched)
    ids, labels = _batch(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        want, _ = _loss_and_grads(stock, ids, labels)
        got, _ = _loss_and_grads(patched, ids, labels)
    # bf16 matmuls (eps 7.8e-3) round at different points in kernel and eager: the loss, an
    # average of float32 log-sum-exps over bf16 logits, agrees to about 1e-2 relative.
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-2, atol=2e-2)


@PEFT_DEPRECATION
def test_peft_dropout_trains(device):
    model = _peft(_build("llama").to(device), dropout=0.3)
    apply_kernels(model)
    ids, labels = _batch(device)
    out, grads = _loss_and_grads(model, ids, labels)
    assert torch.isfinite(out.loss) and len(grads) == 7 * 2
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_gemma3_with_a_logit_cap_keeps_its_stock_loss(device):
    stock = _build("gemma3_text").to(device)
    stock.config.final_logit_softcapping = 5.0
    patched = copy.deepcopy(stock)
    with pytest.warns(KernelsWarning, match="caps its logits at 5.0"):
        report = apply_kernels(patched, lora=False)
    assert report.rms_norm and report.cross_entropy is None and "forward" not in vars(patched)
    ids, labels = _batch(device)
    want, _ = _loss_and_grads(stock, ids, labels)
    got, _ = _loss_and_grads(patched, ids, labels)
    torch.testing.assert_close(got.loss, want.loss, **TOL)


def test_unsupported_family_is_left_untouched_with_a_warning(device):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2,
                                     n_positions=32)
    model = transformers.GPT2LMHeadModel(config).to(device)
    before = [type(m) for m in model.modules()]
    with pytest.warns(KernelsWarning, match="'gpt2' is not supported"):
        report = apply_kernels(model)
    assert not report.applied and report.skipped
    assert [type(m) for m in model.modules()] == before and "forward" not in vars(model)


def test_unusable_device_is_left_untouched_with_a_warning(monkeypatch, device):
    monkeypatch.setattr(patcher, "supports_kernels", lambda _device: False)
    model = _build("llama").to(device)
    with pytest.warns(KernelsWarning, match="cannot run on"):
        report = apply_kernels(model)
    assert not report.applied
    assert not any(isinstance(m, RMSNorm) for m in model.modules())


def test_switches_and_bad_arguments(device):
    model = _build("llama").to(device)
    report = apply_kernels(model, rms_norm=False, lora=False, cross_entropy=False)
    assert not report.applied and not report.skipped
    report = apply_kernels(model, rms_norm=True, lora=False, cross_entropy=False)
    assert report.rms_norm and report.cross_entropy is None and "forward" not in vars(model)
    with pytest.raises(ValueError, match="chunk_size"):
        apply_kernels(model, cross_entropy_chunk_size=-1)
