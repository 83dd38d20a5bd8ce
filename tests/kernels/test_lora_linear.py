"""Fused LoRA linear against PEFT's formula: output, x / A / B grads, dropout, frozen base."""

from __future__ import annotations

import pytest
import torch

from factory.kernels.lora_linear import LoRALinear, lora_linear, lora_linear_reference

# (activation/base dtype, adapter dtype) -> tolerance. float32: the Triton GEMM and torch's
# matmul sum K products in different orders (observed <= 5e-7 relative). bfloat16 (eps 7.8e-3):
# PEFT rounds the base GEMM to bf16 before adding the adapter term and rounds again; the kernel
# adds in float32 and rounds once (and the CPU interpreter truncates), so up to 2 ulp = 1.6e-2.
# The bf16-base / float32-adapter case is PEFT's default for bf16 models (adapters upcast).
CASES = {
    (torch.float32, torch.float32): {"rtol": 1e-5, "atol": 1e-5},
    (torch.bfloat16, torch.bfloat16): {"rtol": 1.6e-2, "atol": 1.6e-2},
    (torch.bfloat16, torch.float32): {"rtol": 1.6e-2, "atol": 1.6e-2},
    (torch.float16, torch.float16): {"rtol": 2e-3, "atol": 2e-3},
}
# (leading shape, K, N, rank): a single row, odd sizes over tile edges, a long K row and rank 1.
SHAPES = [((1,), 37, 45, 3), ((2, 7), 37, 45, 8), ((3,), 300, 67, 1)]


def _inputs(lead, k, n, r, dtype, adapter_dtype, device, bias):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(*lead, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    a = (torch.randn(r, k, generator=gen) / k**0.5).to(device, adapter_dtype)
    b = torch.randn(n, r, generator=gen).to(device, adapter_dtype)
    bias_t = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    grad = torch.randn(*lead, n, generator=gen).to(device, dtype)
    return x, w, a, b, bias_t, grad


def _run(fn, x, w, a, b, bias, grad, **kw):
    x, a, b = (t.detach().clone().requires_grad_(True) for t in (x, a, b))
    y = fn(x, w, a, b, scale=1.5, bias=bias, **kw)
    return (y, *torch.autograd.grad(y, (x, a, b), grad))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtypes", list(CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(shape, dtypes, bias, device):
    lead, k, n, r = shape
    x, w, a, b, bias_t, grad = _inputs(lead, k, n, r, *dtypes, device, bias)
    got = _run(lora_linear, x, w, a, b, bias_t, grad)
    want = _run(lora_linear_reference, x, w, a, b, bias_t, grad)
    assert got[0].dtype == want[0].dtype == dtypes[0]
    for name, g, e in zip(("y", "dx", "dA", "dB"), got, want, strict=True):
        # Every element is a dot product whose terms can cancel, so its rounding error scales
        # with the terms (bounded below by the largest |output|), not with the element itself;
        # adapter grads also sum over rows: another sqrt(rows).
        rows = x.numel() // k if name in ("dA", "dB") else 1
        scale = max(1.0, rows**0.5) * max(1.0, float(e.detach().abs().max()))
        tol = {"rtol": CASES[dtypes]["rtol"], "atol": CASES[dtypes]["atol"] * scale}
        torch.testing.assert_close(g, e, **tol, msg=lambda m, nm=name: f"{nm}: {m}")


def test_dropout_matches_reference_with_same_mask(device):
    x, w, a, b, bias_t, grad = _inputs((2, 5), 37, 45, 3, torch.float32, torch.float32, device,
                                       True)
    torch.manual_seed(7)
    got = _run(lora_linear, x, w, a, b, bias_t, grad, dropout_p=0.3)
    # The kernel draws its keep-mask with bernoulli_(1 - p) on x's shape: redraw it the same way.
    torch.manual_seed(7)
    keep = torch.empty(10, 37, dtype=torch.bool, device=device).bernoulli_(0.7).view(2, 5, 37)
    assert 0 < int(keep.sum()) < keep.numel()
    want = _run(lora_linear_reference, x, w, a, b, bias_t, grad, dropout_mask=keep,
                dropout_p=0.3)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_gradcheck_float64(dropout_p, device):
    # Tiny and fast_mode (one random projection per input instead of one perturbation per
    # element): each interpreted GEMM launch costs ~0.1 s, full mode took over two minutes.
    x = torch.randn(2, 3, 5, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, device=device, dtype=torch.float64)
    bias = torch.randn(7, device=device, dtype=torch.float64)
    a = torch.randn(2, 5, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 2, device=device, dtype=torch.float64, requires_grad=True)

    def fn(x_, a_, b_):
        torch.manual_seed(0)  # the same dropout mask on every gradcheck evaluation
        return lora_linear(x_, w, a_, b_, scale=0.5, bias=bias, dropout_p=dropout_p)

    assert torch.autograd.gradcheck(fn, (x, a, b), fast_mode=True)


def test_base_weight_never_gets_a_grad(device):
    layer = LoRALinear(torch.nn.Linear(37, 45).to(device), rank=4, alpha=8)
    with torch.no_grad():
        layer.lora_B.normal_()
    layer(torch.randn(3, 37, device=device)).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    assert layer.lora_A.grad is not None and layer.lora_B.grad is not None
    assert sorted(layer.state_dict()) == ["bias", "lora_A", "lora_B", "weight"]


def test_trainable_base_weight_is_a_value_error(device):
    x, w, a, b, _, _ = _inputs((2,), 37, 45, 3, torch.float32, torch.float32, device, False)
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(x, w.requires_grad_(True), a, b, scale=1.0)


def test_shape_mismatch_is_a_value_error(device):
    x, w, a, b, _, _ = _inputs((2,), 37, 45, 3, torch.float32, torch.float32, device, False)
    with pytest.raises(ValueError, match="shape mismatch"):
        lora_linear(x, w, a, b.t(), scale=1.0)
