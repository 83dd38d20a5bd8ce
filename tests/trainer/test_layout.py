"""The trainer runs from a plain copy of trainer/ and kernels/ (the trainer image: ``COPY
trainer/ trainer/``, ``COPY kernels/ kernels/``, ``python -m trainer``) as well as installed as
``factory.trainer``, and finds its kernels as its sibling package either way. The copies run
with ``factory`` made unimportable: the trainer needs nothing of the factory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_FACTORY = "import sys; sys.modules['factory'] = None  # any import of factory fails\n"


@pytest.fixture()
def image(tmp_path: Path) -> Path:
    """trainer/ and kernels/ side by side in an empty folder, as the image's /app holds them."""
    for name in ("trainer", "kernels"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _run_trainer(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    code = NO_FACTORY + ("import runpy; sys.argv = ['python -m trainer', *sys.argv[1:]]; "
                         "runpy.run_module('trainer', run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_the_image_layout_runs_python_m_trainer(image: Path) -> None:
    helped = _run_trainer(image, "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: python -m trainer")
    data = image / "d.parquet"
    data.write_bytes(b"")
    job = {"run_id": "r1", "output_dir": str(image / "out"), "data_files": [str(data)],
           "plan": {"base_model": "/models/m", "max_seq_len": 512, "learning_rate": 2e-4,
                    "num_steps": 10}}
    (image / "job.json").write_text(json.dumps(job))
    checked = _run_trainer(image, "--job", str(image / "job.json"), "--check")
    assert checked.returncode == 0, checked.stderr
    job["plan"]["learning_rate"] = -1
    (image / "job.json").write_text(json.dumps(job))
    bad = _run_trainer(image, "--job", str(image / "job.json"), "--check")
    assert bad.returncode == 2 and "plan.learning_rate" in bad.stderr


_KERNELS = """
import sys, torch
from {package}.model import apply_kernels
report = apply_kernels(torch.nn.Linear(2, 2))
print(report.model_type, "{package}" in sys.modules, sorted(m for m in sys.modules
      if m.endswith("kernels.patcher")))
"""


@pytest.mark.slow
def test_the_trainer_finds_its_sibling_kernels_in_both_layouts(image: Path,
                                                               tmp_path: Path) -> None:
    copied = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", NO_FACTORY + _KERNELS.format(package="trainer")],
        cwd=image, capture_output=True, text=True, timeout=300)
    assert copied.returncode == 0, copied.stderr
    assert copied.stdout.split("\n")[0] == "None True ['trainer_kernels.patcher']"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    installed = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _KERNELS.format(package="factory.trainer")],
        cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.split("\n")[0] == "None True ['factory.kernels.patcher']"
