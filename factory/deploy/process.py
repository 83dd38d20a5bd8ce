"""Detached server processes: started in their own session, not children of the caller.

A deployed server must outlive the ``factory deploy`` process (or Dagster run) that started it
and be stoppable later by another process, knowing only its pid. A tiny helper interpreter
starts the server in a new session and exits at once, so the server is re-parented to init: no
zombie in the caller, no ``Popen`` object whose garbage collection complains, and the pid is
also the process group id (the server's own children stop with it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from factory.errors import FactoryError
from factory.trainer.pids import is_alive

_HELPER = (
    "import os, subprocess, sys\n"
    "log = open(sys.argv[1], 'ab')\n"
    "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log,\n"
    "                     stderr=subprocess.STDOUT, start_new_session=True)\n"
    "print(p.pid, flush=True)\n"
    "os._exit(0)\n"
)


class ProcessError(FactoryError):
    """A server process could not be started."""


def spawn_detached(argv: Sequence[str], *, log_path: Path, env: Mapping[str, str],
                   cwd: Path | None = None) -> int:
    """Start ``argv`` detached (own session, output appended to ``log_path``); its pid."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", _HELPER, str(log_path), *argv], env=dict(env),
                         cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ProcessError(f"cannot start {argv[0]!r}: {last}")
    return int(out.stdout.strip())


def runs_command(pid: int, needle: Sequence[str]) -> bool:
    """True if ``pid``'s command line contains ``needle`` as consecutive arguments.

    Guards a stop against a recycled pid: a pid recorded days ago may now be someone else's.
    Where /proc is not available the check cannot be made and passes.
    """
    path = Path(f"/proc/{pid}/cmdline")
    if not Path("/proc/self/cmdline").exists():
        return True
    try:
        args = path.read_bytes().decode("utf-8", "replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    n = len(needle)
    return any(args[i:i + n] == list(needle) for i in range(len(args) - n + 1))


def stop_group(pid: int, *, timeout_s: float = 60.0) -> str:
    """SIGTERM the process group ``pid`` (servers finish in-flight requests on it), SIGKILL
    after ``timeout_s``. Returns ``terminated``, ``killed`` or ``gone``."""
    if not is_alive(pid):
        return "gone"
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return "gone"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return "terminated"
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "terminated"
    deadline = time.monotonic() + 10.0
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return "killed"


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside: cleanup after a Ctrl-C (stopping what was started)
    must not be cut short by a second one. Handlers only change on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            # None: a handler installed outside Python, which cannot be put back from here;
            # the default is closer to it than staying ignored (children would inherit that).
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
