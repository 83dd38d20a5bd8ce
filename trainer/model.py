"""Base model + LoRA, and a loss that never builds the full-vocabulary logits.

``CausalLMLoss`` runs the decoder, keeps only the hidden states of positions that have a target
(assistant tokens), and computes the cross-entropy through the LM head in chunks of
``LOSS_CHUNK_TOKENS``; for the usual frozen head the gradient of each chunk is computed in
forward (``_FusedLinearCE``), so logits exist for one chunk at a time and backward is a scale.
Plain ``ForCausalLM.forward`` materializes [batch, length, vocab] logits plus their fp32 copy
and gradient: for SmolLM2 (vocab 49152) at 4 x 1536 tokens that is ~3.6 GB, the bulk of a CPU
run's peak memory. Here the peak is one chunk: 1024 x 49152 x 4 B = 200 MB.

On CPU, packed rows attend per sample (``packed_sdpa_attention``): one causal SDPA call per
segment instead of one masked call over the whole row (a shared-prefix row: the prefix's
causal call, then one masked call for all its samples' rests, ``_rests_in_one_call``). The
result is the block-diagonal mask's, but the cost is the sum of the squared sample lengths
instead of the squared row length, and the unmasked causal kernel is ~2x faster than the masked
one (bench/trainer.py).

A batch with images (a vision-language model: ``Batch.pixel_values``) runs through the model's
multimodal body instead of its decoder alone: the frozen vision tower encodes the images and
their features replace the ``<|image_pad|>`` embeddings. Qwen2.5-VL's rotary positions are 3-D
(temporal, height, width) over an image and 1-D over text; ``mrope_positions`` computes them for
each packed segment alone (the model's ``get_rope_index`` over the segment), so image samples
pack like text ones, and passes the per-sample text positions as the first of four rows, which
is what transformers derives the packed (block-diagonal) mask from.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .chat import IGNORE_INDEX
from .config import PLAIN_ATTENTION_MODELS, REST_CALL_WORK, TrainConfig
from .progress import quiet_progress_bars
from .token_rows import fast_token_rows, head_rows

LOSS_CHUNK_TOKENS = 1024
PACKED_ATTENTION = "factory_packed_sdpa"


def auto_model_class(base_model: str) -> Any:
    """The transformers auto class that loads ``base_model`` with its LM head: causal LMs, and
    image-text-to-text models (Qwen2.5-VL: vision tower + causal LM) that have no causal-LM
    class."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(base_model).model_type
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def load_model(plan: TrainConfig, device: torch.device) -> Any:
    """The base model with LoRA adapters (PEFT), on ``device``; only adapters train."""
    from peft import LoraConfig, get_peft_model

    dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float32
    quiet_progress_bars()
    base = auto_model_class(plan.base_model).from_pretrained(plan.base_model, dtype=dtype,
                                                             attn_implementation="sdpa")
    plain = _plain_attention(base.config, plan.max_seq_len)
    if plan.share_prefix and not plain:
        raise ValueError(f"plan.share_prefix: needs plain causal attention, and "
                         f"{getattr(base.config, 'model_type', '?')} is not one of "
                         f"{', '.join(sorted(PLAIN_ATTENTION_MODELS))} (or has a sliding "
                         f"window or logit softcapping)")
    if plain and (device.type == "cpu" or plan.share_prefix):
        # Measured on CPU; on a GPU the per-segment loop is more kernel launches, where a
        # varlen flash kernel would be the right tool, so GPUs keep the masked SDPA call
        # unless rows share prefixes, which only the per-segment attention expresses.
        _register_packed_attention()
        base.set_attn_implementation(PACKED_ATTENTION)
    base.config.use_cache = False
    names = [n for n, _ in base.named_modules()]
    for prefix in plan.frozen_modules:
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            raise ValueError(f"plan.frozen_modules: the model has no module {prefix!r}")
    targets: Any = ("all-linear" if plan.lora_target_modules == ["all-linear"]
                    else list(plan.lora_target_modules))
    if targets != "all-linear":
        leaves = {n.rsplit(".", 1)[-1] for n in names}
        for t in targets:
            if t not in leaves:
                raise ValueError(f"plan.lora_target_modules: the model has no module {t!r}")
    exclude = None
    if plan.frozen_modules:
        exclude = "^(" + "|".join(re.escape(p) for p in plan.frozen_modules) + r")(\..*)?$"
    if plan.trainable_token_ids:
        embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
        bad = [i for i in plan.trainable_token_ids if i >= embedding.num_embeddings]
        if bad:
            raise ValueError(f"plan.trainable_token_ids: {bad} are not in the model's embedding "
                             f"({embedding.num_embeddings} rows)")
        if head is None or head.weight is not embedding.weight:
            raise ValueError("plan.trainable_token_ids: needs a model whose output head is tied "
                             "to its input embedding (the trained rows serve both)")
    config = LoraConfig(r=plan.lora_rank, lora_alpha=plan.lora_alpha,  # type: ignore[arg-type]  # peft accepts floats
                        lora_dropout=plan.lora_dropout, target_modules=targets,
                        exclude_modules=exclude, bias="none", task_type="CAUSAL_LM",
                        trainable_token_indices=list(plan.trainable_token_ids) or None)
    # Adapter init draws from the global generator: seeded by the caller for reproducibility.
    with warnings.catch_warnings():
        # peft 0.21 probes transformers' deprecated `is_gradient_checkpointing`.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        model = get_peft_model(base, config)
    fast_token_rows(model)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert not any(f".{f}." in f".{name}." for f in plan.frozen_modules), name
            if p.dtype != torch.float32:
                p.data = p.data.float()  # adapters always train in fp32
    if plan.precision == "bf16-autocast" and not plan.use_kernels and plan.parallelism == "single":
        # (The kernels patcher and FSDP2's flat shards are left with the dtypes they expect.)
        _store_frozen_linears_in(model, torch.bfloat16)
    if plan.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = model.to(device)
    if plan.use_kernels:
        report = apply_kernels(model)
        object.__setattr__(model, "factory_kernel_report", report)  # not a Module attribute
    return model


