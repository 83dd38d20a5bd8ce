"""Swap our Triton kernels into a transformers causal LM (optionally PEFT-wrapped), in place.

``apply_kernels(model, rms_norm=True, lora=True, cross_entropy=True)`` returns a
:class:`KernelReport` naming every module it changed. What it does per switch:

- ``rms_norm``: replaces each norm module of a supported family with :class:`RMSNorm` /
  :class:`GatedRMSNorm` that shares the original ``weight`` Parameter (same state-dict key, same
  tensor, so optimizers and checkpoints see no difference).
- ``lora``: routes the forward of every PEFT ``lora.Linear`` (vanilla LoRA on an ``nn.Linear``)
  through :func:`lora_linear`. The PEFT modules stay, so adapter save/load/merge work as before;
  layers in a state the kernel does not cover (merged, disabled, several active adapters, DoRA
  or other variants, LoRA bias, trainable base weight, mixed-adapter batches) fall back to PEFT's
  own forward per call. Call ``apply_kernels`` after ``get_peft_model``.
- ``cross_entropy``: in training mode with ``labels``, the ``*ForCausalLM`` forward computes the
  loss with :func:`fused_linear_cross_entropy` and returns ``logits=None`` (never materializing
  them); without labels or in eval mode it is the stock forward. ``num_items_in_batch``,
  ``shift_labels`` and ``ignore_index`` are honoured as in transformers' ``ForCausalLMLoss``.

Unsupported families and devices the kernels cannot run on (CPU without ``TRITON_INTERPRET=1``)
are left untouched with a :class:`KernelsWarning`. Nothing here changes parameter names or
shapes: a patched model's ``state_dict()`` loads into the stock model.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import warnings
from typing import Any

import torch
from torch import nn

from ._utils import supports_kernels
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .gated_rms_norm import GatedRMSNorm
from .lora_linear import lora_linear
from .rms_norm import RMSNorm


class KernelsWarning(UserWarning):
    """A requested kernel was not applied (unsupported family, device or layer)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Family:
    """Where a model family's norm classes live and how their weight is applied."""

    module: str
    """Import path of the family's ``modeling_*`` module."""
    norms: dict[str, float]
    """Norm class name -> weight offset (0: ``w * x_hat``; 1: ``(1 + w) * x_hat``)."""
    gated_norms: dict[str, float] = dataclasses.field(default_factory=dict)
    """Gated norm class name (``forward(x, gate)``) -> weight offset."""
    logit_softcapping: str | None = None
    """Config field of a final-logit soft cap (``tanh(z / c) * c``): the fused loss has no cap,
    so a model with the field set keeps its stock loss."""


# Keyed by ``config.model_type``; each class's forward was read and matched to our reference,
# and each family has a test in tests/kernels/test_patcher.py (add both together).
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(module="transformers.models.llama.modeling_llama",
                     norms={"LlamaRMSNorm": 0.0}),
    "qwen2": _Family(module="transformers.models.qwen2.modeling_qwen2",
                     norms={"Qwen2RMSNorm": 0.0}),
    "qwen3": _Family(module="transformers.models.qwen3.modeling_qwen3",
                     norms={"Qwen3RMSNorm": 0.0}),
    "qwen3_5_text": _Family(module="transformers.models.qwen3_5.modeling_qwen3_5",
                            norms={"Qwen3_5RMSNorm": 1.0},
                            gated_norms={"Qwen3_5RMSNormGated": 0.0}),
    # Gemma 3 text (Gemma3ForCausalLM): every norm, q_norm and k_norm included, is
    # ``(x_hat * (1 + w)).to(dtype)``; its embedding scale lives in the embedding module.
    "gemma3_text": _Family(module="transformers.models.gemma3.modeling_gemma3",
                           norms={"Gemma3RMSNorm": 1.0},
                           logit_softcapping="final_logit_softcapping"),
}

SUPPORTED_FAMILIES = tuple(sorted(_FAMILIES))
"""``config.model_type`` values whose norms and causal-LM forward the patcher knows."""


