"""Fused linear + cross-entropy against full-logits torch: loss, hidden/weight/bias grads."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from factory.kernels.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyLoss,
    default_chunk_size,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)

# The loss is a float32 (float64) mean of per-row log-sum-exps: float32 differs by summation
# order only (observed <= 1e-6 relative). For bfloat16 both sides compute the same bf16 logits
# (same matmul) and upcast them, so the loss agrees to float32 precision; the gradients are
# rounded to bf16 (eps 7.8e-3) once per chunk product and, in the interpreter, truncated: 2 ulp,
# scaled by the largest |grad| because each element is a dot product whose terms can cancel.
TOL = {
    torch.float32: {"loss": 1e-5, "grad": 1e-5},
    torch.bfloat16: {"loss": 1e-4, "grad": 1.6e-2},
}
# (leading shape, hidden, vocab): a single token, an odd 2-D batch, a long vocabulary row.
SHAPES = [((1,), 37, 1001), ((3, 7), 37, 1001), ((2, 5), 24, 5003)]


def _inputs(lead, h, v, dtype, device, bias):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(*lead, h, generator=gen).to(device, dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype)
    bias_t = (torch.randn(v, generator=gen) * 0.1).to(device, dtype) if bias else None
    target = torch.randint(0, v, lead, generator=gen).to(device)
    target.view(-1)[1::3] = -100  # the prompt side of an assistant-only mask
    return hidden, weight, bias_t, target


def _run(fn, hidden, weight, bias, target, **kw):
    leaves = [hidden.detach().clone().requires_grad_(True),
              weight.detach().clone().requires_grad_(True)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_(True))
    loss = fn(leaves[0], leaves[1], target, bias=leaves[2] if bias is not None else None, **kw)
    # A non-unit upstream gradient checks that backward scales what forward precomputed.
    return (loss, *torch.autograd.grad(loss * 1.7, leaves))


def _close(got, want, dtype):
    torch.testing.assert_close(got[0], want[0], rtol=TOL[dtype]["loss"], atol=TOL[dtype]["loss"])
    for g, e in zip(got[1:], want[1:], strict=True):
        atol = TOL[dtype]["grad"] * max(1.0, float(e.abs().max()))
        torch.testing.assert_close(g, e, rtol=TOL[dtype]["grad"], atol=atol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_reference(shape, dtype, reduction, device):
    lead, h, v = shape
    hidden, weight, bias, target = _inputs(lead, h, v, dtype, device, bias=reduction == "sum")
    if target.numel() == 1:
        target.fill_(v - 1)  # the last vocabulary column, past every full block
    kw = {"reduction": reduction, "chunk_size": 4}
    got = _run(fused_linear_cross_entropy, hidden, weight, bias, target, **kw)
    want = _run(fused_linear_cross_entropy_reference, hidden, weight, bias, target, **kw)
    assert got[0].dtype == want[0].dtype == torch.float32
    _close(got, want, dtype)


@pytest.mark.parametrize("chunk_size", [0, 1, 5, 1000])
def test_chunking_does_not_change_the_result(chunk_size, device):
    hidden, weight, _, target = _inputs((3, 7), 37, 1001, torch.float32, device, False)
    got = _run(fused_linear_cross_entropy, hidden, weight, None, target, chunk_size=chunk_size)
    want = _run(fused_linear_cross_entropy_reference, hidden, weight, None, target)
    _close(got, want, torch.float32)


def test_label_mask_and_ignore_index_both_drop_rows(device):
    hidden, weight, _, target = _inputs((3, 7), 37, 1001, torch.float32, device, False)
    mask = torch.ones_like(target, dtype=torch.bool)
    mask[:, :3] = False
    got = _run(fused_linear_cross_entropy, hidden, weight, None, target, label_mask=mask)
    want = _run(fused_linear_cross_entropy_reference, hidden, weight, None, target,
                label_mask=mask)
    _close(got, want, torch.float32)
    assert torch.count_nonzero(got[1][:, :3]) == 0  # masked rows get exactly zero gradient


def test_all_rows_ignored_gives_nan_mean_like_torch_and_zero_grads(device):
    hidden, weight, _, target = _inputs((2, 3), 8, 50, torch.float32, device, False)
    target.fill_(-100)
    got = _run(fused_linear_cross_entropy, hidden, weight, None, target)
    want = fused_linear_cross_entropy_reference(hidden, weight, target)
    assert torch.isnan(got[0]) and torch.isnan(want)
    assert torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(got[2]) == 0


def test_gradcheck_float64(device):
    hidden = torch.randn(2, 3, 5, device=device, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, device=device, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, device=device, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1, -100, 10], [0, 4, 4]], device=device)
    # fast_mode (a random projection per input): full mode re-runs the interpreted kernels
    # once per element, ~18 s here.
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=2),
        (hidden, weight, bias), fast_mode=True,
    )


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in bytes) any torch op produces.

    Bytes, because Triton's interpreter copies kernel arguments as raw byte storage.
    """

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_never_materializes_the_full_logits(device):
    hidden, weight, _, target = _inputs((4, 16), 24, 5003, torch.float32, device, False)
    target.fill_(7)
    hidden.requires_grad_(True)
    with _LargestTensor() as probe:
        fused_linear_cross_entropy(hidden, weight, target, chunk_size=8).backward()
    # Nothing bigger than the weight itself (views of it count) or one float32 chunk of 8 rows,
    # both well under the 64 x 5003 full logits.
    assert probe.largest <= max(8 * 5003, 5003 * 24) * 4 < 64 * 5003 * 4
    with _LargestTensor() as probe:
        fused_linear_cross_entropy_reference(hidden, weight, target).backward()
    assert probe.largest >= 64 * 5003 * 4  # the probe does see full logits when they exist


def test_default_chunk_size_bounds_the_logits_by_the_hidden_states():
    # 0.5B-class: vocabulary 151,936, hidden 896, 16k tokens -> 128 rows x 151,936 per chunk.
    assert default_chunk_size(16384, 896, 151936) == 128
    assert default_chunk_size(1, 64, 49152) == 1


def test_module_and_bad_input(device):
    hidden, weight, _, target = _inputs((3,), 8, 50, torch.float32, device, False)
    loss = FusedLinearCrossEntropyLoss(chunk_size=2)(hidden, weight, target)
    torch.testing.assert_close(loss, fused_linear_cross_entropy_reference(hidden, weight, target))
    with pytest.raises(ValueError, match="labels must be in"):
        fused_linear_cross_entropy(hidden, weight, torch.full_like(target, 50))
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, target, reduction="none")
    with pytest.raises(ValueError, match="target shape"):
        fused_linear_cross_entropy(hidden, weight, target[:2])


def test_loss_under_no_grad(device):
    # Evaluation path: the gradient pass inside forward is skipped, the loss must not change.
    hidden, weight, _, target = _inputs((3, 7), 37, 1001, torch.float32, device, False)
    hidden.requires_grad_(True)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, target, chunk_size=4)
        want = fused_linear_cross_entropy_reference(hidden, weight, target)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
