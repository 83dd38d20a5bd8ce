"""RMSNorm as one Triton forward and one Triton backward pass, with the weight-offset variant.

``y = x / sqrt(mean(x^2) + eps) * (offset + w)`` over the last dimension. ``offset = 0`` is the
Llama / Qwen2 / Qwen3 norm; ``offset = 1`` is the Gemma / Qwen3-Next form whose stored weight is a
zero-centred delta. Statistics are always computed in float32 (float64 for float64 inputs).

Dtype rules follow the transformers code the kernel replaces, so a swapped model gives the same
numbers: with ``offset == 0`` the normalized row is rounded to the input dtype before the weight
multiply and the output takes ``promote_types(x, w)`` (``LlamaRMSNorm``); with an offset the whole
product stays in float32 and the output has the input dtype (``GemmaRMSNorm``).

The backward pass recomputes ``x_hat`` from ``x`` and the saved per-row ``rstd`` instead of
saving ``x_hat``: one float per row instead of a second activation-sized tensor.
"""

from __future__ import annotations

from typing import Self

import torch
import triton
import triton.language as tl
from torch import nn

from ._utils import (
    check_launchable,
    compute_dtype,
    num_programs_for,
    num_warps_for,
    row_block,
    rows_per_block,
)


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, stride_x, stride_y, N, num_rows, eps, offset,
    CAST_XHAT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < N)[None, :]
    ct = RSTD.dtype.element_ty
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ct)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(ct)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    x_hat = x * rstd[:, None]
    if CAST_XHAT:
        x_hat = x_hat.to(X.dtype.element_ty).to(ct)
    y = x_hat * (w + offset)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW, stride_dy, stride_x, stride_dx, N, num_rows, rows_per_program,
    offset, CAST_XHAT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # Each program walks a contiguous run of rows and keeps its own partial weight gradient, so
    # the reduction over rows is one small (num_programs x N) sum afterwards, not atomics.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < N
    ct = RSTD.dtype.element_ty
    w = (tl.load(W + cols, mask=col_ok, other=0.0).to(ct) + offset)[None, :]
    dw = tl.zeros((BLOCK_ROWS, BLOCK), dtype=ct)
    first = pid.to(tl.int64) * rows_per_program  # int64: row * stride can pass 2**31
    last = tl.minimum(first + rows_per_program, num_rows)
    for r0 in range(0, rows_per_program, BLOCK_ROWS):
        rows = first + r0 + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < last
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ct)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask,
                     other=0.0).to(ct)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        x_hat = x * rstd
        dy_w = dy * w
        dx = rstd * (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=1) / N)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=mask)
        if CAST_XHAT:
            x_hat = x_hat.to(X.dtype.element_ty).to(ct)
        dw += dy * x_hat
    tl.store(DW + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, offset: float) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if offset == 0.0 else x.dtype


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (input and weight gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
        shape = x.shape
        n = shape[-1]
        x2 = x.reshape(-1, n)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        w = weight.contiguous()
        num_rows = x2.shape[0]
        y = torch.empty((num_rows, n), dtype=_output_dtype(x, weight, offset), device=x.device)
        rstd = torch.empty(num_rows, dtype=compute_dtype(x.dtype, w.dtype), device=x.device)
        block = row_block(n)
        if num_rows:
            block_rows = rows_per_block(num_rows, block)
            _rms_norm_fwd_kernel[(triton.cdiv(num_rows, block_rows),)](
                x2, w, y, rstd, x2.stride(0), y.stride(0), n, num_rows, eps, offset,
                CAST_XHAT=offset == 0.0, BLOCK=block, BLOCK_ROWS=block_rows,
                num_warps=num_warps_for(block),
            )
        ctx.save_for_backward(x2, w, rstd)
        ctx.offset = offset
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w, rstd = ctx.saved_tensors
        n = x2.shape[-1]
        dy2 = dy.reshape(-1, n)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        num_rows = x2.shape[0]
        dx = torch.empty_like(x2)
        num_programs = num_programs_for(num_rows, x2.device)
        rows_per_program = triton.cdiv(num_rows, num_programs) if num_rows else 0
        dw_partial = torch.zeros((num_programs, n), dtype=rstd.dtype, device=x2.device)
        block = row_block(n)
        if num_rows:
            _rms_norm_bwd_kernel[(num_programs,)](
                dy2, x2, w, rstd, dx, dw_partial, dy2.stride(0), x2.stride(0), dx.stride(0),
                n, num_rows, rows_per_program, ctx.offset,
                CAST_XHAT=ctx.offset == 0.0, BLOCK=block,
                BLOCK_ROWS=rows_per_block(rows_per_program, block), num_warps=num_warps_for(block),
            )
        dw = dw_partial.sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0
) -> torch.Tensor:
    """RMS-normalize ``x`` over its last dimension and scale by ``offset + weight``."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the last dimension "
                         f"of x {tuple(x.shape)}")
    check_launchable(x, weight)
    return RMSNormFunction.apply(x, weight, float(eps), float(offset))


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0
) -> torch.Tensor:
    """Pure-torch RMSNorm with the exact dtype behaviour of transformers' Llama/Gemma norms."""
    ct = compute_dtype(x.dtype, weight.dtype)
    xf = x.to(ct)
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0.0:
        return weight * x_hat.to(x.dtype)
    return (x_hat * (offset + weight.to(ct))).to(x.dtype)


class NormModule(nn.Module):
    """State and construction shared by the norm modules: a ``weight`` Parameter (the only state,
    as in transformers' norms), ``variance_epsilon`` (the name transformers code reads) and the
    weight ``offset``. Subclasses add ``forward``."""

    weight: nn.Parameter

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        init = torch.zeros if offset != 0.0 else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = float(eps)
        self.offset = float(offset)

    @classmethod
    def from_module(cls, module: nn.Module, *, offset: float = 0.0) -> Self:
        """Wrap an existing norm, sharing (not copying) its weight Parameter."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        weight = module.weight
        assert isinstance(weight, nn.Parameter)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = weight
        new.variance_epsilon = float(eps)
        new.offset = float(offset)
        return new

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}"


class RMSNorm(NormModule):
    """Drop-in RMSNorm module; its only state is ``weight``, as in transformers' norms.

    ``eps`` is also exposed as ``variance_epsilon`` because code in transformers reads that name.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, self.offset)
