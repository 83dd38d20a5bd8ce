"""Our kernels folder is named ``kernels``, like Hugging Face's hub-kernels package that
transformers probes for by import name. Installed, ours is ``factory.kernels`` and there is no
top-level ``kernels`` at all; where the folder itself is on the path (the trainer image, a
checkout), transformers imports it, finds no version and ignores it. These tests pin both down,
and that loading and running a model is unchanged with ours imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
"""The environment of a process that sees only what is installed (no checkout on the path)."""

_PROBE = """
import importlib.util, json
from transformers.utils import import_utils
report = {"found": importlib.util.find_spec("kernels") is not None}
if report["found"]:
    report["version"] = import_utils._is_package_available("kernels", return_version=True)[1]
    report["file"] = __import__("kernels").__file__
report["available"] = import_utils.is_kernels_available()
print(json.dumps(report))
"""


def _probe(cwd: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=cwd, env=INSTALLED,
                         capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


def test_installed_there_is_no_top_level_kernels(tmp_path: Path) -> None:
    assert _probe(tmp_path) == {"found": False, "available": False}


def test_a_kernels_folder_on_the_path_is_imported_and_ignored(tmp_path: Path) -> None:
    # The trainer image's layout: trainer/ and kernels/ side by side, no installed metadata.
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels")
    assert _probe(tmp_path) == {"found": True, "version": "N/A", "available": False,
                                "file": str(tmp_path / "kernels" / "__init__.py")}


@pytest.mark.parametrize(("name", "where"), [("kernels", "checkout"), ("factory.kernels", "tmp")])
def test_importing_kernels_has_no_side_effects(name: str, where: str, tmp_path: Path) -> None:
    code = (f"import sys; before = set(sys.modules); import {name}; "
            f"print(sorted(set(sys.modules) - before - {{{name!r}, 'factory'}}))")
    cwd = ROOT if where == "checkout" else tmp_path
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout.replace("'", '"')) == []


_HIDDEN_RUN = """
import sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
from transformers.utils import import_utils
assert not import_utils._is_package_available("kernels")[0]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=torch.arange(5, 17).view(1, 12)).logits
np.save(sys.argv[2], logits.numpy())
assert "kernels" not in sys.modules and "factory" not in sys.modules
"""


@pytest.mark.slow
def test_model_loads_and_runs_the_same_with_our_package_present(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    import factory.kernels.patcher  # noqa: F401  ours, fully imported in this process

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(5, 17).view(1, 12)).logits.numpy()
    out = tmp_path / "hidden.npy"
    subprocess.run([sys.executable, "-c", _HIDDEN_RUN, str(tiny_model_dir), str(out)],
                   cwd=tmp_path, env=INSTALLED, check=True, timeout=300)
    np.testing.assert_array_equal(logits, np.load(out))  # bit-identical
