"""The contracts in pyproject.toml name every module of the factory: a new module cannot slip
out of them (import-linter checks only the modules a contract lists)."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
ABOVE_THE_LIBRARY = {"factory.app", "factory.definitions", "factory.assets", "factory.resources",
                     "factory.sensors"}
STANDALONE = {"factory.trainer", "factory.kernels"}


def _children() -> set[str]:
    """Every child module of ``factory``: those in factory/, the linked folders included."""
    return {f"factory.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "factory")])}


def _contract(prefix: str) -> dict[str, Any]:
    [contract] = [c for c in CONFIG["tool"]["importlinter"]["contracts"]
                  if c["name"].startswith(prefix)]
    assert not contract.get("allow_indirect_imports", False)
    assert not contract.get("ignore_imports")
    return contract


def test_the_components_are_the_installed_subpackages() -> None:
    linked = {f"factory.{p.name}" for p in (ROOT / "factory").iterdir() if p.is_symlink()}
    assert linked == (ABOVE_THE_LIBRARY - {"factory.app", "factory.definitions"}) | STANDALONE
    assert CONFIG["tool"]["importlinter"]["root_packages"] == ["factory"]
    assert CONFIG["project"]["scripts"]["factory"] == "factory.app.cli:main"


def test_the_library_contract_lists_every_library_module() -> None:
    contract = _contract("the factory library imports neither")
    assert set(contract["source_modules"]) == _children() - ABOVE_THE_LIBRARY - STANDALONE
    assert set(contract["forbidden_modules"]) >= ABOVE_THE_LIBRARY


def test_trainer_and_kernels_are_forbidden_the_rest_of_the_factory() -> None:
    trainer = _contract("trainer never imports")
    assert trainer["source_modules"] == ["factory.trainer"]
    assert set(trainer["forbidden_modules"]) == (_children() - STANDALONE) | {"dagster",
                                                                            "pyiceberg"}
    kernels = _contract("kernels depend on nothing")
    assert kernels["source_modules"] == ["factory.kernels"]
    assert set(kernels["forbidden_modules"]) == (_children() - {"factory.kernels"}) | {
        "dagster", "pyiceberg"}


def test_assets_sensors_and_resources_keep_apart() -> None:
    assert set(_contract("assets and sensors")["modules"]) == {"factory.assets", "factory.sensors"}
    assert set(_contract("resources import only")["forbidden_modules"]) >= {"factory.assets",
                                                                            "factory.sensors"}
    assert _contract("the composition root")["forbidden_modules"] == ["factory.app"]