def apply_kernels(model: Any) -> Any:
    """Our Triton kernels swapped into ``model`` (opt-in: ``kernels/`` is optional for the
    trainer); the ``KernelReport`` of what changed.

    The kernels are the trainer's sibling package: ``factory.kernels`` when installed; where
    ``trainer/`` and ``kernels/`` are copied side by side (the trainer image), the sibling folder
    loaded as ``trainer_kernels``, since the top-level name ``kernels`` is Hugging Face's
    hub-kernels package (transformers requires it).
    """
    if __name__.count(".") > 1:
        # only when installed as factory.trainer; a copied trainer loads its sibling folder
        from ..kernels import patcher
    else:
        patcher = _sibling_patcher()

    # Our loss never calls the *ForCausalLM forward, so its fused cross-entropy patch would be
    # dead code: CausalLMLoss already avoids the logits. Norms and LoRA linears apply.
    return patcher.apply_kernels(model, cross_entropy=False)


SIBLING_KERNELS = "trainer_kernels"
"""The name the image's ``kernels/`` folder is loaded under (see ``apply_kernels``)."""


def _sibling_patcher() -> Any:
    """``patcher`` of the ``kernels/`` folder next to this ``trainer/``, the folder imported as
    ``SIBLING_KERNELS`` (its modules import each other relatively)."""
    import importlib
    import importlib.util

    if SIBLING_KERNELS not in sys.modules:
        folder = Path(__file__).resolve().parent.parent / "kernels"
        spec = importlib.util.spec_from_file_location(
            SIBLING_KERNELS, folder / "__init__.py", submodule_search_locations=[str(folder)])
        if spec is None or spec.loader is None:
            raise ImportError(f"no kernels package next to the trainer at {folder}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[SIBLING_KERNELS] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[SIBLING_KERNELS]
            raise
    return importlib.import_module(f"{SIBLING_KERNELS}.patcher")


def _store_frozen_linears_in(model: Any, dtype: torch.dtype) -> None:
    """Frozen ``nn.Linear`` weights and biases in ``dtype`` (the autocast dtype).

    Autocast casts them to ``dtype`` at every use anyway and keeps the casts alive for
    backward, so storing them cast gives the same results bit for bit (tests/trainer/
    test_model.py), without the per-step copies and with half their memory. The output head is
    left alone: it is usually tied to the input embedding, whose fp32 output feeds the residual
    stream.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    tied = {id(p) for p in head.parameters()} if head is not None else set()
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        params = list(module.parameters(recurse=False))
        if any(p.requires_grad or id(p) in tied for p in params):
            continue
        for p in params:
            p.data = p.data.to(dtype)


def _plain_attention(config: Any, max_seq_len: int) -> bool:
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    return (getattr(config, "model_type", None) in PLAIN_ATTENTION_MODELS
            and (window is None or window >= max_seq_len)
            and not getattr(config, "attn_logit_softcapping", None))


def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    # Calls without segments (padded rows with an attention mask) get exactly sdpa's mask.
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)


def packed_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          segments: list[list[int]] | None = None,
                          segment_starts: list[list[int]] | None = None, **kwargs: Any
                          ) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal SDPA within each packed segment.

    ``segments`` (from ``CausalLMLoss``) gives each row's segment lengths; without it this is
    transformers' own SDPA attention. ``segment_starts`` gives each segment's first position:
    a segment starting at ``p > 0`` continues the row's first ``p`` tokens (a shared prefix,
    ``trainer.data.collate_shared``) and attends to them as well as causally to itself.
    query/key/value are [B, heads, L, head_dim]; returns [B, L, heads, head_dim] like every
    transformers attention function.
    """
    if segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for b, lengths in enumerate(segments):
        firsts = segment_starts[b] if segment_starts is not None else [0] * len(lengths)
        if _rests_in_one_call(tuple(lengths), tuple(firsts)):
            # A shared-prefix row: the prefix causally, then every rest in one call over the
            # whole row's keys, masked to the prefix and the rest's own causal block.
            head = lengths[0]
            mask = _rests_mask(tuple(lengths), tuple(firsts), query.device)
            rows.append(torch.cat([
                F.scaled_dot_product_attention(
                    query[b:b + 1, :, :head], key[b:b + 1, :, :head], value[b:b + 1, :, :head],
                    dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa),
                F.scaled_dot_product_attention(
                    query[b:b + 1, :, head:], key[b:b + 1], value[b:b + 1], attn_mask=mask,
                    dropout_p=dropout, scale=scaling, enable_gqa=gqa)], dim=2))
            continue
        parts = []
        start = 0
        for n, p in zip(lengths, firsts, strict=True):
            end = start + n
            q = query[b:b + 1, :, start:end]
            if p and start:
                assert p <= lengths[0], "a continued segment's prefix opens the row"
                k = torch.cat([key[b:b + 1, :, :p], key[b:b + 1, :, start:end]], dim=2)
                v = torch.cat([value[b:b + 1, :, :p], value[b:b + 1, :, start:end]], dim=2)
                mask = torch.ones(n, p + n, dtype=torch.bool, device=query.device)
                mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
                parts.append(F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa))
            else:
                parts.append(F.scaled_dot_product_attention(
                    q, key[b:b + 1, :, start:end], value[b:b + 1, :, start:end],
                    dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa))
            start = end
        assert start == query.shape[2], "segments must cover the row"
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def _rests_in_one_call(lengths: tuple[int, ...], firsts: tuple[int, ...]) -> bool:
    """Whether a row's segments after its first attend in one masked call: the row continues a
    shared prefix (a segment after the first starts at a position > 0) and the one call's pairs
    (the rests' tokens x the row's) stay within ``REST_CALL_WORK`` times the pairs needed.

    Measured on SmolLM2's attention (9 heads, 3 key-value heads, bf16), forward and backward,
    8 rests, milliseconds a layer, one call for all against one call a rest: beside a training
    run, a 593-token prefix and rests of 60-130 tokens (the agent task, 2.0x the pairs needed)
    214-268 against 690-1,142; a 686-token prefix and rests of ~25 (CLINC150, 1.2x) 109-112
    against 450-567; a 54-token prefix and rests of 39 (triage, 3.9x) 29-94 against 220-350;
    alone, CLINC150's shape over 30 layers 0.75-1.2 s against 1.4-2.0 s. The bound keeps a row
    of long rests behind a short prefix from computing many times the pairs it needs."""
    if len(lengths) < 2 or not any(firsts[1:]):
        return False
    rest = sum(lengths[1:])
    needed = sum(n * (p + n) for n, p in zip(lengths[1:], firsts[1:], strict=True))
    return rest * sum(lengths) <= REST_CALL_WORK * needed


