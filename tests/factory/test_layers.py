"""The layers contract in pyproject.toml orders every module of the factory exactly once.

import-linter checks a layers contract only for the modules it names: a package left out could
import any layer and be imported by any, and a cycle through it would go unseen.
"""

from __future__ import annotations

import pkgutil
import re
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())


def layers() -> list[list[str]]:
    """The layers contract's layers, top first, each as its modules."""
    [contract] = [c for c in CONFIG["tool"]["importlinter"]["contracts"]
                  if c["type"] == "layers"]
    assert contract.get("exhaustive") is None and not contract.get("ignore_imports")
    return [[m.strip() for m in re.split(r"[|:]", layer)] for layer in contract["layers"]]


def test_the_layers_name_every_module_of_the_factory_once() -> None:
    named = Counter(m for layer in layers() for m in layer)
    children = {f"factory.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "factory")])}
    assert not [m for m, n in named.items() if n > 1], "a module in two layers"
    missing, extra = sorted(children - set(named)), sorted(set(named) - children)
    assert not missing, (f"put these modules of factory in a layer of pyproject.toml's layers "
                         f"contract, below all that import them: {missing}")
    assert not extra, f"the layers contract names modules that do not exist: {extra}"


def test_the_app_is_on_top_and_the_standalone_packages_at_the_bottom() -> None:
    order = layers()
    assert order[0] == ["factory.app"] and order[1] == ["factory.definitions"]
    assert order[-2:] == [["factory.trainer"], ["factory.kernels"]]
