"""Compiled normalizers (``factory.native``): the same rows as the source, and never stale.

``make test`` compiles the normalizers first (``make native``), so the whole suite runs against
the compiled modules; these tests check the compiled build against the Python source it came
from, and that an edited source is never shadowed by an old build.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

import factory
from factory import native
from tests.ingest import conversations as conv
from tests.ingest.test_fuzz import _mutate, _paths

ROOT = Path(__file__).resolve().parents[2]
COMPILED = native.status() == "compiled"
needs_build = pytest.mark.skipif(not COMPILED, reason=f"normalizers {native.status()}: "
                                 "`make native` compiles them")
needs_fast_path = pytest.mark.skipif(
    not COMPILED or native.fastpath() != "rules",
    reason=f"the C fast path is {native.fastpath()}: the ingest runs the Python rules")

# Runs process_lines over a file's lines and prints every result as JSON (the rows' datetimes
# as text): in this process the compiled modules, in a FACTORY_NATIVE=0 one the source.
# With "known", a third of the ids are given as known to the lake first (the re-ingest path:
# parse, hash, then normalize only the rest), and images go to a blob store.
_DUMP = """
import json, sys
import numpy as np
from factory.blobs import BlobStore
from factory.ingest.dedupe import digests
from factory.ingest.rows import process_lines
import factory.normalize.canon as canon
lines = open(sys.argv[1], "rb").read().split(b"\\n")
out = process_lines(lines, name="corpus", first_lineno=1, format_hint=sys.argv[2])
if sys.argv[3] == "known":
    known = [np.sort(digests([r[1] for r in out[::3]]))]
    out = process_lines(lines, name="corpus", first_lineno=1, format_hint=sys.argv[2],
                        known=known, blobs=BlobStore())
print(canon.__file__)
for r in out:
    print(json.dumps(r, default=str, ensure_ascii=False))
"""


def _corpus(path: Path) -> int:
    """Every form of the shared conversation, each mutated at every path in several ways
    (the error branches and their reasons), and the benchmark's realistic records."""
    lines = []
    for make in conv.ALL_FORMS.values():
        record = make()
        lines.append(json.dumps(record, ensure_ascii=False))
        for where in _paths(record)[1:]:
            for action, new in (("delete", None), ("replace", None), ("replace", 7),
                                ("replace", "x"), ("replace", []), ("replace", {}),
                                ("stringify", None), ("truncate", None)):
                try:
                    mutated = _mutate(record, where, action, new)
                except (KeyError, IndexError, TypeError):
                    continue
                lines.append(json.dumps(mutated, ensure_ascii=False))
    spec = importlib.util.spec_from_file_location("bench_ingest", ROOT / "bench" / "ingest.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    realistic = path.with_suffix(".bench.jsonl")
    bench.generate(realistic, 1500, seed=7)
    text = "\n".join(lines) + "\n" + realistic.read_text(encoding="utf-8")
    path.write_text(text, encoding="utf-8")
    return text.count("\n")


def _dump(path: Path, fmt: str, path_kind: str, *, source: bool) -> tuple[str, list[Any]]:
    env = {**os.environ, native.DISABLE_ENV: "0" if source else "1",
           "FACTORY_HOME": str(path.parent / ("home-source" if source else "home-compiled"))}
    out = subprocess.run([sys.executable, "-c", _DUMP, str(path), fmt, path_kind], env=env,
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    return out[0], [json.loads(line) for line in out[1:]]


@needs_build
@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "path_kind"), [
    ("auto", "new"), ("auto", "known"), ("openai", "new"), ("anthropic", "new"),
    ("gemini", "new"), ("otlp", "new")])
def test_compiled_normalizers_give_the_source_s_rows_byte_for_byte(tmp_path: Path, fmt: str,
                                                                   path_kind: str) -> None:
    corpus = tmp_path / "corpus.jsonl"
    num_lines = _corpus(corpus)
    compiled_file, compiled = _dump(corpus, fmt, path_kind, source=False)
    source_file, source = _dump(corpus, fmt, path_kind, source=True)
    assert compiled_file.endswith(".so") and source_file.endswith(".py")
    assert len(compiled) == len(source) > num_lines * 0.9
    if path_kind == "known":  # a third held back as known, not normalized
        assert sum(1 for r in source if r[5] is None and r[4] is None) > num_lines * 0.25
        stored = sorted(p.name for p in (tmp_path / "home-source").rglob("*") if p.is_file())
        assert stored and stored == sorted(
            p.name for p in (tmp_path / "home-compiled").rglob("*") if p.is_file())
    num_samples = sum(1 for r in source if r[5])
    num_rejected = sum(1 for r in source if r[4])
    assert num_samples > 100 and num_rejected > 100  # both branches are exercised
    # and every rejection names the field: none is a normalizer's own crash
    assert [r[4] for r in source if r[4] and "normalizer failed" in r[4]] == []
    for mine, theirs in zip(compiled, source, strict=True):
        assert mine == theirs


