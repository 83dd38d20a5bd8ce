"""Imports inside function bodies: few, and each says why.

An import of one of our modules inside a function hides a dependency until the function runs
(import-linter sees it, a reader of the module's head does not) and is how a package cycle
slips back in. The layers contract in pyproject.toml leaves no cycle that would need one, so
what remains are imports kept out of a process's start-up: each carries a reason, a ``#``
comment on the import's line or the line above, and there are at most ``LIMIT`` of them.

A third-party library imported inside a function needs a reason too, unless it is one of
``HEAVY``: one whose import takes 0.2 s or more (``SLOW``, measured), or one a base install may
lack (``OPTIONAL``). The standard library is free to import anywhere. Read from the files alone:
nothing is imported.
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("factory", "assets", "resources", "sensors", "trainer", "kernels")
PROJECT = frozenset(TOP_LEVEL) | {"trainer_kernels"}
"""Top-level names of our own modules: the installed package and the folders' own names (the
trainer's image runs ``trainer`` and ``trainer_kernels`` as top-level packages)."""

LIMIT = 30
"""The most imports of our own modules inside function bodies, across the tree."""

SLOW = {
    "torch": 2.8, "transformers": 1.5, "peft": 2.9, "sentence_transformers": 2.9,
    "safetensors": 2.8, "llguidance": 1.8, "mlflow": 4.3, "openai": 1.5, "dagster": 1.1,
    "kubernetes": 0.8, "triton": 0.5, "pyarrow": 0.4, "matplotlib": 0.4, "pyiceberg": 0.35,
    "httpx": 0.3, "opentelemetry": 0.3, "numpy": 0.27, "duckdb": 0.27, "pyspark": 0.25,
    "fsspec": 0.24, "uvicorn": 0.23, "jsonschema": 0.2,
}
"""Seconds to import (``python -c "import X"`` on the dev box, the submodule our code imports
where that is the slow part: ``pyarrow.parquet``, ``pyiceberg.io``, ``safetensors.torch``,
``llguidance.hf``, the OpenTelemetry SDK); a library here is worth keeping out of a start-up."""

OPTIONAL = frozenset({
    "vllm", "neptune_scale", "psycopg2", "urllib3", "datasets",
    "mypy", "mypyc", "setuptools",
})
"""Libraries a base install may lack: vLLM (its own environment), the extras (``neptune``;
``urllib3`` as the ``k8s`` extra's HTTP client), PostgreSQL's driver (with
``FACTORY_DATABASE_URL`` only), and the native build's tools (``make native``)."""

HEAVY = frozenset(name for name, seconds in SLOW.items() if seconds >= 0.2) | OPTIONAL
"""Third-party top-level modules that may be imported inside a function with no comment."""


@dataclass(frozen=True)
class LocalImport:
    """One import statement inside a function body."""

    path: str
    """File, relative to the repository root."""
    line: int
    """Line of the statement's first line."""
    module: str
    """The imported module as written (``.chat`` for a relative import)."""
    kind: str
    """``project``, ``third-party`` or ``stdlib``."""
    reason: str
    """Why it waits ("" when nothing says): see ``local_imports``."""
    function: str
    """The function it is in, as ``name:line``."""