@dataclasses.dataclass(kw_only=True)
class KernelReport:
    """What :func:`apply_kernels` changed; empty lists mean nothing of that kind."""

    model_type: str | None
    """``config.model_type`` of the patched model (None when it has no config)."""
    rms_norm: list[str] = dataclasses.field(default_factory=list)
    """Qualified names of norm modules replaced by :class:`RMSNorm`."""
    gated_rms_norm: list[str] = dataclasses.field(default_factory=list)
    """Qualified names of gated norms replaced by :class:`GatedRMSNorm`."""
    lora: list[str] = dataclasses.field(default_factory=list)
    """Qualified names of PEFT LoRA linears whose forward now uses the fused kernel."""
    cross_entropy: str | None = None
    """Qualified name of the ``*ForCausalLM`` module whose loss is fused (None if not)."""
    skipped: list[str] = dataclasses.field(default_factory=list)
    """One line per requested kernel that was not applied, and why (also warned)."""

    @property
    def applied(self) -> bool:
        """Whether any kernel was swapped in."""
        return bool(self.rms_norm or self.gated_rms_norm or self.lora or self.cross_entropy)

    def summary(self) -> dict[str, Any]:
        """Counts and reasons, small enough for a log line or run metadata."""
        return {
            "model_type": self.model_type,
            "num_rms_norm": len(self.rms_norm),
            "num_gated_rms_norm": len(self.gated_rms_norm),
            "num_lora": len(self.lora),
            "cross_entropy": self.cross_entropy is not None,
            "skipped": list(self.skipped),
        }


def _skip(report: KernelReport, message: str, *, depth: int = 0) -> None:
    """Record and warn; ``depth`` is how many helpers sit between apply_kernels and here."""
    report.skipped.append(message)
    warnings.warn(message, KernelsWarning, stacklevel=3 + depth)


def _unwrap_peft(model: nn.Module) -> tuple[nn.Module, str]:
    """The transformers model inside a PEFT wrapper, and its qualified-name prefix."""
    prefix = ""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        base = get_base()
        for name, module in model.named_modules():
            if module is base:
                prefix = f"{name}." if name else ""
                break
        return base, prefix
    return model, prefix


def _set_child(root: nn.Module, qualified: str, child: nn.Module) -> None:
    parent_name, _, attr = qualified.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, child)


def _swap_norms(model: nn.Module, family: _Family, report: KernelReport) -> None:
    try:
        modeling = importlib.import_module(family.module)
    except ImportError as exc:  # a transformers release without this family
        _skip(report, f"rms_norm: cannot import {family.module}: {exc}", depth=1)
        return
    plain = {getattr(modeling, n): off for n, off in family.norms.items() if hasattr(modeling, n)}
    gated = {getattr(modeling, n): off for n, off in family.gated_norms.items()
             if hasattr(modeling, n)}
    # Collect first: replacing while iterating named_modules would skip siblings.
    targets = [(name, m) for name, m in model.named_modules() if type(m) in plain or
               type(m) in gated]
    for name, module in targets:
        if type(module) in plain:
            _set_child(model, name, RMSNorm.from_module(module, offset=plain[type(module)]))
            report.rms_norm.append(name)
        else:
            _set_child(model, name, GatedRMSNorm.from_module(module, offset=gated[type(module)]))
            report.gated_rms_norm.append(name)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _fused_lora_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT ``lora.Linear.forward`` through the fused kernel when the layer is in plain LoRA state."""
    stock = type(self).forward
    if args or kwargs or self.disable_adapters or self.merged:
        return stock(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self.lora_A]
    if len(active) != 1:
        return stock(self, x, *args, **kwargs)
    name = active[0]
    if name in getattr(self, "lora_variant", {}) or getattr(self, "use_dora", {}).get(name):
        return stock(self, x, *args, **kwargs)
    base = self.base_layer
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    dropout = self.lora_dropout[name]
    if isinstance(dropout, nn.Dropout):
        p = dropout.p if dropout.training else 0.0
    elif isinstance(dropout, nn.Identity):
        p = 0.0
    else:
        return stock(self, x, *args, **kwargs)
    if (type(base) is not nn.Linear or type(lora_a) is not nn.Linear
            or type(lora_b) is not nn.Linear or lora_a.bias is not None
            or lora_b.bias is not None or getattr(self, "fan_in_fan_out", False)
            or not supports_kernels(x.device)):
        return stock(self, x, *args, **kwargs)
    weight, bias = base.weight, base.bias
    if torch.is_grad_enabled() and (weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return stock(self, x, *args, **kwargs)
    a_w, b_w = lora_a.weight, lora_b.weight
    cast = _autocast_dtype(x.device)
    if cast is not None:
        # Under autocast nn.Linear (and so PEFT) computes every product in the autocast dtype.
        x, weight, a_w, b_w = x.to(cast), weight.to(cast), a_w.to(cast), b_w.to(cast)
        bias = bias.to(cast) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return lora_linear(x, weight, a_w, b_w, scale=self.scaling[name], bias=bias,
                               dropout_p=p)
    if x.dtype != weight.dtype:
        return stock(self, x, *args, **kwargs)
    return lora_linear(x, weight, a_w, b_w, scale=self.scaling[name], bias=bias, dropout_p=p)


def _patch_lora(model: nn.Module, prefix: str, report: KernelReport) -> None:
    try:
        from peft.tuners.lora.layer import Linear as PeftLoraLinear
    except ImportError:
        _skip(report, "lora: peft is not installed, no LoRA layers to fuse", depth=1)
        return
    for name, module in model.named_modules():
        if type(module) is PeftLoraLinear and type(module.base_layer) is nn.Linear:
            module.forward = types.MethodType(_fused_lora_forward, module)  # type: ignore[method-assign]
            report.lora.append(prefix + name)
    if not report.lora:
        _skip(report, "lora: no PEFT lora.Linear layers found (call apply_kernels after "
                      "get_peft_model)", depth=1)


def _fused_causal_lm_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``*ForCausalLM.forward`` computing the training loss without logits."""
    stock = type(self).forward
    labels = kwargs.get("labels")
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    lm_head = self.lm_head
    if (labels is None or not self.training or args or not isinstance(logits_to_keep, int)
            or logits_to_keep != 0 or type(lm_head) is not nn.Linear):
        return stock(self, *args, **kwargs)
    model_kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "logits_to_keep")}
    outputs = self.model(**model_kwargs)
    hidden = outputs.last_hidden_state
    weight: torch.Tensor = lm_head.weight
    bias: torch.Tensor | None = lm_head.bias
    cast = _autocast_dtype(hidden.device)
    if cast is not None:
        hidden, weight = hidden.to(cast), weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    elif hidden.dtype != weight.dtype:
        return stock(self, *args, **kwargs)
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    num_items = kwargs.get("num_items_in_batch")
    chunk_size = getattr(self, "_kernels_ce_chunk_size", 0)
    with torch.autocast(hidden.device.type, enabled=False):
        loss = fused_linear_cross_entropy(
            hidden, weight, shift_labels, bias=bias, ignore_index=ignore_index,
            reduction="mean" if num_items is None else "sum", chunk_size=chunk_size,
        )
    if num_items is not None:
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        loss = loss / num_items
    from transformers.modeling_outputs import CausalLMOutputWithPast

    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


