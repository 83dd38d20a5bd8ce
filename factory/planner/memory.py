"""Peak memory of one training step of our trainer (``python -m factory.trainer``) on one device.

The model follows what ``factory.trainer.model`` and ``factory.trainer.train`` keep alive at the peak of a step,
which is the end of the forward pass: every saved activation exists, and the loss is computing
its first chunks of logits. (Without gradient checkpointing the backward pass only frees
activations as it goes; with it, the peak can instead be the recomputation of one layer, and
the larger of the two is taken.)

- **weights**: the base parameters as the trainer stores them: ``fp32`` 4 bytes; ``bf16`` 2;
  ``bf16-autocast`` 2 for the frozen decoder linears (the trainer stores them cast, as autocast
  would use them) and 4 for the rest (embeddings, head, norms). Divided across FSDP ranks,
  plus one gathered layer.
- **adapters / gradients / optimizer**: LoRA A/B in fp32, their gradients, AdamW's two moments
  (4 + 4 + 8 bytes per adapter weight).
- **activations**: per token and decoder layer, what autograd saves (counted with
  ``torch.autograd.graph.saved_tensors_hooks`` on SmolLM2-135M and the tiny test Llama): the
  two RMSNorm inputs in fp32 (the residual stream is fp32, or upcast to fp32 by the norm),
  attention q/k/v/output and the three SwiGLU operands at the compute precision, plus per LoRA
  module a copy of its input (``LORA_INPUT_BYTES``: its own dropout output and mask when
  ``lora_dropout > 0``, otherwise a cast or shared copy) and its rank-wide intermediate. Qwen3's
  q/k norms add their fp32 inputs. With gradient checkpointing only each layer's input is kept,
  plus one layer's full set while it is recomputed. Where attention is not a fused kernel, one
  layer's ``heads x seq x seq`` scores are counted too.
- **logits**: what the loss holds at its peak. ``factory.trainer.model.CausalLMLoss`` never builds the
  ``batch x seq x vocab`` logits: it gathers the labeled positions' hidden states, allocates
  their gradient, and runs the LM head over ``LOSS_CHUNK_TOKENS`` tokens at a time
  (``_FusedLinearCE``), so at most one chunk's logits, its softmax and (from the second chunk
  on) the previous chunk's buffers exist at once: ``LOGIT_BYTES`` per element. Under bf16
  autocast the head weight is cast to bf16 once per step. Without checkpointing, the first
  layer's backward workspace is smaller than this on every configuration we measured; it is
  still compared, and the larger is taken.
- **overhead**: allocator slack as a factor on the sum, plus ``FIXED_BYTES`` of host-side
  buffers (the tokenizer, the packed dataset, thread pools).
- **retained** (CPU only): memory the process freed but glibc's heap keeps, which peak RSS
  counts: a share of one forward pass's activation traffic (``HEAP_RETAINED``), with or
  without checkpointing. On CPU, checkpointing therefore saves about 60% of the activations'
  memory, not 97%; without this term the estimate is ~40% under with checkpointing.

Validated against the measured peak RSS of real ``python -m factory.trainer`` runs on CPU, on jobs the
planner emitted (``bench/memory_model.py``; the table is in BENCHMARKS.md, "Planner memory
model"): the measured figure is the process's peak RSS minus its RSS after importing
torch/transformers/peft and the trainer, i.e. what the step allocates, which is what an
accelerator would hold. ``tests/planner/test_memory_model.py`` repeats one configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from factory.recipes import Architecture

GIB = 1024**3

LOSS_CHUNK_TOKENS = 1024
"""Tokens per chunk of the chunked loss (``factory.trainer.model.LOSS_CHUNK_TOKENS``; a test keeps
the two equal; the factory may not import the trainer's torch-heavy module at plan time)."""
LOGIT_BYTES = {("fp32", False): 8.0, ("fp32", True): 12.0,
               ("bf16", False): 10.0, ("bf16", True): 14.0}
"""Bytes per chunk element alive at the loss, by (compute precision, more than one chunk):
the fp32 logits and their softmax (4 + 4), the bf16 head output before its fp32 upcast and the
bf16 softmax fed to the gradient matmul (+2 under bf16 compute), and from the second chunk on
the previous chunk's logits and softmax, still referenced while the next are computed (+4)."""
LORA_INPUT_BYTES = {("fp32", False): 2.2, ("fp32", True): 8.0,
                    ("bf16", False): 2.3, ("bf16", True): 6.3}
"""Saved bytes per element of a LoRA module's input width, per token, by (compute precision,
dropout > 0). Fitted to ``saved_tensors_hooks`` counts of SmolLM2-135M and the tiny Llama with
LoRA on every linear: with dropout every module keeps its own dropout output and mask; without,
q/k/v and gate/up share one input, and autocast keeps a bf16 cast per module."""
BACKWARD_FACTOR = 1.0
"""Backward workspace of one decoder layer, in units of that layer's saved activations."""
OVERHEAD = 1.10
"""Allocator slack (fragmentation of freed chunks), as a factor on the sum."""
FIXED_BYTES = 64 * 1024**2
"""Host-side buffers independent of the model's size (tokenizer, data, thread pools)."""
HEAP_RETAINED = 0.40
"""CPU: share of one forward pass's activations (as if nothing were checkpointed) that glibc's
heap keeps after it is freed, which peak RSS counts. Activation tensors are mostly below
glibc's dynamic mmap threshold (up to 32 MiB), so they come from the heap, which fragments and
grows instead of returning memory; with gradient checkpointing every layer's forward still
allocates and frees its full set around the one tensor it keeps. Fitted to SmolLM2-135M runs
(0.31-0.45 with and without checkpointing, bf16 autocast; fp32 0.69), measured by
``bench/memory_model.py``. With
``MALLOC_MMAP_THRESHOLD_=131072`` in the trainer's environment the checkpointed 2 x 1024 run
peaks at 1.37 GiB instead of 3.2 GiB, close to the live-memory estimate without this term."""


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
    """Activations saved for backward of one micro-batch."""
    logits: int
    """The loss's buffers at the peak (one chunk of logits, the labeled hidden states and
    their gradient), or the backward workspace of one layer where that is larger."""
    overhead: int
    """Allocator slack and fixed buffers."""
    retained: int = 0
    """Freed memory the CPU process keeps (glibc's heap; see ``HEAP_RETAINED``); 0 on GPUs."""

    @property
    def total(self) -> int:
        return (self.weights + self.adapters + self.gradients + self.optimizer
                + self.activations + self.logits + self.overhead + self.retained)

    def as_gib(self) -> dict[str, float]:
        parts = {k: getattr(self, k) for k in ("weights", "adapters", "gradients", "optimizer",
                                               "activations", "logits", "overhead",
                                               "retained")}
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


def linear_parameters(arch: Architecture) -> int:
    """Parameters of the decoder layers' linear modules (the ones a LoRA can target)."""
    per_layer = 0
    for name in arch.linear_modules:
        fan_in, fan_out = arch.module_shape(name)
        per_layer += fan_in * fan_out
    return per_layer * arch.num_layers


def weight_bytes(precision: str) -> int:
    """Bytes per stored base weight for a trainer precision (``bf16-autocast``: the non-linear
    parameters; its frozen linears are stored in bf16, see ``estimate_memory``)."""
    return 2 if precision == "bf16" else 4


def compute_bytes(precision: str) -> int:
    """Bytes per activation element for a trainer precision."""
    return 4 if precision == "fp32" else 2


def layer_activation_bytes(arch: Architecture, *, precision: str, lora_rank: int,
                           target_modules: list[str] | tuple[str, ...],
                           lora_dropout: float) -> float:
    """Bytes one decoder layer saves for backward, per token, without checkpointing."""
    cb = compute_bytes(precision)
    kind = "fp32" if precision == "fp32" else "bf16"
    h, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    # The RMSNorm inputs, fp32: two per layer, four in Gemma 3 (a pre- and a post-norm around
    # both attention and MLP).
    saved: float = (4 if arch.family == "gemma3" else 2) * h * 4
    saved += (2 * q + 2 * kv) * cb          # q, k, v and the attention output
    saved += arch.num_heads * 4             # the attention's log-sum-exp
    saved += 3 * inter * cb                 # SwiGLU: gate, up, silu(gate)
    if arch.family.startswith("qwen3") or arch.family == "gemma3":
        saved += (q + kv) * 4               # per-head q/k RMSNorm inputs, fp32
    per_input = LORA_INPUT_BYTES[(kind, lora_dropout > 0)]
    for name in target_modules:
        fan_in, _ = arch.module_shape(name)
        saved += per_input * fan_in + lora_rank * cb
    return float(saved)


def estimate_memory(arch: Architecture, *, micro_batch_size: int, seq_len: int, lora_rank: int,
                    target_modules: list[str] | tuple[str, ...], precision: str,
                    gradient_checkpointing: bool, lora_dropout: float = 0.05,
                    num_shards: int = 1, context_parallel: int = 1,
                    fused_attention: bool = True, padding_mask: bool = False,
                    host_heap: bool = False, shared_prefix: int = 0) -> MemoryEstimate:
    """Estimate the peak memory of one training step of our trainer on one device.

    ``num_shards``: FSDP ranks the weights are divided over; ``context_parallel``: ranks one
    sequence is split over (activations and logits divide); ``fused_attention``: a flash /
    memory-efficient kernel (no ``seq x seq`` scores kept); ``padding_mask``: unpacked rows
    on CPU, where every layer's attention call saves its own ``batch x seq x seq`` mask at the
    compute precision (packed rows attend per sample, without a mask); ``host_heap``: the
    device is the CPU, whose freed memory partly stays with the process (``retained``);
    ``shared_prefix``: tokens every row of a micro-batch begins with, computed once per
    micro-batch (``share_prefix`` plans: one prefix and the rows' rests). Every
    token is assumed to be
    trained (labeled), the worst case for the loss's buffers.
    """
    params = arch.num_parameters
    embed = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    linear = linear_parameters(arch)
    if precision == "bf16-autocast" and num_shards == 1:
        # factory.trainer.model stores the frozen decoder linears in bf16 (FSDP2 keeps fp32 shards).
        stored = linear * 2 + (params - linear) * 4
    else:
        stored = params * weight_bytes(precision)
    layer_params = (params - embed - arch.vision_parameters) // max(arch.num_layers, 1)
    weights = stored // num_shards + (layer_params * weight_bytes(precision)
                                      if num_shards > 1 else 0)
    num_lora = lora_parameters(arch, lora_rank, target_modules)

    shared = max(0, min(shared_prefix, seq_len - 1))
    tokens = (-(-shared // context_parallel)
              + micro_batch_size * -(-(seq_len - shared) // context_parallel))
    h = arch.hidden_size
    per_layer = tokens * layer_activation_bytes(arch, precision=precision, lora_rank=lora_rank,
                                                target_modules=target_modules,
                                                lora_dropout=lora_dropout)
    if not fused_attention:
        per_layer += arch.num_heads * seq_len * tokens * 4 * 2
    if padding_mask:
        per_layer += seq_len * tokens * compute_bytes(precision)
    saved: float
    if gradient_checkpointing:
        layer_input = 2 if precision == "bf16" else 4  # the residual stream's dtype
        saved = tokens * h * layer_input * arch.num_layers
        recompute = per_layer  # one layer's full set, while its backward runs
    else:
        saved = per_layer * arch.num_layers
        recompute = 0.0
    # The loss: the final norm's saved input, the labeled hidden states and their gradient
    # (fp32), one or two chunks of logits, and the bf16 head weight under autocast.
    chunk = min(LOSS_CHUNK_TOKENS, tokens)
    kind = "fp32" if precision == "fp32" else "bf16"
    loss = tokens * h * 4 * 3 \
        + chunk * arch.vocab_size * LOGIT_BYTES[(kind, tokens > LOSS_CHUNK_TOKENS)]
    if precision == "bf16-autocast":
        loss += arch.vocab_size * h * 2
    backward = per_layer * BACKWARD_FACTOR + tokens * h * 4 * 2
    transient = max(loss, recompute + backward)
    subtotal = weights + num_lora * 16 + saved + transient
    overhead = int(subtotal * (OVERHEAD - 1)) + FIXED_BYTES
    retained = per_layer * arch.num_layers * HEAP_RETAINED * OVERHEAD if host_heap else 0.0
    return MemoryEstimate(weights=int(weights), adapters=num_lora * 4, gradients=num_lora * 4,
                          optimizer=num_lora * 8, activations=int(saved),
                          logits=int(transient), overhead=overhead, retained=int(retained))
