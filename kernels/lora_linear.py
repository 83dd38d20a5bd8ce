"""Fused LoRA linear: ``x @ W^T + b + scale * dropout(x) @ A^T @ B^T`` with a frozen base weight.

PEFT runs a LoRA layer as five kernels (base GEMM, dropout, ``x @ A^T``, ``@ B^T``, scaled add)
and writes the ``M x N`` output twice. Here the base GEMM's Triton kernel adds the low-rank term
(``(dropout(x) @ A^T) @ B^T``, rank padded to 16) and the bias in its epilogue, so the output is
written once; the backward GEMM for ``dx`` likewise folds ``scale * (dy @ B) @ A``, masked by the
dropout, into ``dy @ W``. The thin rank-``r`` products (``dropout(x) @ A^T``, ``dy @ B`` and the
adapter gradients) stay cuBLAS matmuls: they are ``r/N`` of the work.

The base weight (and bias) never get a gradient: passing one that requires grad is an error, not
a silently dropped gradient. The adapters may have their own dtype (PEFT keeps them float32 under
a bf16 base model); their products and gradients are computed in that dtype, as PEFT does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from ._utils import check_launchable, dot_precision, interpreting, upcast_dot

_TL_ACC = {torch.float64: tl.float64, torch.float32: tl.float32}


@triton.jit
def _lora_linear_fwd_kernel(
    X, W, BIAS, XA, LB, Y, M, N, K, scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_xam, stride_xar, stride_bn, stride_br,
    stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, PRECISION_R: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Grouped program order: GROUP_M row blocks share each W column block while it is in L2.
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + kk[None, :] * stride_wk,
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if UPCAST:
            x = x.to(ACC_DTYPE)
            w = w.to(ACC_DTYPE)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)

    rr = tl.arange(0, BLOCK_R)
    xa = tl.load(XA + rm[:, None] * stride_xam + rr[None, :] * stride_xar,
                 mask=rm[:, None] < M, other=0.0)
    lb = tl.load(LB + rn[:, None] * stride_bn + rr[None, :] * stride_br,
                 mask=rn[:, None] < N, other=0.0)
    if UPCAST:
        xa = xa.to(ACC_DTYPE)
        lb = lb.to(ACC_DTYPE)
    low_rank = tl.dot(xa, tl.trans(lb), input_precision=PRECISION_R)
    acc += scale * low_rank.to(ACC_DTYPE)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(ACC_DTYPE)[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _lora_linear_bwd_kernel(
    DY, W, DYB, LA, KEEP, DX, M, N, K, scale, keep_scale,
    stride_dym, stride_dyn, stride_wn, stride_wk, stride_dybm, stride_dybr, stride_ar, stride_ak,
    stride_keepm, stride_keepk, stride_dxm, stride_dxk,
    HAS_DROPOUT: tl.constexpr, ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, PRECISION_R: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # dx = dy @ W + scale * ((dy @ B) @ A) * keep / (1 - p); here the "columns" are K.
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_k = (K + BLOCK_K - 1) // BLOCK_K
    group = pid // (GROUP_M * num_pid_k)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_k = (pid % (GROUP_M * num_pid_k)) // group_size

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rk = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rn = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC_DTYPE)
    for n0 in range(0, N, BLOCK_N):
        nn_ = n0 + rn
        dy = tl.load(DY + rm[:, None] * stride_dym + nn_[None, :] * stride_dyn,
                     mask=(rm[:, None] < M) & (nn_[None, :] < N), other=0.0)
        w = tl.load(W + nn_[:, None] * stride_wn + rk[None, :] * stride_wk,
                    mask=(nn_[:, None] < N) & (rk[None, :] < K), other=0.0)
        if UPCAST:
            dy = dy.to(ACC_DTYPE)
            w = w.to(ACC_DTYPE)
        acc = tl.dot(dy, w, acc, input_precision=PRECISION)

    rr = tl.arange(0, BLOCK_R)
    dyb = tl.load(DYB + rm[:, None] * stride_dybm + rr[None, :] * stride_dybr,
                  mask=rm[:, None] < M, other=0.0)
    la = tl.load(LA + rr[:, None] * stride_ar + rk[None, :] * stride_ak,
                 mask=rk[None, :] < K, other=0.0)
    if UPCAST:
        dyb = dyb.to(ACC_DTYPE)
        la = la.to(ACC_DTYPE)
    low_rank = tl.dot(dyb, la, input_precision=PRECISION_R).to(ACC_DTYPE)
    if HAS_DROPOUT:
        keep = tl.load(KEEP + rm[:, None] * stride_keepm + rk[None, :] * stride_keepk,
                       mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)
        low_rank = tl.where(keep != 0, low_rank * keep_scale, 0.0)
    acc += scale * low_rank
    tl.store(DX + rm[:, None] * stride_dxm + rk[None, :] * stride_dxk, acc.to(DX.dtype.element_ty),
             mask=(rm[:, None] < M) & (rk[None, :] < K))


def _blocks(dtype: torch.dtype, m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for the GEMM tiles.

    The interpreter pays per program and per tile op far more than per element, so it gets few,
    big tiles; GPU sizes are the usual Hopper/Ampere starting points for 2-byte dtypes
    (not yet measured on a GPU).
    """
    if interpreting():
        return min(64, max(16, triton.next_power_of_2(m))), 128, 128, 4
    if dtype in (torch.float16, torch.bfloat16):
        return 128, 128, 64, 8
    if dtype == torch.float32:
        return 64, 64, 32, 4
    return 32, 32, 16, 4