def _patch_cross_entropy(model: nn.Module, prefix: str, chunk_size: int,
                         report: KernelReport) -> None:
    if not (type(model).__name__.endswith("ForCausalLM") and hasattr(model, "lm_head")
            and hasattr(model, "model")):
        _skip(report, f"cross_entropy: {type(model).__name__} is not a *ForCausalLM with "
                      "model + lm_head", depth=1)
        return
    # A plain attribute (not a buffer): it must not enter the state dict.
    object.__setattr__(model, "_kernels_ce_chunk_size", int(chunk_size))
    model.forward = types.MethodType(_fused_causal_lm_forward, model)  # type: ignore[method-assign]
    report.cross_entropy = prefix.rstrip(".") or type(model).__name__


def apply_kernels(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    lora: bool = True,
    cross_entropy: bool = True,
    cross_entropy_chunk_size: int = 0,
) -> KernelReport:
    """Swap the Triton kernels into ``model`` in place and report what changed.

    ``model`` is a transformers ``*ForCausalLM`` or a PEFT model wrapping one. A family outside
    :data:`SUPPORTED_FAMILIES`, or a model on a device the kernels cannot run on, is returned
    untouched with a :class:`KernelsWarning`. ``cross_entropy_chunk_size`` is rows per chunk for
    the fused loss (0: derived from hidden and vocabulary sizes).
    """
    if cross_entropy_chunk_size < 0:
        raise ValueError(f"cross_entropy_chunk_size must be >= 0, got {cross_entropy_chunk_size}")
    base, prefix = _unwrap_peft(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    report = KernelReport(model_type=model_type)
    if not (rms_norm or lora or cross_entropy):
        return report
    family = _FAMILIES.get(model_type) if model_type else None
    if family is None:
        _skip(report, f"model type {model_type!r} is not supported (supported: "
                      f"{', '.join(SUPPORTED_FAMILIES)}); model left unchanged")
        return report
    param = next(base.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if not supports_kernels(device):
        _skip(report, f"Triton kernels cannot run on {device} (need CUDA, or TRITON_INTERPRET=1 "
                      "for the slow CPU interpreter); model left unchanged")
        return report
    if rms_norm:
        _swap_norms(base, family, report)
    if lora:
        _patch_lora(base, prefix, report)
    if cross_entropy:
        cap = (getattr(config, family.logit_softcapping, None)
               if family.logit_softcapping else None)
        if cap is not None:
            _skip(report, f"cross_entropy: {model_type} caps its logits at {cap} "
                          f"({family.logit_softcapping}), which the fused loss does not do; "
                          "stock loss kept")
        else:
            _patch_cross_entropy(base, prefix, cross_entropy_chunk_size, report)
    return report