def _copy_package(tmp_path: Path) -> Path:
    """The factory package with its compiled normalizers, as another checkout would have it."""
    dest = tmp_path / "checkout"
    shutil.copytree(Path(factory.__file__).parent, dest / "factory",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _python_in(checkout: Path, *args: str, check: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` run in ``checkout``, importing its factory package (``env`` added to
    this process's environment)."""
    return subprocess.run([sys.executable, *args], cwd=checkout, capture_output=True, text=True,
                          check=check,
                          env={**os.environ, "PYTHONPATH": str(checkout), **(env or {})})


def _probe(checkout: Path, **env: str) -> tuple[str, str, str]:
    code = ("import factory.normalize.canon as c, factory.native as n; "
            "print(c.__file__); print(n.status())")
    done = _python_in(checkout, "-c", code, env=env)
    loaded, state = done.stdout.splitlines()
    return loaded, state, done.stderr


@needs_build
def test_a_current_build_is_loaded(tmp_path: Path) -> None:
    checkout = _copy_package(tmp_path)
    loaded, state, _ = _probe(checkout)
    assert loaded.startswith(str(checkout)) and loaded.endswith(".so")
    assert state == "compiled"


@needs_build
def test_an_edited_source_is_never_shadowed_by_an_old_build(tmp_path: Path) -> None:
    checkout = _copy_package(tmp_path)
    openai = checkout / "factory" / "normalize" / "openai.py"
    openai.write_text(openai.read_text() + "\n# edited after the build\n")
    loaded, state, stderr = _probe(checkout)
    # all or none: canon.py did not change, but runs from source too
    assert loaded == str(checkout / "factory" / "normalize" / "canon.py")
    assert state == "stale (openai.py changed since the build)"
    assert "make native" in stderr


@needs_build
def test_the_c_module_is_used_only_with_a_current_build(tmp_path: Path) -> None:
    checkout = _copy_package(tmp_path)
    code = "import factory.ingest.rows as r; print(r._FAST is not None)"

    def c_module_used() -> bool:  # (its rules whether or not they are verified: see below)
        done = _python_in(checkout, "-c", code, env={native.FASTPATH_ENV: "verify"})
        return done.stdout.strip() == "True"

    assert c_module_used()
    source = checkout / "factory" / "normalize" / "_fastpath.c"
    source.write_text(source.read_text() + "\n/* edited after the build */\n")
    assert native.status(source.parent) == "stale (_fastpath.c changed since the build)"
    assert not c_module_used()


def _compile_c(checkout: Path) -> None:
    """Rebuild the C module of a checkout alone, and stamp it as ``make native`` would."""
    directory = checkout / "factory" / "normalize"
    target = directory / f"_fastpath{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1",
                    f"-I{sysconfig.get_paths()['include']}", str(directory / "_fastpath.c"),
                    "-o", str(target)], check=True)
    stamp = json.loads((directory / "_native.json").read_text())
    stamp["sources"]["_fastpath"] = native.source_digests(directory)["_fastpath"]
    (directory / "_native.json").write_text(json.dumps(stamp))


def _fast_path_in(checkout: Path) -> tuple[str, bool]:
    """(factory.native.fastpath(), whether process_lines applies the C rules) in a checkout."""
    code = ("import factory.ingest.rows as r, factory.native as n; print(n.fastpath()); "
            "print(r._FAST is not None and r._FAST_RULES)")
    mode, used = _python_in(checkout, "-c", code).stdout.splitlines()
    return mode, used == "True"


@needs_fast_path
@pytest.mark.slow
def test_c_rules_that_disagree_with_the_python_ones_are_never_used(tmp_path: Path) -> None:
    checkout = _copy_package(tmp_path)
    shutil.copytree(ROOT / "tests", checkout / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "ingest.py", checkout / "bench" / "ingest.py")
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    directory = checkout / "factory" / "normalize"
    record = (directory / native.VERIFIED.name).read_text()
    assert _fast_path_in(checkout) == ("rules", True)

    # The C mirror's rule changed alone: a developer message read as a user one.
    source = directory / "_fastpath.c"
    text = source.read_text()
    rule = 'if (str_is(s, r, "system") || str_is(s, r, "developer")) canon = "system";'
    assert rule in text
    source.write_text(text.replace(rule, 'if (str_is(s, r, "system")) canon = "system";\n'
                                         '    else if (str_is(s, r, "developer")) canon = "user";'))
    _compile_c(checkout)
    assert native.status(directory) == "compiled"  # a current build, not yet verified
    mode, used = _fast_path_in(checkout)
    assert mode.startswith("off (_fastpath.c changed since the C module was verified") and not used
    done = _python_in(checkout, "-m", "factory.native", "verify", check=False)
    assert "disagrees with the Python rules" in done.stderr
    assert "test_calls_normalized_in_c_give_the_python_path_s_rows" in done.stdout
    assert (directory / native.VERIFIED.name).read_text() == record  # nothing recorded
    assert _fast_path_in(checkout)[1] is False

    # A change that keeps the rules: verified, recorded and used.
    source.write_text(text + "\n/* edited */\n")
    _compile_c(checkout)
    assert _fast_path_in(checkout)[1] is False
    done = _python_in(checkout, "-m", "factory.native", "verify", check=False)
    assert done.returncode == 0, done.stderr
    assert "fast path: rules" in done.stdout
    recorded = json.loads((directory / native.VERIFIED.name).read_text())["sources"]
    assert recorded["_fastpath"] == native.source_digests(directory)["_fastpath"]
    assert _fast_path_in(checkout) == ("rules", True)


@needs_fast_path
def test_a_python_rule_changed_since_the_verified_one_turns_the_c_rules_off(
        tmp_path: Path) -> None:
    checkout = _copy_package(tmp_path)
    directory = checkout / "factory" / "normalize"
    openai = directory / "openai.py"
    openai.write_text(openai.read_text() + "\n# a rule changed here\n")
    # as after ``make native``: the build is current, the verification is not
    stamp = json.loads((directory / "_native.json").read_text())
    stamp["sources"]["openai"] = native.source_digests(directory)["openai"]
    (directory / "_native.json").write_text(json.dumps(stamp))
    assert native.status(directory) == "compiled"
    mode, used = _fast_path_in(checkout)
    assert mode == ("off (openai.py changed since the C module was verified: "
                    "`python -m factory.native verify`)") and not used
    # FACTORY_FASTPATH=streams keeps only what needs no rule: the parse and the stream merge
    code = ("import factory.ingest.rows as r; print(r._FAST.__name__, r._FAST_RULES)")
    done = _python_in(checkout, "-c", code, env={native.FASTPATH_ENV: "streams"})
    assert done.stdout.split() == ["merge_stream", "False"]


@needs_build
def test_a_partial_build_loads_no_compiled_module(tmp_path: Path) -> None:
    checkout = _copy_package(tmp_path)
    for path in native.extensions(checkout / "factory" / "normalize"):
        if path.name.startswith("openai."):
            path.unlink()
    loaded, state, _ = _probe(checkout)
    assert loaded.endswith("canon.py")
    assert state == "stale (partly built: no openai)"


@needs_build
def test_editing_a_module_the_compiled_ones_import_makes_the_build_stale(
        tmp_path: Path) -> None:
    checkout = _copy_package(tmp_path)
    blobs = checkout / "factory" / "blobs.py"
    blobs.write_text(blobs.read_text() + "\n# edited after the build\n")
    loaded, state, _ = _probe(checkout)
    assert loaded.endswith("canon.py")
    assert state == "stale (blobs.py changed since the build)"


@needs_build
def test_factory_native_0_runs_the_source(tmp_path: Path) -> None:
    checkout = _copy_package(tmp_path)
    loaded, state, stderr = _probe(checkout, FACTORY_NATIVE="0")
    assert loaded.endswith("canon.py")
    assert state == "disabled (FACTORY_NATIVE=0)"
    assert "make native" not in stderr


def test_status_of_a_checkout_that_never_built(tmp_path: Path) -> None:
    for m in native.MODULES:
        (tmp_path / f"{m}.py").write_text("")
    assert native.status(tmp_path) == "not built"
    assert native.stale_sources({"sources": native.source_digests(tmp_path)},
                                native.source_digests(tmp_path)) == []
    assert native.stale_sources({}, native.source_digests(tmp_path)) == [
        *native.MODULES, *native.C_MODULES, *native.DEPENDENCIES]
