"""The code location loads, and every asset is described, grouped and typed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg

ROOT = Path(__file__).resolve().parents[2]


def test_every_asset_has_group_description_and_kinds() -> None:
    from factory.definitions import defs

    graph = defs.resolve_asset_graph()
    keys = list(graph.get_all_asset_keys())
    assert dg.AssetKey("base_model") in keys
    for spec in defs.resolve_all_asset_specs():
        assert spec.group_name and spec.group_name != "default", spec.key
        assert spec.description, spec.key
        assert spec.kinds, spec.key


def test_workspace_validates(factory_home: Path) -> None:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w",
         "workspace.yaml"], cwd=ROOT, capture_output=True, text=True, timeout=180,
        env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Validation successful" in out.stdout + out.stderr
