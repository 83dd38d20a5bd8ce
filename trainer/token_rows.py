"""Trained embedding rows of a few tokens (PEFT's trainable tokens) without copying the matrix.

A base model that was never instruction-tuned has never seen its chat format's turn tokens:
their embedding rows are untrained near-copies of the unused tokens' (Gemma 3 270M:
``<end_of_turn>`` has cosine 0.995 with them), and with a tied output head LoRA alone is slow
to learn to end a turn, since a direction that raises ``<end_of_turn>``'s logit raises those of
the tokens it was copied like. Training those rows (``TrainConfig.trainable_token_ids``) gives
the token an embedding of its own: on the Gemma demo's dev requests every answer ends its turn
at step 8 with them and none without (by step 24 both do; BENCHMARKS.md "Model families").

PEFT's ``TrainableTokensLayer`` does that by writing the trained rows into a copy of the whole
embedding matrix on every call (``index_copy``), for the input embedding and again for a tied
head: for Gemma 3 270M (262,144 x 640 float32) two 671 MB copies per forward pass, more than a
decode step's compute on a CPU. ``fast_token_rows(model)`` gives each such layer a forward that
computes with the frozen matrix and puts the trained rows in afterwards: positions holding a
trained token take its row (times the embedding's scale, as Gemma's scaled embedding does); a
head's logits take ``x @ rows.T`` in the trained tokens' columns. The values are PEFT's
(tests/trainer/test_token_rows.py); the saved weights, key names and config are PEFT's, so
PEFT, a merge and any server that reads PEFT adapters read them as before.

``head_rows(head)``: the frozen weight, the token ids and their trained rows of a tied head, for
the trainer's fused loss (``model._FusedLinearCE``), which never builds more than a chunk of
logits.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _forward_adapters(self: Any, x: torch.Tensor, active_adapters: Any, *args: Any,
                      **kwargs: Any) -> torch.Tensor:
    """``TrainableTokensLayer.forward_adapters`` with the frozen matrix plus the trained rows
    (the class's own where that is not what it computes: adapters off or merged, a head with a
    bias)."""
    base = self.base_layer
    plain = (self.disable_adapters or not active_adapters or self.merged
             or not isinstance(base, (nn.Embedding, nn.Linear))
             or (isinstance(base, nn.Linear) and base.bias is not None))
    if plain:
        return type(self).forward_adapters(self, x, active_adapters, *args, **kwargs)
    self._check_overlapping_tokens(active_adapters)
    if isinstance(base, nn.Embedding):
        out = base(x, *args, **kwargs)
        scale = self._get_embed_scale()
        for name in active_adapters:
            idx = torch.tensor(self.token_indices[name], device=x.device)
            hit = x[..., None] == idx
            rows = F.embedding(hit.int().argmax(-1),
                               self.trainable_tokens_delta[name].to(out.dtype))
            if scale is not None:
                rows = rows * scale.to(rows.dtype)
            out = torch.where(hit.any(-1, keepdim=True), rows, out)
        return out
    out = base(x)
    for name in active_adapters:
        idx = torch.tensor(self.token_indices[name], device=x.device)
        cols = F.linear(x, self.trainable_tokens_delta[name].to(x.dtype))
        out = out.index_copy(out.dim() - 1, idx, cols.to(out.dtype))
    return out


def fast_token_rows(model: nn.Module) -> None:
    """Give every PEFT trainable-tokens layer of ``model`` the copy-free forward (a model
    without trainable tokens is left as it is)."""
    for module in model.modules():
        if type(module).__name__ == "TrainableTokensLayer" \
                and "forward_adapters" not in vars(module):
            vars(module)["forward_adapters"] = MethodType(_forward_adapters, module)


def head_rows(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(frozen weight, token ids, trained rows) of ``head`` when it is a PEFT trainable-tokens
    wrapper over a frozen bias-free ``nn.Linear`` with one active, unmerged adapter; else None."""
    layer = getattr(head, "token_adapter", None)
    if layer is None or type(layer).__name__ != "TrainableTokensLayer":
        return None
    base = layer.base_layer
    active = list(layer.active_adapters)
    if (not isinstance(base, nn.Linear) or base.bias is not None or base.weight.requires_grad
            or layer.disable_adapters or layer.merged or len(active) != 1):
        return None
    rows = layer.trainable_tokens_delta[active[0]]
    idx = torch.tensor(layer.token_indices[active[0]], device=rows.device)
    return base.weight, idx, rows
