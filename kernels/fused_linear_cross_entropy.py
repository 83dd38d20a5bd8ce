"""Fused LM head + cross-entropy: the loss from hidden states without the full logits tensor.

Eager training materializes ``tokens x vocab`` logits, their float32 upcast and their gradient:
at vocabulary 151,936 and 16k tokens that is 10 GB in bf16 before the float32 copies. Here the
rows are processed in chunks: a chunk's logits (one matmul), a Triton forward kernel computing
each row's log-sum-exp and loss in one pass over the vocabulary, then a Triton backward kernel
overwriting the logits in place with ``(softmax - onehot) * scale``, and two matmuls
accumulating the gradients of the hidden states and (if trainable) the LM head. Peak extra
memory is one chunk of logits plus the gradients, which are computed during the forward (so a
backward costs two multiplies by the upstream gradient).

Rows whose label is ``ignore_index`` (the prompt side of an assistant-only label mask) or whose
``label_mask`` is False are dropped before the matmul: they cost nothing and get a zero
gradient. ``reduction="mean"`` divides by the number of kept rows, as ``F.cross_entropy``.
Logits are computed in the hidden-state dtype and upcast in the kernel, as transformers' loss
does (``logits.float()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from ._utils import check_launchable, compute_dtype, interpreting, rows_per_block


@triton.jit
def _fused_linear_cross_entropy_fwd_kernel(
    LOGITS, TARGET, LOSS, LSE, stride_l, V, num_rows,
    BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # Online (running max, running sum) log-sum-exp over vocabulary blocks: one read of the row.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    ct = LOSS.dtype.element_ty
    base = LOGITS + rows * stride_l
    target = tl.load(TARGET + rows, mask=row_ok, other=0)
    cols = tl.arange(0, BLOCK_V)
    running_max = tl.full((BLOCK_ROWS,), float("-inf"), ct)
    running_sum = tl.zeros((BLOCK_ROWS,), ct)
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + cols
        z = tl.load(base[:, None] + vv[None, :], mask=row_ok[:, None] & (vv < V)[None, :],
                    other=float("-inf")).to(ct)
        new_max = tl.maximum(running_max, tl.max(z, axis=1))
        # Rows past num_rows stay at -inf; keep their arithmetic finite (their store is masked).
        new_max = tl.where(row_ok, new_max, 0.0)
        running_sum = (running_sum * tl.exp(running_max - new_max)
                       + tl.sum(tl.exp(z - new_max[:, None]), axis=1))
        running_sum = tl.where(row_ok, running_sum, 1.0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target_logit = tl.load(base + target, mask=row_ok, other=0.0).to(ct)
    tl.store(LSE + rows, lse, mask=row_ok)
    tl.store(LOSS + rows, lse - target_logit, mask=row_ok)


@triton.jit
def _fused_linear_cross_entropy_bwd_kernel(
    LOGITS, TARGET, LSE, stride_l, V, num_rows, scale,
    BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # In place: logits -> d loss / d logits = (softmax - onehot(target)) * scale.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    ct = LSE.dtype.element_ty
    base = LOGITS + rows * stride_l
    target = tl.load(TARGET + rows, mask=row_ok, other=0)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + cols
        mask = row_ok[:, None] & (vv < V)[None, :]
        z = tl.load(base[:, None] + vv[None, :], mask=mask, other=0.0).to(ct)
        grad = tl.exp(z - lse[:, None]) - tl.where(vv[None, :] == target[:, None], 1.0, 0.0)
        tl.store(base[:, None] + vv[None, :], (grad * scale).to(LOGITS.dtype.element_ty),
                 mask=mask)


def default_chunk_size(num_rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per chunk so that a chunk of logits is about the size of the hidden states.

    ``cdiv(V, H)`` chunks (Liger-Kernel's rule): 170 at vocabulary 151,936 and hidden 896.
    """
    num_chunks = triton.cdiv(vocab_size, hidden_size)
    return max(1, triton.next_power_of_2(triton.cdiv(max(num_rows, 1), num_chunks)))


