"""Our top-level package is named ``kernels``, like Hugging Face's hub-kernels package that
transformers probes for by import name. These tests pin down that transformers never mistakes
ours for it, and that loading and running a model is unchanged with ours importable.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.utils import import_utils

ROOT = Path(__file__).resolve().parents[2]


def test_installed_metadata_makes_transformers_ignore_our_package():
    available, version = import_utils._is_package_available("kernels", return_version=True)
    # Found by import name, versioned as llm-factory (0.x: outside the hub package's accepted
    # range [KERNELS_MIN_VERSION, KERNELS_MAX_VERSION)), so not "available" as hub kernels.
    assert available and version == importlib.metadata.version("llm-factory")
    import_utils.is_kernels_available.cache_clear()
    try:
        assert not import_utils.is_kernels_available()
    finally:
        import_utils.is_kernels_available.cache_clear()


def test_without_metadata_transformers_imports_us_and_still_ignores_us(monkeypatch):
    # A checkout on sys.path without `pip install -e .`: transformers falls back to importing
    # `kernels` and reading __version__; ours has none and must import nothing heavy.
    def no_metadata(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(import_utils.importlib.metadata, "version", no_metadata)
    available, version = import_utils._is_package_available("kernels", return_version=True)
    assert available and version == "N/A"
    import_utils.is_kernels_available.cache_clear()
    try:
        assert not import_utils.is_kernels_available()
    finally:
        import_utils.is_kernels_available.cache_clear()


def test_importing_kernels_has_no_side_effects():
    code = ("import sys; before = set(sys.modules); import kernels; "
            "print(sorted(set(sys.modules) - before - {'kernels'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout.replace("'", '"')) == []


_HIDDEN_RUN = """
import sys
# Drop the editable-install finder (run from a tmp dir, so the checkout is not on sys.path):
# in this process there is no package named kernels at all.
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
import numpy as np, torch
from transformers import AutoModelForCausalLM
from transformers.utils import import_utils
assert not import_utils._is_package_available("kernels")[0]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=torch.arange(5, 17).view(1, 12)).logits
np.save(sys.argv[2], logits.numpy())
assert "kernels" not in sys.modules
"""


@pytest.mark.slow
def test_model_loads_and_runs_the_same_with_our_package_present(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    import kernels.patcher  # noqa: F401  ours, fully imported in this process

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(5, 17).view(1, 12)).logits.numpy()
    out = tmp_path / "hidden.npy"
    subprocess.run([sys.executable, "-c", _HIDDEN_RUN, str(tiny_model_dir), str(out)],
                   cwd=tmp_path, check=True, timeout=300)
    np.testing.assert_array_equal(logits, np.load(out))  # bit-identical
