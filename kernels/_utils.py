"""Helpers shared by the kernel modules: launch checks, block sizes and dtype choices."""

from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "yes", "on"}


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear ValueError when the kernels cannot run on these tensors.

    Without the interpreter Triton needs CUDA tensors; on CPU it fails with "0 active drivers".
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
            "before triton is first imported (correct but about 600x slower than torch)"
        )


def supports_kernels(device: torch.device) -> bool:
    """Whether the kernels can run on ``device`` in this process."""
    return device.type == "cuda" or interpreting()


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 only when an input is float64 (gradcheck), else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def upcast_dot(*dtypes: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be upcast before the dot.

    Triton 3.9's interpreter returns garbage (values ~1e10) for bfloat16 ``tl.dot``; upcasting
    the tiles to float32 first gives the exact product. On GPUs the native bf16 dot is used.
    """
    return interpreting() and torch.bfloat16 in dtypes


def dot_precision(*dtypes: torch.dtype) -> str:
    """``tl.dot`` input precision matching torch's own matmul setting for float32 inputs."""
    if torch.float32 in dtypes and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def row_block(num_cols: int) -> int:
    """Block width covering a whole row (kernels keep one row in registers)."""
    if num_cols < 1:
        raise ValueError(f"rows must have at least one element, got {num_cols}")
    return triton.next_power_of_2(num_cols)


def num_warps_for(block: int) -> int:
    """Warps per program for a row kernel of width ``block`` (Liger's heuristic)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def num_programs_for(num_rows: int, device: torch.device) -> int:
    """Programs that loop over rows in backward kernels, each owning one partial weight grad.

    One per SM on a GPU keeps the partial-grad buffer small (num_SM x N); the interpreter runs
    programs one after another, so a handful keeps the per-program overhead low.
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(num_rows, sms))
    return max(1, min(num_rows, 4))


def rows_per_block(num_rows: int, block: int) -> int:
    """Rows each row-kernel program handles at once (a ``(rows, block)`` tile).

    On a GPU one row per program (the usual layout; a wide row fills the warps). Triton's
    interpreter pays about 3 ms of Python per reduction call per program whatever the tile size,
    so there whole groups of rows share one tile, capped at about a million elements.
    """
    if not interpreting():
        return 1
    return max(1, min(16, triton.next_power_of_2(max(num_rows, 1)), (1 << 20) // block))
