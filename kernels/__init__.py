"""Triton kernels for the hot paths of LoRA fine-tuning, their autograd wrappers and torch references.

One op per module, each in three layers (Triton kernels + ``<Op>Function``, an ``nn.Module`` and
a functional ``<op>``) plus a pure-torch ``<op>_reference`` that the tests hold it to:

- ``kernels.rms_norm``: RMSNorm, optionally with a weight offset (``(offset + w) * x_hat``).
- ``kernels.gated_rms_norm``: RMSNorm with weight offset and a SiLU gate (gated-delta-net style).
- ``kernels.lora_linear``: ``x @ W^T + scale * dropout(x) @ A^T @ B^T``; the base weight is frozen.
- ``kernels.fused_linear_cross_entropy``: LM head + cross-entropy in row chunks, never the full logits.
- ``kernels.patcher``: ``apply_kernels(model, ...)`` swaps them into supported transformers models.

Installed, this package is ``factory.kernels`` (there is no top-level ``kernels`` to collide
with Hugging Face's hub package of that name, which transformers probes for by import name). Where
this folder is on the path as ``kernels`` (the trainer image copies it next to ``trainer/``),
transformers imports it to read a version, finds none and ignores it
(tests/kernels/test_transformers_probe.py checks both): this file deliberately imports nothing and
does nothing, so that import stays free of side effects and cheap. The modules import each other
relatively, so they work under either name. Import the submodules explicitly, e.g.
``from factory.kernels.patcher import apply_kernels``.
"""
