"""Runs pin their code: a run uses the factory's code as its code location loaded it.

Processes of a run start late: the daemon's code server launches each run worker (``dagster api
execute_run``), a step starts the trainer or an inference server, a step imports a module on
first use. Each reads the working tree as it is then; edited while the code server or an
earlier step runs, it would import the new code beside what the old code had loaded. So the
factory refuses to start a step from a tree that is not the one the run started with.

The code's version is a fingerprint of the factory's Python sources: every ``*.py`` of the
installed ``factory`` package, the linked ``assets/``, ``resources/``, ``sensors/``, ``trainer/``
and ``kernels/`` included (not tests or docs). Hashing the files covers a checkout and an
installed wheel alike, edits that are not committed too. ``pin`` takes it where Dagster loads the
definitions (``factory/definitions.py``):

- in a code location (a code server, ``dagster dev``, ``dagster job launch``: Dagster's
  *initialization* load) it is the code location's loaded version. It goes into the code
  location's reconstruction metadata, which Dagster copies into the execution plan of every run
  created from that code location (the UI's Materialize and Launch, sensors' and schedules' run
  requests, ``factory run``'s submission, re-executions) and hands the run worker when it
  *reconstructs* the definitions. Its per-file manifest is kept in
  ``$FACTORY_HOME/code/<fingerprint>.json``, so a refusal can name the changed files.
- in a run worker it is the version the run started with, and the worker hashes what it
  imports itself.

``check_run`` (called by ``LakeResource``, which every asset uses first) fails a step when the
code the worker imported or the tree on disk differ from the run's. ``check`` does the same for
a caller about to start a process that imports the factory, in a code location's process too
(against the code location's version). A run created by a code location that pinned nothing
(an older run) and a plain ``import factory.definitions`` (tests, in-process materializations)
have no pin: nothing is refused there.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import factory
from factory.errors import FactoryError
from factory.settings import get_settings

PIN_KEY = "factory/code"
"""The key of the fingerprint in a code location's reconstruction metadata."""
MANIFEST_DIR = "code"
"""Under ``$FACTORY_HOME``: one ``<fingerprint>.json`` per loaded version, path -> sha256."""
KEEP_MANIFESTS = 50
"""Manifests kept under ``MANIFEST_DIR``: the versions loaded most recently (a run of an older
one that is still refused names no files)."""
MAX_NAMED = 5
"""How many changed files a refusal names before it counts the rest."""
FIX = ("start a new run: a run uses the code it started with (where a code server keeps "
       "running, `factory ui`'s or `factory daemon`'s, reload its code location first: the "
       "UI's Deployment > Reload, or restart it)")


class CodeChangedError(FactoryError):
    """The factory's code on disk, or the code this process imported, is not the run's."""


def package_dir() -> Path:
    """The folder of the imported ``factory`` package (a checkout's or a wheel's)."""
    return Path(factory.__file__).resolve().parent


def manifest(root: Path | None = None) -> dict[str, str]:
    """The sha256 of every ``*.py`` under ``root`` (default: the ``factory`` package), by path
    relative to it; linked folders are followed (``factory/assets -> ../assets``)."""
    root = package_dir() if root is None else root
    files: dict[str, str] = {}
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in names:
            if name.endswith(".py"):
                path = Path(folder) / name
                files[path.relative_to(root).as_posix()] = hashlib.sha256(
                    path.read_bytes()).hexdigest()
    return files