def _block_v(vocab_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps): the interpreter pays per block op, so it takes one big block."""
    if interpreting():
        return min(triton.next_power_of_2(vocab_size), 65536), 4
    return min(triton.next_power_of_2(vocab_size), 32768), 32 if vocab_size >= 32768 else 8


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper: loss and gradients in the forward, scaled by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, keep: torch.Tensor, reduction: str, chunk_size: int,
                grad_enabled: bool):
        h = hidden.shape[-1]
        v = weight.shape[0]
        hidden2 = hidden.reshape(-1, h)
        idx = keep.reshape(-1).nonzero().squeeze(1)
        num_kept = idx.numel()
        ct = compute_dtype(hidden.dtype, weight.dtype)
        rows = hidden2.index_select(0, idx)
        targets = target.reshape(-1).index_select(0, idx).contiguous()
        if num_kept and (int(targets.min()) < 0 or int(targets.max()) >= v):
            raise ValueError(f"labels must be in [0, {v}) or the ignore index; got "
                             f"{int(targets.min())}..{int(targets.max())}")
        # mean over zero kept rows is 0/0 = nan, as in F.cross_entropy; gradients are then zero.
        scale = 1.0 / max(num_kept, 1) if reduction == "mean" else 1.0
        # Gradients are computed here, so skip them outright when no backward can follow.
        need_h = grad_enabled and ctx.needs_input_grad[0]
        need_w = grad_enabled and ctx.needs_input_grad[1]
        need_b = grad_enabled and bias is not None and ctx.needs_input_grad[2]
        need_any = need_h or need_w or need_b
        grad_rows = torch.empty_like(rows) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(v, dtype=ct, device=weight.device) if need_b else None
        losses = torch.empty(num_kept, dtype=ct, device=hidden.device)
        lse = torch.empty(num_kept, dtype=ct, device=hidden.device)
        block_v, warps = _block_v(v)
        chunk = chunk_size if chunk_size > 0 else default_chunk_size(num_kept, h, v)
        for start in range(0, num_kept, chunk):
            end = min(start + chunk, num_kept)
            h_chunk = rows[start:end]
            # addmm rounds matmul + bias once, exactly as F.linear (the LM head) does.
            logits = (h_chunk @ weight.t() if bias is None
                      else torch.addmm(bias, h_chunk, weight.t()))
            t_chunk = targets[start:end]
            block_rows = rows_per_block(end - start, block_v)
            grid = (triton.cdiv(end - start, block_rows),)
            _fused_linear_cross_entropy_fwd_kernel[grid](
                logits, t_chunk, losses[start:end], lse[start:end], logits.stride(0), v,
                end - start, BLOCK_V=block_v, BLOCK_ROWS=block_rows, num_warps=warps,
            )
            if not need_any:
                continue
            _fused_linear_cross_entropy_bwd_kernel[grid](
                logits, t_chunk, lse[start:end], logits.stride(0), v, end - start, scale,
                BLOCK_V=block_v, BLOCK_ROWS=block_rows, num_warps=warps,
            )
            if grad_rows is not None:
                torch.mm(logits, weight, out=grad_rows[start:end])
            if grad_w is not None:
                grad_w.addmm_(logits.t(), h_chunk)
            if grad_b is not None:
                grad_b += logits.sum(0, dtype=ct)
        loss = losses.sum() * scale if num_kept else losses.sum() / 0.0
        grad_hidden = None
        if grad_rows is not None:
            grad_hidden = torch.zeros_like(hidden2).index_copy_(0, idx, grad_rows)
            grad_hidden = grad_hidden.view(hidden.shape)
        ctx.save_for_backward(grad_hidden, grad_w, grad_b)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_w, grad_b = ctx.saved_tensors
        dh = grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None
        dw = grad_w * grad_loss.to(grad_w.dtype) if grad_w is not None else None
        db = (grad_b * grad_loss).to(ctx.bias_dtype) if grad_b is not None else None
        return dh, dw, db, None, None, None, None, None


def _keep_mask(target: torch.Tensor, ignore_index: int,
               label_mask: torch.Tensor | None) -> torch.Tensor:
    keep = target != ignore_index
    if label_mask is not None:
        if label_mask.shape != target.shape:
            raise ValueError(f"label_mask shape {tuple(label_mask.shape)} must equal the target "
                             f"shape {tuple(target.shape)}")
        keep = keep & label_mask.to(torch.bool)
    return keep


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_mask: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int = 0,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight^T + bias, target)`` computed in row chunks.

    ``hidden`` is ``(..., H)``, ``weight`` ``(V, H)``, ``target`` the leading shape of ``hidden``
    with ids already aligned (shift them for causal LM before calling). Rows with
    ``target == ignore_index`` or ``label_mask == False`` are skipped. ``chunk_size`` rows per
    chunk; 0 picks :func:`default_chunk_size`.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not "
                         "match (want hidden (..., H), weight (V, H))")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must hold integer ids, got {target.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
    check_launchable(hidden, weight, target)
    keep = _keep_mask(target, ignore_index, label_mask)
    return FusedLinearCrossEntropyFunction.apply(hidden, weight, bias, target, keep, reduction,
                                                 int(chunk_size), torch.is_grad_enabled())


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_mask: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int = 0,
) -> torch.Tensor:
    """Pure torch, as transformers computes it: full logits, upcast, ``F.cross_entropy``."""
    del chunk_size  # the reference materializes everything; the argument keeps signatures equal
    logits = F.linear(hidden, weight, bias)
    ct = compute_dtype(hidden.dtype, weight.dtype)
    target = target.long()
    if label_mask is not None:
        target = target.masked_fill(~label_mask.to(torch.bool), ignore_index)
    return F.cross_entropy(logits.to(ct).reshape(-1, weight.shape[0]), target.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)


class FusedLinearCrossEntropyLoss(nn.Module):
    """Loss module: ``forward(hidden, lm_head_weight, target, bias=None)``."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean",
                 chunk_size: int = 0) -> None:
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.chunk_size = chunk_size

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None,
                label_mask: torch.Tensor | None = None) -> torch.Tensor:
        return fused_linear_cross_entropy(
            hidden, weight, target, bias=bias, ignore_index=self.ignore_index,
            label_mask=label_mask, reduction=self.reduction, chunk_size=self.chunk_size,
        )
