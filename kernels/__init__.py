"""Triton kernels for the hot paths of LoRA fine-tuning, their autograd wrappers and torch references.

One op per module, each in three layers (Triton kernels + ``<Op>Function``, an ``nn.Module`` and
a functional ``<op>``) plus a pure-torch ``<op>_reference`` that the tests hold it to:

- ``kernels.rms_norm``: RMSNorm, optionally with a weight offset (``(offset + w) * x_hat``).
- ``kernels.gated_rms_norm``: RMSNorm with weight offset and a SiLU gate (gated-delta-net style).
- ``kernels.lora_linear``: ``x @ W^T + scale * dropout(x) @ A^T @ B^T``; the base weight is frozen.
- ``kernels.fused_linear_cross_entropy``: LM head + cross-entropy in row chunks, never the full logits.
- ``kernels.patcher``: ``apply_kernels(model, ...)`` swaps them into supported transformers models.

Installed, this package is ``factory.kernels``: the top-level name ``kernels`` belongs to
Hugging Face's hub-kernels package, which transformers (5.25 on) requires and imports. Where this
folder is on the path under that name (a checkout's root on ``sys.path``: pytest, ``python -m``
or ``python -c`` run in the checkout; the trainer image's ``/app``), the code below hands the
import over to the installed hub package, so transformers gets the package it asks for; with none
installed the import stays this empty module (older transformers find no version and ignore it).
The trainer image loads this folder under another name (``trainer.model.apply_kernels``);
tests/kernels/test_transformers_probe.py checks each case. The modules import each other
relatively, so they work under any package name. Import the submodules explicitly, e.g.
``from factory.kernels.patcher import apply_kernels``.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout])
    if _spec is not None and _spec.loader is not None:
        _hub = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _hub  # what the import statement returns
        _spec.loader.exec_module(_hub)
