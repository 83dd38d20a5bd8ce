"""docs/architecture.md lists every package of the tree, each with its role and what it may import.

The doc's "Packages" section holds a table whose first column is a package's folder in backticks
(`factory/curation`, `assets`); the tree's packages are the folders with an ``__init__.py`` under
the six top-level packages. Read from the files alone: nothing of the factory is imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TOP_LEVEL = ("factory", "assets", "resources", "sensors", "trainer", "kernels")
SECTION = "## Packages"
ROW = re.compile(r"^\|\s*`(?P<package>[^`]+)`\s*\|(?P<rest>.*)\|\s*$")


def tree_packages(root: Path = ROOT) -> set[str]:
    """Folders with an ``__init__.py`` under the top-level packages, as paths from ``root``.

    The links in factory/ (``factory/assets -> ../assets``...) are not followed: each package
    counts once, under its own folder.
    """
    packages = set()
    for top in TOP_LEVEL:
        for folder, subfolders, files in os.walk(root / top):
            subfolders[:] = [d for d in subfolders if d not in ("tests", "__pycache__")]
            if "__init__.py" in files:
                packages.add(Path(folder).relative_to(root).as_posix())
    return packages


def doc_rows(text: str) -> list[tuple[str, list[str]]]:
    """The package table of the doc's Packages section: (package, the other cells) per row."""
    lines = text.splitlines()
    if SECTION not in lines:
        raise ValueError(f"{DOC.name} has no '{SECTION}' section: add it, with a table whose first "
                         "column is each package's folder in backticks")
    start = lines.index(SECTION) + 1
    rows = []
    for line in lines[start:]:
        if line.startswith("## "):
            break
        match = ROW.match(line)
        if match:
            cells = [cell.strip() for cell in match["rest"].split("|")]
            rows.append((match["package"].strip().rstrip("/"), cells))
    return rows


@pytest.fixture(scope="module")
def rows() -> list[tuple[str, list[str]]]:
    return doc_rows(DOC.read_text())


def test_the_doc_lists_every_package_of_the_tree(rows: list[tuple[str, list[str]]]) -> None:
    listed = [package for package, _ in rows]
    repeated = sorted({p for p in listed if listed.count(p) > 1})
    assert not repeated, f"{DOC.name} lists these packages more than once: {repeated}"
    tree = tree_packages()
    missing, extra = sorted(tree - set(listed)), sorted(set(listed) - tree)
    assert not missing and not extra, (
        f"{DOC.name}'s package table differs from the tree. In the tree, not in the doc "
        f"(add a row): {missing}; in the doc, not in the tree (remove the row): {extra}")


def test_every_listed_package_has_a_role_and_its_allowed_imports(
        rows: list[tuple[str, list[str]]]) -> None:
    incomplete = [package for package, cells in rows
                  if len(cells) < 2 or not all(cells[:2])]
    assert not incomplete, (f"{DOC.name}: these rows lack a role or a 'may import' cell: "
                            f"{incomplete}")


def test_the_tree_walk_finds_packages_and_skips_tests_and_caches(tmp_path: Path) -> None:
    for folder in ("factory/curation", "factory/app/commands", "factory/tests",
                   "factory/__pycache__", "trainer"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "factory" / "__init__.py").write_text("")
    (tmp_path / "factory" / "data").mkdir()
    (tmp_path / "factory" / "trainer").symlink_to(tmp_path / "trainer")
    assert tree_packages(tmp_path) == {"factory", "factory/curation", "factory/app/commands",
                                       "trainer"}
    # factory/app has no __init__.py here: a folder without one is no package.


def test_a_doc_without_the_section_names_the_fix() -> None:
    with pytest.raises(ValueError, match="has no '## Packages' section"):
        doc_rows("# Architecture\n\n| `factory` | role | anything |\n")
    table = "\n".join([SECTION, "", "| package | role | may import |", "|---|---|---|",
                       "| `factory/curation` | Curation. | the library |",
                       "| `factory/evals` |  | the library |", "", "## Next",
                       "| `assets` | not in the section | - |"])
    assert doc_rows(table) == [("factory/curation", ["Curation.", "the library"]),
                               ("factory/evals", ["", "the library"])]
