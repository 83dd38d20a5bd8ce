"""Our kernels folder is named ``kernels``, like Hugging Face's hub-kernels package, which
transformers (5.25 on) requires and imports by that name. Installed, ours is ``factory.kernels``
and the top-level ``kernels`` is the hub package; where our folder itself is on the path under
that name (a checkout's root, the trainer image's /app), importing ``kernels`` hands over to the
installed hub package, so transformers gets what it asks for. These tests pin that down, and
that loading and running a model is the same whichever ``kernels`` the process saw first.
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


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What transformers sees of ``kernels`` with no checkout on the path: the hub package,
    from site-packages (transformers >= 5.25 requires it), or none at all."""
    report = _probe(tmp_path_factory.mktemp("elsewhere"))
    assert not report["found"] or not report["file"].startswith(str(ROOT / "kernels")), report
    return report


def test_installed_the_top_level_kernels_is_not_ours(installed: dict) -> None:
    if installed["found"]:
        assert installed["available"] and installed["version"] != "N/A", installed
        assert "site-packages" in installed["file"]
    else:  # a transformers older than 5.25 without it
        assert installed == {"found": False, "available": False}


def test_a_kernels_folder_on_the_path_hands_over_to_the_installed_package(
        installed: dict, tmp_path: Path) -> None:
    # The trainer image's layout: trainer/ and kernels/ side by side, ours first on the path.
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels")
    if installed["found"]:
        assert _probe(tmp_path) == installed
    else:  # nothing to hand over to: ours is imported, has no version and is ignored
        assert _probe(tmp_path) == {"found": True, "version": "N/A", "available": False,
                                    "file": str(tmp_path / "kernels" / "__init__.py")}


def test_the_checkout_root_on_the_path_gives_transformers_the_hub_package(
        installed: dict) -> None:
    assert _probe(ROOT) == installed


def test_importing_factory_kernels_has_no_side_effects(tmp_path: Path) -> None:
    code = ("import sys; before = set(sys.modules); import factory.kernels; "
            "print(sorted(set(sys.modules) - before - {'factory.kernels', 'factory'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True, timeout=60)
    assert json.loads(out.stdout.replace("'", '"')) == []


_HIDDEN_RUN = """
import sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=torch.arange(5, 17).view(1, 12)).logits
np.save(sys.argv[2], logits.numpy())
assert "factory" not in sys.modules
"""


@pytest.mark.slow
def test_model_loads_and_runs_the_same_with_our_package_present(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    import factory.kernels.patcher  # noqa: F401  ours, fully imported in this process

    hub = sys.modules.get("kernels")  # transformers >= 5.25 imported it: not our folder
    assert hub is None or not str(hub.__file__).startswith(str(ROOT / "kernels"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(5, 17).view(1, 12)).logits.numpy()
    out = tmp_path / "hidden.npy"
    subprocess.run([sys.executable, "-c", _HIDDEN_RUN, str(tiny_model_dir), str(out)],
                   cwd=tmp_path, env=INSTALLED, check=True, timeout=300)
    np.testing.assert_array_equal(logits, np.load(out))  # bit-identical
