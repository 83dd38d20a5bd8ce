"""Triton kernels for the hot paths of LoRA fine-tuning, their autograd wrappers and torch references.

One op per module, each in three layers (Triton kernels + ``<Op>Function``, an ``nn.Module`` and
a functional ``<op>``) plus a pure-torch ``<op>_reference`` that the tests hold it to:

- ``kernels.rms_norm``: RMSNorm, optionally with a weight offset (``(offset + w) * x_hat``).
- ``kernels.gated_rms_norm``: RMSNorm with weight offset and a SiLU gate (gated-delta-net style).
- ``kernels.lora_linear``: ``x @ W^T + scale * dropout(x) @ A^T @ B^T``; the base weight is frozen.
- ``kernels.fused_linear_cross_entropy``: LM head + cross-entropy in row chunks, never the full logits.
- ``kernels.patcher``: ``apply_kernels(model, ...)`` swaps them into supported transformers models.

This file deliberately imports nothing and does nothing: transformers probes for Hugging Face's
hub package that is also importable as ``kernels``. Installed as ``llm-factory``, our version
number makes transformers ignore us, as long as it stays outside the hub package's accepted range
[0.18.2, 0.19.0) (tests/kernels/test_transformers_probe.py checks). Were the metadata missing,
transformers would import this module: it must stay free of side effects and cheap.
Import the submodules explicitly, e.g. ``from kernels.patcher import apply_kernels``.
"""
