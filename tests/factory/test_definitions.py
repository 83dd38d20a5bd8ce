"""The code location loads, every asset is described, grouped and typed, and the resources
are picked per deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

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


def test_resources_are_picked_per_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    from factory.definitions import build_resources
    from factory.resources.deployer import CPUDeployerResource, VLLMDeployerResource
    from factory.resources.inference import CPUInferenceResource, VLLMInferenceResource
    from factory.resources.judge import EmbeddedJudgeResource, LLMJudgeResource

    for var in ("FACTORY_DEPLOYMENT", "FACTORY_JUDGE", "FACTORY_PROVIDERS"):
        monkeypatch.delenv(var, raising=False)
    embedded = build_resources()
    assert set(embedded) == {"lake", "judge", "inference", "provider", "deployer"}
    assert isinstance(embedded["judge"], EmbeddedJudgeResource)
    assert isinstance(embedded["inference"], CPUInferenceResource)
    assert isinstance(embedded["deployer"], CPUDeployerResource)
    assert [p.name for p in embedded["provider"].ladder()] == ["local"]

    monkeypatch.setenv("FACTORY_DEPLOYMENT", "gpu")
    monkeypatch.setenv("FACTORY_JUDGE", json.dumps({"base_url": "http://judge/v1", "model": "j"}))
    gpu = build_resources()
    assert isinstance(gpu["inference"], VLLMInferenceResource)
    assert isinstance(gpu["deployer"], VLLMDeployerResource)
    assert (gpu["judge"].base_url, gpu["judge"].model) == ("http://judge/v1", "j")
    assert isinstance(gpu["judge"], LLMJudgeResource)
    with pytest.raises(ValueError, match="FACTORY_DEPLOYMENT"):
        build_resources("tpu")
    monkeypatch.setenv("FACTORY_JUDGE", "{oops")
    with pytest.raises(ValueError, match="FACTORY_JUDGE: not JSON"):
        build_resources()
