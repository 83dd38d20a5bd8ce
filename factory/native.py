"""Compiled normalizers: the modules of ``factory.normalize`` built as C extensions with mypyc.

Normalizing is plain Python and most of a file ingest's CPU. ``make native`` (which ``make
test`` and ``make demo`` run) compiles these modules with mypyc (``python -m factory.native
build``): each gets a C extension next to its source, which Python imports instead of the
``.py``. Nothing else changes; the compiled modules give the same rows byte for byte
(``tests/ingest/test_native.py`` compares them with the source's on every format). The build
also compiles the modules written in C (``C_MODULES``): a fast path in front of the Python one,
taken only where it gives the same rows (``tests/ingest/test_fastpath.py``).

A build is used only while it matches the sources it was built from. The build writes a stamp
with the sha256 of each source; at import (``factory.normalize`` calls ``install_guard``) an
edited source, a missing stamp or ``FACTORY_NATIVE=0`` makes every compiled module load from its
``.py`` instead, with one warning on the ``factory.normalize`` logger when it is stale. It is
all or none: compiled modules call each other directly, so one left compiled would still run
the old code of the others. ``make native`` rebuilds after an edit.

The rules live in the Python normalizers only; the C module mirrors the common ones for speed,
and is used only while the Python rules are those it was verified against (``fastpath``):
``verify`` runs ``tests/ingest/test_fastpath.py`` (every C result held to the Python path's) and
records the sha256 of the rule sources it passed with. A rule changed in Python alone turns the
C module off (the ingest runs the Python rules, correct and slower) until the C agrees again;
``make native`` verifies whenever the record is out of date.

This module is never compiled and imports nothing of the factory.

    python -m factory.native build    # compile (needs mypy and a C compiler)
    python -m factory.native status   # compiled, stale, disabled or not built; the fast path
    python -m factory.native verify   # hold the C module to the Python rules, record the pass
    python -m factory.native clean    # remove the extensions and the stamp
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = "factory.normalize"
MODULES = ("canon", "images", "detect", "openai", "anthropic", "gemini", "sharegpt", "otlp")
"""The compiled modules, in dependency order."""
C_MODULES = ("_fastpath",)
"""Modules written in C (``<name>.c``), built with the others. ``_fastpath`` reads the common
records of a file ingest (logged OpenAI, Anthropic and Gemini calls, OpenAI fine-tuning lines)
without Python objects, in front of the Python path (``factory.ingest.rows.fast_outcome``). The code that
uses one runs without it where it cannot be imported: not built, or the build is stale."""
GROUP = "_native"
"""The shared library that holds their code (``_native__mypyc``), in the package."""
HERE = Path(__file__).resolve().parent / "normalize"
"""Where the modules and their extensions are."""
STAMP = HERE / "_native.json"
DISABLE_ENV = "FACTORY_NATIVE"
RULE_SOURCES = ("canon", "detect", "openai", "anthropic", "gemini", "_fastpath")
"""The sources the C module's rules must agree with: the normalizers it mirrors, and itself."""
VERIFIED = HERE / "_fastpath_verified.json"
"""The sha256 of each of ``RULE_SOURCES`` the last passing ``verify`` ran with (committed)."""
FASTPATH_ENV = "FACTORY_FASTPATH"
"""``off``: no C module; ``streams``: only its parse and stream merge, every rule in Python
(what a design without the mirrored rules costs, for ``bench/ingest.py``); ``verify``: its
rules whatever the record says (what ``verify`` runs the tests with)."""

log = logging.getLogger(PACKAGE)


DEPENDENCIES = ("blobs",)
"""Modules of ``factory`` (not compiled) whose names the compiled ones import: mypyc builds
their declared types (and constants) into the compiled code, so editing one makes a build
stale too."""


def _source(name: str, directory: Path = HERE) -> Path:
    """The source file of a compiled module or of a dependency."""
    if name in DEPENDENCIES:
        return directory.parent / f"{name}.py"
    return directory / (f"{name}.c" if name in C_MODULES else f"{name}.py")


