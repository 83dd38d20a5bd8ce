"""Peak memory of one training step on one device: weights, adapters, optimizer, activations, logits.

The model follows what a LoRA step keeps alive at its peak (the end of the forward pass, when
every saved activation and the logits exist, plus the adapter gradients and AdamW state):

- **weights**: every base parameter at the storage precision (2 bytes for ``bf16``, 4 for
  ``fp32`` and ``bf16-autocast``), divided across FSDP ranks, plus one gathered layer;
- **adapters**: LoRA A/B in fp32 (4 bytes), their gradients (4) and AdamW's two moments (8);
- **activations**: per token and decoder layer, ``ACT_HIDDEN`` copies of the hidden width and
  ``ACT_INTER`` of the MLP width at the compute precision (the LoRA inputs, norms, attention
  q/k/v/out and the SwiGLU operands that backward needs; frozen base weights need no saved
  input). With gradient checkpointing only each layer's input is kept, plus one layer's full
  set during recomputation. Where attention is not a fused kernel (CPU with a padding mask),
  the ``heads x seq x seq`` score matrices of one layer are counted too;
- **logits**: ``batch x seq x vocab`` at ``LOGIT_BYTES`` bytes per element (the logits, their
  fp32 upcast, log-softmax and its gradient all exist at once in a plain cross-entropy).

The constants were fitted to measured peak RSS of CPU runs (``bench/memory_model.py``): within
+8% to +19% on four configurations without gradient checkpointing (tiny Llama b4/s512 and
b8/s1024, SmolLM2-135M b1/s512 and b2/s1024), but 38% under on SmolLM2-135M b4/s1024 with
gradient checkpointing, which is not yet explained. ``OVERHEAD`` covers allocator slack and
framework buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from factory.recipes import Architecture

GIB = 1024**3

ACT_HIDDEN = 18.0
"""Saved copies of the hidden width per token per layer (no checkpointing)."""
ACT_INTER = 5.0
"""Saved copies of the MLP width per token per layer (no checkpointing)."""
LOGIT_BYTES = 16.0
"""Bytes per logit alive at the loss (logits, fp32 upcast, log-softmax, gradient)."""
OVERHEAD = 1.10
"""Allocator slack and framework buffers, as a factor on the sum."""
FIXED_BYTES = 64 * 1024**2
"""Framework buffers independent of the model (kernels, workspaces)."""


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Peak memory of one training step on one device, in bytes, by component."""

    weights: int
    """Frozen base weights held by this device."""
    adapters: int
    """LoRA weights (fp32)."""
    gradients: int
    """LoRA gradients (fp32)."""
    optimizer: int
    """AdamW moments (two fp32 tensors per adapter weight)."""
    activations: int
    """Saved activations of one micro-batch."""
    logits: int
    """Logits and loss buffers of one micro-batch."""
    overhead: int
    """Allocator slack and fixed buffers."""

    @property
    def total(self) -> int:
        return (self.weights + self.adapters + self.gradients + self.optimizer
                + self.activations + self.logits + self.overhead)

    def as_gib(self) -> dict[str, float]:
        parts = {k: getattr(self, k) for k in ("weights", "adapters", "gradients", "optimizer",
                                               "activations", "logits", "overhead")}
        parts["total"] = self.total
        return {k: round(v / GIB, 3) for k, v in parts.items()}


def lora_parameters(arch: Architecture, rank: int, target_modules: list[str] | tuple[str, ...],
                    ) -> int:
    """Trainable LoRA parameters: ``rank x (in + out)`` per targeted module per layer."""
    per_layer = 0
    for name in target_modules:
        fan_in, fan_out = arch.module_shape(name)
        per_layer += rank * (fan_in + fan_out)
    return per_layer * arch.num_layers


def weight_bytes(precision: str) -> int:
    """Bytes per stored base weight for a trainer precision."""
    return 2 if precision == "bf16" else 4


def compute_bytes(precision: str) -> int:
    """Bytes per activation element for a trainer precision."""
    return 4 if precision == "fp32" else 2


def estimate_memory(arch: Architecture, *, micro_batch_size: int, seq_len: int, lora_rank: int,
                    target_modules: list[str] | tuple[str, ...], precision: str,
                    gradient_checkpointing: bool, num_shards: int = 1,
                    context_parallel: int = 1, fused_attention: bool = True,
                    ) -> MemoryEstimate:
    """Estimate the peak memory of one training step on one device.

    ``num_shards``: FSDP ranks the weights are divided over; ``context_parallel``: ranks one
    sequence is split over (activations and logits divide); ``fused_attention``: a flash /
    memory-efficient kernel (no ``seq x seq`` scores kept).
    """
    wb, cb = weight_bytes(precision), compute_bytes(precision)
    params = arch.num_parameters
    layer_params = (params - arch.vocab_size * arch.hidden_size
                    * (1 if arch.tie_word_embeddings else 2)
                    - arch.vision_parameters) // max(arch.num_layers, 1)
    weights = params * wb // num_shards + (layer_params * wb if num_shards > 1 else 0)
    num_lora = lora_parameters(arch, lora_rank, target_modules)
    tokens = micro_batch_size * -(-seq_len // context_parallel)
    h, inter = arch.hidden_size, arch.intermediate_size
    full_layer = tokens * (ACT_HIDDEN * h + ACT_INTER * inter) * cb
    if not fused_attention:
        full_layer += arch.num_heads * seq_len * tokens * 4 * 2
    if gradient_checkpointing:
        activations = tokens * h * cb * arch.num_layers + full_layer
    else:
        activations = full_layer * arch.num_layers
    logits = tokens * arch.vocab_size * LOGIT_BYTES
    subtotal = weights + num_lora * 16 + activations + logits
    overhead = int(subtotal * (OVERHEAD - 1)) + FIXED_BYTES
    return MemoryEstimate(weights=int(weights), adapters=num_lora * 4, gradients=num_lora * 4,
                          optimizer=num_lora * 8, activations=int(activations),
                          logits=int(logits), overhead=overhead)
