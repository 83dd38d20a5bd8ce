"""Gated RMSNorm in one Triton forward and one Triton backward pass (gated-delta-net style).

``y = x / sqrt(mean(x^2) + eps) * (offset + w) * silu(z)`` over the last dimension, as the output
norm of the linear-attention (gated delta net) layers in Qwen3-Next and Qwen3.5/3.6
(``Qwen3_5RMSNormGated``, which uses ``offset = 0``). Eager torch runs this as about ten kernels
and keeps several activation-sized intermediates for backward; here the forward keeps only ``x``,
``z`` and one float per row, and the backward recomputes the rest.

Dtypes follow transformers: statistics and the gate in float32 (float64 for float64 inputs); with
``offset == 0`` the normalized row is rounded to the input dtype before the weight multiply; the
output has the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import (
    check_launchable,
    compute_dtype,
    num_programs_for,
    num_warps_for,
    row_block,
    rows_per_block,
)
from .rms_norm import NormModule


@triton.jit
def _gated_rms_norm_fwd_kernel(
    X, Z, W, Y, RSTD, stride_x, stride_z, stride_y, N, num_rows, eps, offset,
    CAST_XHAT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < N)[None, :]
    ct = RSTD.dtype.element_ty
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ct)
    z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(ct)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(ct)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    x_hat = x * rstd[:, None]
    if CAST_XHAT:
        x_hat = x_hat.to(X.dtype.element_ty).to(ct)
    y = x_hat * (w + offset)[None, :] * (z * tl.sigmoid(z))
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_bwd_kernel(
    DY, X, Z, W, RSTD, DX, DZ, DW, stride_dy, stride_x, stride_z, stride_dx, stride_dz, N,
    num_rows, rows_per_program, offset, CAST_XHAT: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    # Same row-walking scheme as the RMSNorm backward: one partial weight gradient per program.
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
        z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(ct)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask,
                     other=0.0).to(ct)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        x_hat = x * rstd
        x_hat_w = x_hat
        if CAST_XHAT:
            x_hat_w = x_hat.to(X.dtype.element_ty).to(ct)
        sig = tl.sigmoid(z)
        silu = z * sig
        # d silu / dz = sig * (1 + z * (1 - sig))
        dz = dy * x_hat_w * w * sig * (1.0 + z * (1.0 - sig))
        tl.store(DZ + rows[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty),
                 mask=mask)
        g = dy * silu
        g_w = g * w
        dx = rstd * (g_w - x_hat * (tl.sum(g_w * x_hat, axis=1) / N)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=mask)
        dw += g * x_hat_w
    tl.store(DW + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class GatedRMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (x, gate and weight gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                offset: float):
        shape = x.shape
        n = shape[-1]
        x2 = _rows(x, n)
        z2 = _rows(gate, n)
        w = weight.contiguous()
        num_rows = x2.shape[0]
        y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(num_rows, dtype=compute_dtype(x.dtype, w.dtype, gate.dtype),
                           device=x.device)
        block = row_block(n)
        if num_rows:
            block_rows = rows_per_block(num_rows, block)
            _gated_rms_norm_fwd_kernel[(triton.cdiv(num_rows, block_rows),)](
                x2, z2, w, y, rstd, x2.stride(0), z2.stride(0), y.stride(0), n, num_rows, eps,
                offset, CAST_XHAT=offset == 0.0, BLOCK=block, BLOCK_ROWS=block_rows,
                num_warps=num_warps_for(block),
            )
        ctx.save_for_backward(x2, z2, w, rstd)
        ctx.offset = offset
        ctx.shape = shape
        ctx.gate_shape = gate.shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, z2, w, rstd = ctx.saved_tensors
        n = x2.shape[-1]
        dy2 = _rows(dy, n)
        num_rows = x2.shape[0]
        dx = torch.empty_like(x2)
        dz = torch.empty_like(z2)
        num_programs = num_programs_for(num_rows, x2.device)
        rows_per_program = triton.cdiv(num_rows, num_programs) if num_rows else 0
        dw_partial = torch.zeros((num_programs, n), dtype=rstd.dtype, device=x2.device)
        block = row_block(n)
        if num_rows:
            _gated_rms_norm_bwd_kernel[(num_programs,)](
                dy2, x2, z2, w, rstd, dx, dz, dw_partial, dy2.stride(0), x2.stride(0),
                z2.stride(0), dx.stride(0), dz.stride(0), n, num_rows, rows_per_program,
                ctx.offset, CAST_XHAT=ctx.offset == 0.0, BLOCK=block,
                BLOCK_ROWS=rows_per_block(rows_per_program, block), num_warps=num_warps_for(block),
            )
        dw = dw_partial.sum(0).to(w.dtype) if ctx.needs_input_grad[2] else None
        return dx.view(ctx.shape), dz.view(ctx.gate_shape), dw, None, None


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
    offset: float = 0.0,
) -> torch.Tensor:
    """``rms_norm(x) * (offset + weight) * silu(gate)`` over the last dimension."""
    if gate.shape != x.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} must equal x shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the last dimension "
                         f"of x {tuple(x.shape)}")
    check_launchable(x, gate, weight)
    return GatedRMSNormFunction.apply(x, gate, weight, float(eps), float(offset))


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
    offset: float = 0.0,
) -> torch.Tensor:
    """Pure torch, written as ``Qwen3_5RMSNormGated.forward`` (plus the optional offset)."""
    ct = compute_dtype(x.dtype, weight.dtype, gate.dtype)
    xf = x.to(ct)
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # offset 0: transformers rounds x_hat to the input dtype first (Llama style).
    normed = weight * x_hat.to(x.dtype) if offset == 0.0 else x_hat * (offset + weight.to(ct))
    return (normed * F.silu(gate.to(ct))).to(x.dtype)


class GatedRMSNorm(NormModule):
    """Drop-in for ``Qwen3_5RMSNormGated``: ``forward(hidden_states, gate)``, state ``weight``."""

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon, self.offset)
