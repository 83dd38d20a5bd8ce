"""RMSNorm kernel against its torch reference: output, input grad and weight grad per dtype."""

from __future__ import annotations

import pytest
import torch

from factory.kernels import _utils
from factory.kernels.rms_norm import RMSNorm, rms_norm, rms_norm_reference

# Tolerances. float32: kernel and reference differ only in summation order of the row
# statistics (observed <= 1e-6 on these shapes). bfloat16 keeps 8 mantissa bits (eps 7.8e-3):
# both compute in float32, but round intermediates at different points (the kernel keeps the
# weight product and gradients in float32), so results may differ by 2 ulp = 1.6e-2 relative.
# float16 has 11 bits (eps 9.8e-4): same argument, 2 ulp = 2e-3. (Triton 3.9's CPU interpreter
# also truncates float32 -> bfloat16 instead of rounding to nearest: one of those 2 ulp.)
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}
# A single row, odd non-power-of-two shapes with a 3-D batch, and a long row (3001 > 2048).
SHAPES = [(1, 37), (3, 5, 67), (2, 3001)]


def _run(fn, x, w, offset, grad):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w, 1e-6, offset)
    dx, dw = torch.autograd.grad(y, (x, w), grad)
    return y, dx, dw


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_reference(shape, dtype, offset, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.1 + (1.0 - offset)).to(device, dtype)
    grad = torch.randn(shape, generator=gen).to(device, dtype)
    y, dx, dw = _run(rms_norm, x, w, offset, grad)
    y_ref, dx_ref, dw_ref = _run(rms_norm_reference, x, w, offset, grad)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    # dw sums rows whose terms can cancel: its error scales with the terms (bounded below by
    # the largest |dw|) times sqrt(rows), not with each small result.
    rows = x.numel() // shape[-1]
    scale = max(1.0, rows**0.5) * max(1.0, float(dw_ref.abs().max()))
    tol = {k: v * scale for k, v in TOL[dtype].items()}
    torch.testing.assert_close(dw, dw_ref, **tol)


def test_mixed_weight_dtype_promotes_like_llama(device):
    x = torch.randn(3, 37, device=device, dtype=torch.bfloat16)
    w = torch.randn(37, device=device, dtype=torch.float32)
    y = rms_norm(x, w)
    assert y.dtype == torch.float32 == rms_norm_reference(x, w).dtype
    # x_hat is rounded to bfloat16 before the float32 weight multiply: bfloat16 tolerance.
    torch.testing.assert_close(y, rms_norm_reference(x, w), **TOL[torch.bfloat16])


def test_non_contiguous_input(device):
    x = torch.randn(37, 6, device=device).t()  # strides (1, 6): the kernel must copy
    w = torch.randn(37, device=device)
    torch.testing.assert_close(rms_norm(x, w), rms_norm_reference(x, w), **TOL[torch.float32])


def test_gradcheck_float64(device):
    # One non-zero offset: in float64 the offset-0 path differs only by a no-op cast.
    x = torch.randn(2, 5, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, device=device, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6, 0.5), (x, w))


def test_module_shares_weight_and_state_dict(device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    stock = LlamaRMSNorm(37, eps=1e-5).to(device)
    with torch.no_grad():
        stock.weight.normal_()
    ours = RMSNorm.from_module(stock)
    assert ours.weight is stock.weight and ours.variance_epsilon == 1e-5
    assert list(ours.state_dict()) == list(stock.state_dict())
    x = torch.randn(4, 37, device=device)
    torch.testing.assert_close(ours(x), stock(x), **TOL[torch.float32])
    fresh = RMSNorm(37, device=device)
    fresh.load_state_dict(stock.state_dict())
    torch.testing.assert_close(fresh(x), stock(x), **TOL[torch.float32])


def test_bad_weight_shape_is_a_value_error(device):
    with pytest.raises(ValueError, match="does not match"):
        rms_norm(torch.randn(2, 8, device=device), torch.randn(7, device=device))


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_utils, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 8), torch.randn(8))
