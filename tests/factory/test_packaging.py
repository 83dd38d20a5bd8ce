"""What ``pip install .`` puts into site-packages: one top-level name, ``factory``, with the
folders assets/ resources/ sensors/ trainer/ kernels/ as its subpackages (through the links
factory/assets -> ../assets and so on), so nothing of ours can collide with another
distribution's top-level package (Hugging Face's ``kernels``, say)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
LINKED = ("assets", "resources", "sensors", "trainer", "kernels")
"""The layout's top-level folders, each linked into factory/ as a subpackage."""


def _packages_in(folder: Path, name: str) -> set[str]:
    return {".".join((name, *init.parent.relative_to(folder).parts))
            for init in folder.rglob("__init__.py")}


def test_each_folder_is_linked_into_factory_and_nothing_else_is() -> None:
    links = {p.name: p for p in (ROOT / "factory").iterdir() if p.is_symlink()}
    assert sorted(links) == sorted(LINKED)
    for name, link in links.items():
        assert link.readlink() == Path("..") / name  # relative: the clone can live anywhere
        assert link.resolve() == ROOT / name


def test_the_package_list_names_every_package_of_the_tree() -> None:
    found = _packages_in(ROOT / "factory", "factory")  # rglob does not follow the links
    for name in LINKED:
        found |= _packages_in(ROOT / name, f"factory.{name}")
    assert set(SETUPTOOLS["packages"]) == found


def test_the_wheel_has_one_top_level_name_and_the_package_data(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    [wheel] = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"factory"}
    for path in ("factory/assets/evals.py", "factory/resources/lake.py",
                 "factory/sensors/chains.py", "factory/trainer/__main__.py",
                 "factory/kernels/patcher.py", "factory/app/templates/compare_base.html"):
        assert path in names
    recipes = {p.name for p in (ROOT / "factory" / "recipes").glob("*.yaml")}
    assert recipes and {n.removeprefix("factory/recipes/") for n in names
                        if n.startswith("factory/recipes/") and n.endswith(".yaml")} == recipes
    [top_level] = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["factory"]


_SCAN = """
import ast, json, sys
out = []
for path in sys.stdin.read().split():
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            out += [(path, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((path, node.lineno, node.module))
print(json.dumps(out))
"""


def _top_level_imports(files: list[str]) -> list[tuple[str, int, str]]:
    """``(file, line, module)`` of every absolute import of a linked folder's name in
    ``files`` (paths relative to the checkout). Parsed in a fresh interpreter: in a long pytest
    process, CPython 3.11.7's ``ast.parse`` has failed with "AST constructor recursion depth
    mismatch" (seen in a two-worker run)."""
    import json

    found = json.loads(subprocess.run([sys.executable, "-c", _SCAN], cwd=ROOT, check=True,
                                      input="\n".join(files), capture_output=True, text=True,
                                      timeout=120).stdout)
    return [(f, line, name) for f, line, name in found if name.split(".")[0] in LINKED]


def test_nothing_imports_a_folder_by_its_top_level_name() -> None:
    # pytest puts the repository root on sys.path, so ``import assets`` would still work in the
    # suite while failing in an installed factory: only this check catches it.
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    # The one exception: in the trainer image trainer/ and kernels/ are copied side by side.
    image_layout = {("trainer/model.py", "kernels.patcher")}
    stray = [f"{f}:{line}: import {name}" for f, line, name in _top_level_imports(files)
             if (f, name) not in image_layout]
    assert not stray, "use the installed names (factory.assets, factory.trainer, ...):\n" + \
        "\n".join(stray)