def _pad_rank(t: torch.Tensor, dim: int, block_r: int) -> torch.Tensor:
    """Zero-pad the rank dimension to the tile width (``tl.dot`` needs at least 16)."""
    r = t.shape[dim]
    if r == block_r:
        return t
    pad = [0, 0] * t.dim()
    pad[2 * (t.dim() - 1 - dim) + 1] = block_r - r
    return torch.nn.functional.pad(t, pad)


class LoRALinearFunction(torch.autograd.Function):
    """Autograd wrapper; gradients for x, A and B only (W and bias are frozen)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, dropout_p: float):
        shape = x.shape
        k = shape[-1]
        n = weight.shape[0]
        r = lora_a.shape[0]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        ad = lora_a.dtype
        acc = torch.float64 if torch.float64 in (x.dtype, ad) else torch.float32
        if dropout_p > 0.0:
            keep = torch.empty_like(x2, dtype=torch.bool).bernoulli_(1.0 - dropout_p)
            x_drop = x2 * keep / (1.0 - dropout_p)
        else:
            keep = None
            x_drop = x2
        xa = x_drop.to(ad) @ lora_a.t()  # M x r, in the adapter dtype as PEFT does
        block_r = max(16, triton.next_power_of_2(r))
        xa_p = _pad_rank(xa, 1, block_r)
        b_p = _pad_rank(lora_b, 1, block_r)
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        bm, bn, bk, warps = _blocks(x.dtype, m)
        if m:
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            _lora_linear_fwd_kernel[grid](
                x2, weight, bias if bias is not None else weight, xa_p, b_p, y, m, n, k, scale,
                x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                xa_p.stride(0), xa_p.stride(1), b_p.stride(0), b_p.stride(1),
                y.stride(0), y.stride(1),
                HAS_BIAS=bias is not None, ACC_DTYPE=_TL_ACC[acc],
                UPCAST=upcast_dot(x.dtype, ad), PRECISION=dot_precision(x.dtype),
                PRECISION_R=dot_precision(ad), GROUP_M=8,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=block_r, num_warps=warps,
            )
        ctx.save_for_backward(x_drop, keep, xa, weight, lora_a, lora_b)
        ctx.scale = scale
        ctx.dropout_p = dropout_p
        ctx.shape = shape
        ctx.acc = acc
        return y.view(*shape[:-1], n)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_drop, keep, xa, weight, lora_a, lora_b = ctx.saved_tensors
        n, k = weight.shape
        r = lora_a.shape[0]
        dy2 = dy.reshape(-1, n)
        m = dy2.shape[0]
        ad = lora_a.dtype
        scale = ctx.scale
        dy_a = dy2.to(ad)
        dyb = dy_a @ lora_b  # M x r
        grad_a = (dyb.t() @ x_drop.to(ad)) * scale if ctx.needs_input_grad[3] else None
        grad_b = (dy_a.t() @ xa) * scale if ctx.needs_input_grad[4] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            block_r = max(16, triton.next_power_of_2(r))
            dyb_p = _pad_rank(dyb, 1, block_r)
            a_p = _pad_rank(lora_a, 0, block_r)
            dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
            bm, bn, bk, warps = _blocks(dy.dtype, m)
            if m:
                grid = (triton.cdiv(m, bm) * triton.cdiv(k, bk),)
                keep_t = keep if keep is not None else dyb_p
                _lora_linear_bwd_kernel[grid](
                    dy2, weight, dyb_p, a_p, keep_t, dx, m, n, k, scale,
                    1.0 / (1.0 - ctx.dropout_p),
                    dy2.stride(0), dy2.stride(1), weight.stride(0), weight.stride(1),
                    dyb_p.stride(0), dyb_p.stride(1), a_p.stride(0), a_p.stride(1),
                    keep_t.stride(0), keep_t.stride(1), dx.stride(0), dx.stride(1),
                    HAS_DROPOUT=keep is not None, ACC_DTYPE=_TL_ACC[ctx.acc],
                    UPCAST=upcast_dot(dy.dtype, ad), PRECISION=dot_precision(dy.dtype),
                    PRECISION_R=dot_precision(ad), GROUP_M=8,
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=block_r, num_warps=warps,
                )
            grad_x = dx.view(ctx.shape)
        return grad_x, None, None, grad_a, grad_b, None, None


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           lora_a: torch.Tensor, lora_b: torch.Tensor, dropout_p: float) -> None:
    if weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2:
        raise ValueError("weight, lora_a and lora_b must be 2-D")
    n, k = weight.shape
    r = lora_a.shape[0]
    if x.shape[-1] != k or lora_a.shape != (r, k) or lora_b.shape != (n, r):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {(n, k)}, lora_a "
                         f"{tuple(lora_a.shape)} (want (r, {k})), lora_b {tuple(lora_b.shape)} "
                         f"(want ({n}, r))")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be ({n},)")
    if x.dtype != weight.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    if lora_a.dtype != lora_b.dtype:
        raise ValueError(f"lora_a ({lora_a.dtype}) and lora_b ({lora_b.dtype}) must share a dtype")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if torch.is_grad_enabled() and (weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        raise ValueError("the base weight and bias of a fused LoRA linear are frozen: set "
                         "requires_grad=False on them (use plain nn.Linear to train them)")


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    scale: float,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``x @ weight^T + bias + scale * dropout(x) @ lora_a^T @ lora_b^T``.

    ``weight`` is ``(N, K)``, ``lora_a`` ``(r, K)``, ``lora_b`` ``(N, r)``. ``dropout_p`` applies
    to the adapter input only, as in PEFT; pass 0 in eval mode.
    """
    _check(x, weight, bias, lora_a, lora_b, dropout_p)
    check_launchable(x, weight, lora_a, lora_b)
    return LoRALinearFunction.apply(x, weight, bias, lora_a, lora_b, float(scale),
                                    float(dropout_p))


def lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    scale: float,
    bias: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Pure torch, written as PEFT's ``lora.Linear.forward``; ``dropout_mask`` makes it repeatable."""
    result = torch.nn.functional.linear(x, weight, bias)
    x_drop = x if dropout_mask is None else x * dropout_mask / (1.0 - dropout_p)
    x_drop = x_drop.to(lora_a.dtype)
    return (result + (x_drop @ lora_a.t() @ lora_b.t()) * scale).to(result.dtype)


class LoRALinear(nn.Module):
    """A frozen ``base`` linear layer plus a trainable rank-``r`` adapter, fused.

    State dict keys: ``weight``, ``bias`` (if any), ``lora_A``, ``lora_B``. To fuse layers that
    PEFT already wrapped, use ``kernels.patcher.apply_kernels``: it keeps PEFT's modules (and so
    its adapter save/merge) and only routes their forward here.
    """

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be at least 1, got {rank}")
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        k, n = base.in_features, base.out_features
        self.lora_A = nn.Parameter(torch.empty(rank, k, device=base.weight.device,
                                               dtype=base.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(n, rank, device=base.weight.device,
                                               dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=5**0.5)  # PEFT's default init for A
        self.scale = float(alpha) / rank
        self.dropout = float(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return lora_linear(x, self.weight, self.lora_A, self.lora_B, scale=self.scale,
                           bias=self.bias, dropout_p=p)