@functools.lru_cache(maxsize=8)
def _rests_mask(lengths: tuple[int, ...], firsts: tuple[int, ...], device: torch.device
                ) -> torch.Tensor:
    """[tokens after the first segment, row tokens]: each segment after the first sees the
    row's first ``p`` tokens (its position start ``p``; none where 0) and causally itself."""
    head, total = lengths[0], sum(lengths)
    mask = torch.zeros(total - head, total, dtype=torch.bool, device=device)
    start = head
    for n, p in zip(lengths[1:], firsts[1:], strict=True):
        assert p <= head, "a continued segment's prefix opens the row"
        rows = slice(start - head, start - head + n)
        mask[rows, :p] = True
        mask[rows, start:start + n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        start += n
    return mask


def segment_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row, the lengths of the runs of consecutive positions (a packed sample each).

    The same boundaries transformers derives its packed mask from
    (``masking_utils.find_packed_sequence_indices``): a new segment wherever the position is
    not the previous one plus one.
    """
    pos = position_ids.detach().cpu()
    breaks = torch.ones_like(pos, dtype=torch.bool)
    breaks[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    out = []
    for row in breaks:
        starts = row.nonzero().flatten().tolist() + [row.numel()]
        out.append([b - a for a, b in zip(starts, starts[1:], strict=False)])
    return out


def segment_starts(position_ids: torch.Tensor, segments: list[list[int]]) -> list[list[int]]:
    """Per row, the first position of each of its ``segments`` (0 but for shared-prefix rests)."""
    pos = position_ids.detach().cpu()
    out = []
    for b, lengths in enumerate(segments):
        firsts, start = [], 0
        for n in lengths:
            firsts.append(int(pos[b, start]))
            start += n
        out.append(firsts)
    return out


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="sum")


class _FusedLinearCE(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` (+ bias) against ``targets``, chunked.

    The gradient with respect to ``hidden`` is computed chunk by chunk in forward, so neither
    the logits nor their gradient ever exist for more than one chunk, and backward is a scale.
    Only for a frozen head (the usual LoRA case); a trainable head uses checkpointed chunks.
    ``idx`` and ``rows``: trained rows that replace those of ``weight`` (a tied head's trainable
    tokens, ``token_rows.head_rows``); their gradient is computed in forward too.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, idx: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden)
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            # The cast autocast would make for each of the two matmuls of every chunk, once:
            # the same values, one vocab x hidden copy per step instead of two per chunk.
            weight = weight.to(torch.get_autocast_dtype(device))
        grad_rows = None
        if idx is not None and rows is not None:
            trained = rows.detach().to(weight.dtype)
            change = trained - weight[idx]
            grad_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        for i in range(0, targets.numel(), LOSS_CHUNK_TOKENS):
            h, t = hidden[i:i + LOSS_CHUNK_TOKENS], targets[i:i + LOSS_CHUNK_TOKENS]
            logits = F.linear(h, weight, bias).float()
            if grad_rows is not None:
                logits[:, idx] = F.linear(h.to(weight.dtype), trained).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            probs = torch.exp(logits.sub_(lse[:, None]))
            probs[torch.arange(t.numel(), device=t.device), t] -= 1.0
            g = probs.to(weight.dtype) @ weight
            if grad_rows is not None:
                p = probs[:, idx].to(weight.dtype)
                g = g + p @ change
                grad_rows += (p.T @ h.to(weight.dtype)).float()
            grad[i:i + LOSS_CHUNK_TOKENS] = g.to(grad.dtype)
        ctx.save_for_backward(grad, grad_rows)
        ctx.rows_dtype = rows.dtype if rows is not None else None
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grad, grad_rows = ctx.saved_tensors
        scale = grad_out.to(grad.dtype)
        rows_grad = None if grad_rows is None else (grad_rows * grad_out).to(ctx.rows_dtype)
        return grad * scale, None, None, None, None, rows_grad


class CausalLMLoss(nn.Module):
    """Summed token cross-entropy of a (PEFT) causal LM on the labeled positions of a batch.

    One module so FSDP2 can shard it as the root (the embedding, final norm and head are
    unsharded by its forward).
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = base.get_decoder()
        self.head = base.get_output_embeddings()
        self.packed_attention = \
            getattr(base.config, "_attn_implementation", None) == PACKED_ATTENTION
        body = getattr(base, "model", None)
        self.multimodal = body if hasattr(body, "visual") and hasattr(body, "get_rope_index") \
            else None
        """The multimodal body (vision tower + decoder) of a vision-language model, else None."""

    def mrope_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                        image_grid_thw: torch.Tensor) -> torch.Tensor:
        """[4, B, L]: the per-sample text positions, then the 3-D rotary positions, each packed
        segment's computed alone from its tokens and its images' grids."""
        assert self.multimodal is not None
        image_id = self.multimodal.config.image_token_id
        rope = position_ids[None].repeat(3, 1, 1)
        grids = list(image_grid_thw)
        used = 0
        for b, lengths in enumerate(segment_lengths(position_ids)):
            start = 0
            for n in lengths:
                seg = input_ids[b, start:start + n]
                is_image = seg == image_id
                num_images = int(is_image[0]) + int((is_image[1:] & ~is_image[:-1]).sum())
                if num_images:
                    pos, _ = self.multimodal.get_rope_index(
                        seg[None], is_image[None].int(),
                        image_grid_thw=torch.stack(grids[used:used + num_images]))
                    rope[:, b, start:start + n] = pos[:, 0] + position_ids[b, start]
                    used += num_images
                start += n
        assert used == len(grids), "every image has its tokens in the batch"
        return torch.cat([position_ids[None], rope])

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None, pixel_values: torch.Tensor | None = None,
               image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        extra: dict[str, Any] = {}
        if self.packed_attention and attention_mask is None:
            segments = segment_lengths(position_ids)
            extra["segments"] = segments
            starts = segment_starts(position_ids, segments)
            if any(p for row in starts for p in row[1:]):
                extra["segment_starts"] = starts
        if pixel_values is not None:
            if self.multimodal is None or image_grid_thw is None:
                raise ValueError("pixel_values: the model has no vision tower")
            out = self.multimodal(
                input_ids=input_ids, attention_mask=attention_mask,
                position_ids=self.mrope_positions(input_ids, position_ids, image_grid_thw),
                pixel_values=pixel_values, image_grid_thw=image_grid_thw, use_cache=False,
                **extra)
            return out.last_hidden_state
        out = self.decoder(input_ids=input_ids, position_ids=position_ids,
                           attention_mask=attention_mask, use_cache=False, **extra)
        return out.last_hidden_state

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, labels: torch.Tensor, *,
                pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden(input_ids, position_ids, attention_mask, pixel_values,
                        image_grid_thw)[:, :-1]
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        h, targets = h[keep], targets[keep]
        trained = head_rows(self.head) if torch.is_grad_enabled() else None
        if trained is not None:
            return _FusedLinearCE.apply(h, trained[0], None, targets, trained[1], trained[2])
        head = self.head if isinstance(self.head, nn.Linear) else None
        if torch.is_grad_enabled() and head is not None and not head.weight.requires_grad \
                and (head.bias is None or not head.bias.requires_grad):
            return _FusedLinearCE.apply(h, head.weight, head.bias, targets)
        total = h.new_zeros((), dtype=torch.float32)
        for i in range(0, targets.numel(), LOSS_CHUNK_TOKENS):
            hc, tc = h[i:i + LOSS_CHUNK_TOKENS], targets[i:i + LOSS_CHUNK_TOKENS]
            if torch.is_grad_enabled():
                total = total + checkpoint(_chunk_loss, self.head, hc, tc, use_reentrant=False)
            else:
                total = total + _chunk_loss(self.head, hc, tc)
        return total

    @torch.no_grad()
    def token_losses(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None, labels: torch.Tensor, *,
                     pixel_values: torch.Tensor | None = None,
                     image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """[B, L-1] loss of predicting token i+1 at position i (0 where unlabeled)."""
        h = self.hidden(input_ids, position_ids, attention_mask, pixel_values,
                        image_grid_thw)[:, :-1]
        logits = self.head(h).float()
        targets = labels[:, 1:]
        losses = F.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0), reduction="none")
        return losses * (targets != IGNORE_INDEX)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter weights under PEFT's saved key names, unsharded (DTensors gathered one
    adapter tensor at a time: never the full model)."""
    from peft import get_peft_model_state_dict

    full = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = p.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            full[name] = t.cpu().clone()
    return get_peft_model_state_dict(model, state_dict=full)


def load_adapter_state(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved adapter weights into the (possibly sharded) live parameters."""
    from peft import set_peft_model_state_dict

    sharded = any(hasattr(p, "device_mesh") for p in model.parameters() if p.requires_grad)
    if not sharded:
        result = set_peft_model_state_dict(model, tensors)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"resume_from: checkpoint has unknown adapter keys {unexpected[:3]}")
        return
    from torch.distributed.tensor import distribute_tensor

    by_name = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            by_name[name.replace(".default.", ".")] = p
    # Sorted: distribute_tensor is a collective, and safetensors' dict order differs between
    # processes (it was a rank-dependent order that deadlocked gloo).
    for key in sorted(tensors):
        p, value = by_name[key], tensors[key]
        with torch.no_grad():
            p.copy_(distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements))