def source_digests(directory: Path = HERE) -> dict[str, str]:
    """sha256 of each compiled module's source and of each dependency, by module name."""
    files = {m: _source(m, directory) for m in (*MODULES, *C_MODULES, *DEPENDENCIES)}
    out = {}
    for name, path in files.items():
        try:
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        except FileNotFoundError:
            out[name] = "missing"
    return out


_EXTENSIONS = (*MODULES, f"{GROUP}__mypyc", *C_MODULES)
"""The names a build gives extension files: one per module, and the shared library."""


def _extension_files(directory: Path) -> dict[str, list[Path]]:
    """The extension files present for this Python, by name."""
    return {name: [p for suffix in importlib.machinery.EXTENSION_SUFFIXES
                   if (p := directory / f"{name}{suffix}").exists()]
            for name in _EXTENSIONS}


def extensions(directory: Path = HERE) -> list[Path]:
    """The compiled extension files present (for this Python), shared library included."""
    return [p for paths in _extension_files(directory).values() for p in paths]


def stale_sources(stamp: dict[str, object], digests: dict[str, str]) -> list[str]:
    """The modules (and dependencies) whose source differs from the one the stamp says was
    compiled."""
    built = stamp.get("sources")
    built = built if isinstance(built, dict) else {}
    return [m for m in (*MODULES, *C_MODULES, *DEPENDENCIES)
            if built.get(m) != digests.get(m)]


def status(directory: Path = HERE) -> str:
    """``compiled``, ``disabled``, ``not built`` or ``stale (...)``: what imports will load."""
    if os.environ.get(DISABLE_ENV) == "0":
        return f"disabled ({DISABLE_ENV}=0)"
    missing = [n for n, paths in _extension_files(directory).items() if not paths]
    if len(missing) == len(_EXTENSIONS):
        return "not built"
    if missing:
        return "stale (partly built: no " + ", ".join(missing) + ")"
    try:
        stamp = json.loads((directory / STAMP.name).read_text())
    except (OSError, ValueError):
        return "stale (no build stamp)"
    stale = stale_sources(stamp if isinstance(stamp, dict) else {}, source_digests(directory))
    if stale:
        return "stale (" + ", ".join(_source(m, directory).name for m in stale) \
            + " changed since the build)"
    return "compiled"


def fastpath(directory: Path = HERE) -> str:
    """What the C module does in an ingest (given a current build): ``rules`` (it reads the
    common records and merges streams), ``streams`` (only the merge: ``FACTORY_FASTPATH``) or
    ``off (why)``: a rule source changed since the last passing ``verify``, or none passed."""
    wanted = os.environ.get(FASTPATH_ENV, "")
    if wanted in ("off", "streams"):
        return wanted if wanted == "streams" else f"off ({FASTPATH_ENV}=off)"
    return "rules" if wanted == "verify" else verified_state(directory)


def verified_state(directory: Path = HERE) -> str:
    """``rules`` where the rule sources are those of the last passing ``verify``, else
    ``off (why)``."""
    try:
        record = json.loads((directory / VERIFIED.name).read_text())
    except (OSError, ValueError):
        return "off (never verified: `python -m factory.native verify`)"
    verified = record.get("sources") if isinstance(record, dict) else None
    verified = verified if isinstance(verified, dict) else {}
    digests = source_digests(directory)
    changed = [m for m in RULE_SOURCES if verified.get(m) != digests.get(m)]
    if changed:
        return "off (" + ", ".join(_source(m, directory).name for m in changed) + \
            " changed since the C module was verified: `python -m factory.native verify`)"
    return "rules"


