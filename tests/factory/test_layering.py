"""The library contract in pyproject.toml names every module of the factory library: a new
module cannot slip out of it (import-linter checks only the modules a contract lists)."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import factory

ROOT = Path(__file__).resolve().parents[2]
ABOVE_THE_LIBRARY = {"factory.app", "factory.definitions"}


def test_the_library_contract_lists_every_library_module() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [contract] = [c for c in config["tool"]["importlinter"]["contracts"]
                  if c["name"].startswith("the factory library imports neither")]
    children = {f"factory.{m.name}" for m in pkgutil.iter_modules(factory.__path__)}
    assert set(contract["source_modules"]) == children - ABOVE_THE_LIBRARY
    assert set(contract["forbidden_modules"]) >= ABOVE_THE_LIBRARY | {"assets", "resources",
                                                                      "sensors"}
    assert not contract.get("allow_indirect_imports", False)
    assert config["project"]["scripts"]["factory"] == "factory.app.cli:main"
