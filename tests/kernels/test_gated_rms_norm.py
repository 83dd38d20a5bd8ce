"""Gated RMSNorm kernel against its torch reference: output, x, gate and weight grads per dtype."""

from __future__ import annotations

import pytest
import torch

from factory.kernels.gated_rms_norm import GatedRMSNorm, gated_rms_norm, gated_rms_norm_reference

# Same reasoning as the RMSNorm tolerances, with one more float32 product (the SiLU gate) that
# the reference rounds to the input dtype at a different point than the kernel: float32 differs
# by summation order only; bfloat16 (eps 7.8e-3) and float16 (eps 9.8e-4) by up to 2 ulp.
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}
SHAPES = [(1, 37), (3, 5, 67), (2, 3001)]


def _run(fn, x, z, w, offset, grad):
    x, z, w = (t.detach().clone().requires_grad_(True) for t in (x, z, w))
    y = fn(x, z, w, 1e-6, offset)
    return (y, *torch.autograd.grad(y, (x, z, w), grad))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_reference(shape, dtype, offset, device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    z = (torch.randn(shape, generator=gen) * 2).to(device, dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.1 + (1.0 - offset)).to(device, dtype)
    grad = torch.randn(shape, generator=gen).to(device, dtype)
    got = _run(gated_rms_norm, x, z, w, offset, grad)
    want = _run(gated_rms_norm_reference, x, z, w, offset, grad)
    assert got[0].dtype == want[0].dtype == dtype
    for name, a, b in zip(("y", "dx", "dgate"), got[:3], want[:3], strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")
    # dw sums rows whose terms can cancel: its error scales with the terms (bounded below by
    # the largest |dw|) times sqrt(rows), not with each small result.
    rows = x.numel() // shape[-1]
    scale = max(1.0, rows**0.5) * max(1.0, float(want[3].detach().abs().max()))
    tol = {k: v * scale for k, v in TOL[dtype].items()}
    torch.testing.assert_close(got[3], want[3], **tol)


def test_gradcheck_float64(device):
    # One non-zero offset: in float64 the offset-0 path differs only by a no-op cast.
    x, z = (torch.randn(2, 5, device=device, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    w = torch.randn(5, device=device, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, g, b: gated_rms_norm(a, g, b, 1e-6, 0.5),
                                    (x, z, w))


def test_module_matches_qwen3_5_gated_norm(device):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    stock = Qwen3_5RMSNormGated(24, eps=1e-6).to(device)
    with torch.no_grad():
        stock.weight.normal_()
    ours = GatedRMSNorm.from_module(stock)
    assert ours.weight is stock.weight
    x, z = torch.randn(2, 3, 24, device=device), torch.randn(2, 3, 24, device=device)
    torch.testing.assert_close(ours(x, z), stock(x, z), **TOL[torch.float32])


def test_gate_shape_mismatch_is_a_value_error(device):
    with pytest.raises(ValueError, match="gate shape"):
        gated_rms_norm(torch.randn(2, 8, device=device), torch.randn(2, 7, device=device),
                       torch.ones(8, device=device))