def verify(root: Path | None = None) -> bool:
    """Run ``tests/ingest/test_fastpath.py`` against the current build with the C rules on,
    and record the rule sources it passed with (``VERIFIED``); False (nothing recorded) where
    the build is not current or a test fails."""
    import subprocess

    root = root or HERE.parent.parent
    directory = root / PACKAGE.replace(".", "/")
    tests = root / "tests" / "ingest" / "test_fastpath.py"
    if not tests.exists():
        print(f"verify needs a checkout: no {tests}", file=sys.stderr)
        return False
    digests = source_digests(directory)  # what is verified (read before, not after)
    if status(directory) != "compiled":
        print(f"verify needs a current build ({status(directory)}): `make native`",
              file=sys.stderr)
        return False
    print("holding the C fast path to the Python rules (tests/ingest/test_fastpath.py):")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tests)], cwd=root, env={**os.environ, FASTPATH_ENV: "verify"})
    if done.returncode != 0:
        print("the C module disagrees with the Python rules: the ingest runs them in Python "
              "until _fastpath.c agrees (the failures above say where)", file=sys.stderr)
        return False
    (directory / VERIFIED.name).write_text(json.dumps(
        {"sources": {m: digests[m] for m in RULE_SOURCES}}, indent=1, sort_keys=True) + "\n")
    return True


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Loads the compiled modules from their ``.py`` files, and none written in C."""

    def __init__(self, directory: Path) -> None:
        self.paths = {f"{PACKAGE}.{m}": directory / f"{m}.py" for m in MODULES}
        self.c_modules = {f"{PACKAGE}.{m}" for m in C_MODULES}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.c_modules:
            raise ModuleNotFoundError(f"{fullname}: the compiled build is not used "
                                      f"({_GUARD[0] if _GUARD else status()})", name=fullname)
        source = self.paths.get(fullname)
        return importlib.util.spec_from_file_location(fullname, source) if source else None


_GUARD: list[str] = []


def install_guard() -> str:
    """Make the imports of the compiled modules load their sources unless the build is
    current (see the module docstring); returns ``status()``. Idempotent."""
    if _GUARD:
        return _GUARD[0]
    state = status()
    _GUARD.append(state)
    if state != "compiled":  # (with nothing built too: a build may land while this runs)
        if any(f"{PACKAGE}.{m}" in sys.modules for m in MODULES):
            raise ImportError(f"{PACKAGE}: install_guard must run before its modules load")
        sys.meta_path.insert(0, _SourceFinder(HERE))
        if state.startswith("stale"):
            log.warning("compiled normalizers not used, %s: the Python source runs (slower); "
                        "`make native` rebuilds them", state)
    return state


def build(root: Path | None = None) -> None:
    """Compile the modules with mypyc into the package (needs mypy and a C compiler)."""
    import tempfile

    from mypyc.build import mypycify
    from setuptools import Distribution, Extension

    root = root or HERE.parent.parent
    directory = root / PACKAGE.replace(".", "/")
    clean(directory)
    digests = source_digests(directory)  # what is compiled (read before, not after)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="factory-native-") as tmp:
        os.chdir(root)  # mypy reads the project's configuration, and paths are relative
        try:
            ext = mypycify([f"{PACKAGE.replace('.', '/')}/{m}.py" for m in MODULES],
                           group_name=f"{PACKAGE}.{GROUP}", target_dir=f"{tmp}/c")
            ext += [Extension(f"{PACKAGE}.{m}", [f"{PACKAGE.replace('.', '/')}/{m}.c"])
                    for m in C_MODULES]
            dist = Distribution({"name": "factory-native", "ext_modules": ext})
            dist.script_args = ["-q", "build_ext", "--inplace", "--build-temp", f"{tmp}/o",
                                "--build-lib", f"{tmp}/lib"]
            dist.parse_command_line()
            dist.run_commands()
        finally:
            os.chdir(cwd)
    import mypy.version

    (directory / STAMP.name).write_text(json.dumps(
        {"sources": digests, "mypy": mypy.version.__version__,
         "python": sys.version.split()[0]}, indent=1, sort_keys=True) + "\n")


def clean(directory: Path = HERE) -> None:
    """Remove the stamp, then the compiled extensions (a process that looks meanwhile finds
    the build stale, never half of one current)."""
    (directory / STAMP.name).unlink(missing_ok=True)
    for path in extensions(directory):
        path.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m factory.native",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "status", "verify", "clean"])
    parser.add_argument("--if-needed", action="store_true",
                        help="verify: only where the record is out of date")
    args = parser.parse_args(argv)
    if args.command == "build":
        build()
    elif args.command == "clean":
        clean()
    elif args.command == "verify" and not (args.if_needed and verified_state() == "rules"):
        verify()
    print(status())
    if args.command in ("status", "verify"):
        print(f"fast path: {fastpath()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