def _comments(source: str) -> dict[int, str]:
    """Line -> the text of the ``#`` comment on it, lint pragmas (``noqa``, ``type: ignore``)
    left out."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            for pragma in ("noqa", "type: ignore", "pragma:"):
                if text.startswith(pragma):
                    text = ""
            if text:
                out[tok.start[0]] = text
    return out


def _kind(node: ast.Import | ast.ImportFrom) -> tuple[str, str]:
    if isinstance(node, ast.ImportFrom) and node.level:
        return "." * node.level + (node.module or ""), "project"
    name = node.names[0].name if isinstance(node, ast.Import) else node.module or ""
    top = name.split(".")[0]
    if top in PROJECT:
        return name, "project"
    return name, "stdlib" if top in sys.stdlib_module_names else "third-party"


def _guards_import_error(node: ast.Try | ast.TryStar) -> bool:
    names = {n.id for h in node.handlers if h.type is not None for n in ast.walk(h.type)
             if isinstance(n, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def local_imports(source: str, path: str) -> list[LocalImport]:
    """Every import statement of ``source`` that sits inside a function body.

    Its reason is a ``#`` comment on its own lines, or on a comment line right above it or
    above the run of import statements it is part of; an ``ImportError`` guard around it is a
    reason too ("guarded").
    """
    tree = ast.parse(source)
    comments = _comments(source)
    lines = source.splitlines()
    found: list[LocalImport] = []

    def reason_of(run_start: ast.stmt, stmt: ast.stmt) -> str:
        above = [first - 1 for first in (stmt.lineno, run_start.lineno)
                 if first > 1 and lines[first - 2].lstrip().startswith("#")]
        for n in [*range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1), *above]:
            if n in comments:
                return comments[n]
        return ""

    def visit(node: ast.AST, function: str, guarded: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            run_start: ast.stmt | None = None
            for stmt in stmts:
                if not isinstance(stmt, ast.Import | ast.ImportFrom):
                    run_start = None
                    visit_children(stmt, function, guarded)
                    continue
                run_start = run_start or stmt
                if function:
                    module, kind = _kind(stmt)
                    reason = reason_of(run_start, stmt) or ("guarded" if guarded else "")
                    found.append(LocalImport(path=path, line=stmt.lineno, module=module,
                                             kind=kind, reason=reason, function=function))

    def visit_children(stmt: ast.AST, function: str, guarded: bool) -> None:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            function, guarded = f"{stmt.name}:{stmt.lineno}", False
        elif isinstance(stmt, ast.Try | ast.TryStar) and function:
            inner = guarded or _guards_import_error(stmt)
            visit(ast.Module(body=stmt.body, type_ignores=[]), function, inner)
            for part in (*stmt.handlers, ast.Module(body=stmt.orelse + stmt.finalbody,
                                                    type_ignores=[])):
                visit(part, function, guarded)
            return
        visit(stmt, function, guarded)

    visit(tree, "", False)
    return found


def tree_local_imports(root: Path = ROOT) -> list[LocalImport]:
    """``local_imports`` of every module under the top-level packages (the links in factory/
    not followed, so each file counts once)."""
    found: list[LocalImport] = []
    for top in TOP_LEVEL:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if any(part in ("tests", "__pycache__") for part in rel.parts) or any(
                    (root / Path(*rel.parts[:i])).is_symlink() for i in range(2, len(rel.parts))):
                continue
            found += local_imports(path.read_text(), rel.as_posix())
    return found


@pytest.fixture(scope="module")
def found() -> list[LocalImport]:
    # The whole tree is read in a fresh interpreter: a long pytest worker has threads of
    # servers earlier tests started, and on CPython 3.11 a parse that overlaps another thread's
    # is refused spuriously ("AST constructor recursion depth mismatch": the converter counts
    # its depth per interpreter, not per thread).
    script = ("import dataclasses, json; from tests.factory.test_local_imports import "
              "tree_local_imports; print(json.dumps([dataclasses.asdict(i) "
              "for i in tree_local_imports()]))")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=300,
                         capture_output=True, text=True).stdout
    return [LocalImport(**row) for row in json.loads(out)]


def test_few_of_our_modules_are_imported_inside_functions(found: list[LocalImport]) -> None:
    ours = [f"{i.path}:{i.line} {i.module}" for i in found if i.kind == "project"]
    assert len(ours) <= LIMIT, (
        f"{len(ours)} imports of our own modules inside function bodies, at most {LIMIT}: move "
        "the import to the module's head, or break the cycle that forced it by moving the "
        "shared piece to a lower layer (pyproject.toml's layers contract):\n" + "\n".join(ours))


def silent(found: list[LocalImport]) -> list[LocalImport]:
    """The imports of ``found`` that need a reason and have none: every one of our modules; a
    third-party library unless it is ``HEAVY`` or its function imports a ``HEAVY`` one too (the
    function already waits for that: ``tqdm`` beside ``transformers``)."""
    heavy_functions = {(i.path, i.function) for i in found
                       if i.kind == "third-party" and i.module.split(".")[0] in HEAVY}
    return [i for i in found if not i.reason and (i.kind == "project" or (
        i.kind == "third-party" and i.module.split(".")[0] not in HEAVY
        and (i.path, i.function) not in heavy_functions))]


def test_every_import_inside_a_function_says_why(found: list[LocalImport]) -> None:
    unexplained = [f"{i.path}:{i.line} {i.module}" for i in silent(found)]
    assert not unexplained, (
        "imports inside function bodies without a reason: move each to the module's head, or "
        "say why it must wait in a `#` comment on its line or the line above:\n"
        + "\n".join(unexplained))


def test_the_walk_finds_function_imports_and_their_reasons() -> None:
    source = "\n".join([
        "import json",
        "from factory.lake import Lake",
        "class A:",
        "    import os",
        "    def method(self):",
        "        # the trainer's image has no lake",
        "        from factory.settings import get_settings",
        "        from . import sibling  # noqa: F401",
        "        x = 1",
        "        from factory import output",
        "def f():",
        "    import torch",
        "    import tqdm",
        "    import yaml  # parsed only by `factory lint`",
        "    from factory.control import (  # plane built per call",
        "        ControlPlane,",
        "    )",
        "    def g():",
        "        import sqlite3",
        "        try:",
        "            import rich",
        "        except ImportError:",
        "            import tqdm",
        "    return g",
    ])
    found = local_imports(source, "m.py")
    assert [(i.line, i.module, i.kind, i.reason, i.function) for i in found] == [
        (7, "factory.settings", "project", "the trainer's image has no lake", "method:5"),
        (8, ".", "project", "the trainer's image has no lake", "method:5"),
        (10, "factory", "project", "", "method:5"),
        (12, "torch", "third-party", "", "f:11"),
        (13, "tqdm", "third-party", "", "f:11"),
        (14, "yaml", "third-party", "parsed only by `factory lint`", "f:11"),
        (15, "factory.control", "project", "plane built per call", "f:11"),
        (19, "sqlite3", "stdlib", "", "g:18"),
        (21, "rich", "third-party", "guarded", "g:18"),
        (23, "tqdm", "third-party", "", "g:18"),
    ]
    # tqdm waits with torch in f, not in g; our own module always needs a reason
    assert [(i.line, i.module) for i in silent(found)] == [(10, "factory"), (23, "tqdm")]


def test_the_tree_walk_skips_tests_and_the_links(tmp_path: Path) -> None:
    body = "def f():\n    from factory import lake\n"
    for folder in ("factory", "factory/tests", "trainer"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "m.py").write_text(body)
    (tmp_path / "factory" / "trainer").symlink_to(tmp_path / "trainer")
    assert [i.path for i in tree_local_imports(tmp_path)] == ["factory/m.py", "trainer/m.py"]


def test_the_code_location_loads_without_torch() -> None:
    # Every Dagster run worker, code server and daemon loads factory.definitions: torch (about
    # 2.8 s of CPU) waits for the steps that train, serve or judge.
    script = ("import sys, factory.definitions; "
              "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=300,
                         capture_output=True, text=True).stdout
    assert json.loads(out.replace("'", '"')) == []