def fingerprint(files: dict[str, str]) -> str:
    """One name for a manifest: 16 hex digits of the sha256 of its sorted entries."""
    text = "".join(f"{path}\0{digest}\n" for path, digest in sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def changed_files(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """The paths added, removed or edited between two manifests, sorted."""
    return sorted(p for p in old.keys() | new.keys() if old.get(p) != new.get(p))


def manifest_path(code: str) -> Path:
    return get_settings().home / MANIFEST_DIR / f"{code}.json"


def save_manifest(files: dict[str, str], keep: int = KEEP_MANIFESTS) -> Path:
    """Keep ``files`` as ``$FACTORY_HOME/code/<fingerprint>.json`` (written once, atomically;
    touched when loaded again), and only the ``keep`` most recently loaded manifests."""
    path = manifest_path(fingerprint(files))
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(files, indent=0, sort_keys=True))
        tmp.replace(path)
    others = []
    for old in path.parent.glob("*.json"):
        try:
            if old != path:
                others.append((old.stat().st_mtime_ns, old))
        except FileNotFoundError:  # pruned by another process meanwhile
            continue
    # The newest, strictly (file times are coarser than a quick succession of loads).
    stamp = max([time.time_ns(), *(t + 1 for t, _ in others)])
    os.utime(path, ns=(stamp, stamp))
    for _, old in sorted(others, reverse=True)[max(keep, 1) - 1:]:
        old.unlink(missing_ok=True)
    return path


def load_manifest(code: str) -> dict[str, str] | None:
    """The manifest of version ``code`` as its code location kept it; None where this node
    has none (the code location ran on another node)."""
    try:
        files: dict[str, str] = json.loads(manifest_path(code).read_text())
    except (OSError, ValueError):
        return None
    return files


@dataclass(frozen=True, kw_only=True)
class Pin:
    """The code a process works for, and the code it imported."""

    code: str
    """The fingerprint this process's work must run on: the run's, or the code location's."""
    in_run: bool
    """True in a run worker (``code`` is the run's), False in a code location's process."""
    loaded: dict[str, str]
    """The manifest of the tree when this process imported the definitions."""


_pin: Pin | None = None


def pin() -> str | None:
    """Take this process's pin where Dagster loads the definitions (see the module's
    docstring); the fingerprint the pin holds, None when nothing is pinned. Called once by the
    composition root, after its imports."""
    global _pin
    from dagster._core.definitions.definitions_load_context import (
        DefinitionsLoadContext,
        DefinitionsLoadType,
    )

    if not DefinitionsLoadContext.is_set():
        return None  # imported as a plain module: no code location, no run
    context = DefinitionsLoadContext.get()
    loaded = manifest()
    if context.load_type == DefinitionsLoadType.INITIALIZATION:
        code = fingerprint(loaded)
        save_manifest(loaded)
        context.add_to_pending_reconstruction_metadata(PIN_KEY, code)
        _pin = Pin(code=code, in_run=False, loaded=loaded)
        return code
    started = context.reconstruction_metadata.get(PIN_KEY)
    if not isinstance(started, str):
        return None  # a run its code location did not pin
    _pin = Pin(code=started, in_run=True, loaded=loaded)
    return started


def pinned() -> Pin | None:
    """This process's pin, if ``pin`` took one."""
    return _pin


def check_run() -> None:
    """In a run worker of a pinned run: raise ``CodeChangedError`` when the code it imported or
    the tree on disk is not the run's. Elsewhere nothing (a sensor of a code location refuses
    nothing: the runs it requests carry its version and refuse to start on another)."""
    if _pin is not None and _pin.in_run:
        check()


def check() -> None:
    """Raise ``CodeChangedError`` when the code this process imported or the tree on disk
    is not the pinned version (the run's in a run worker, the code location's in a code
    location's process); nothing without a pin. For a step before it works, and for a caller
    about to start a process that imports the factory (the trainer, an inference server)."""
    if _pin is None:
        return
    now = manifest()
    started = load_manifest(_pin.code) if _pin.in_run else _pin.loaded
    what = "this run" if _pin.in_run else "this code location"
    if fingerprint(_pin.loaded) != _pin.code:
        # The worker imported a tree other than the one the run was created from.
        raise CodeChangedError(
            f"the factory's code changed between the code location's load and the start of "
            f"this run worker ({_named(started, _pin.loaded)}); {FIX}")
    if fingerprint(now) != _pin.code:
        raise CodeChangedError(
            f"the factory's code changed since {what} started "
            f"({_named(started, now)}); {FIX}")


def _named(old: dict[str, str] | None, new: dict[str, str]) -> str:
    if old is None:
        return "the changed files are not named: no manifest of the run's code on this node"
    paths = [f"factory/{p}" for p in changed_files(old, new)]
    more = f" and {len(paths) - MAX_NAMED} more" if len(paths) > MAX_NAMED else ""
    return "changed: " + ", ".join(paths[:MAX_NAMED]) + more
