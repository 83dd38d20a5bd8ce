"""Process groups that end with the process that started them, however it ends (SIGKILL too).

The factory starts its helpers in sessions of their own (the Dagster daemon and code server of
``factory run``, ``factory ui``'s ``dagster dev``, an eval's inference server), so that Ctrl-C in
a terminal reaches only their owner, which then stops them in order. The kernel does not stop
them when their owner dies. A lifeline is a small watcher process per owner (``python -m
factory.lifeline``) reading a pipe whose write end only the owner holds: the owner registers each
group it starts (``add``) and releases it once it has stopped it (``drop``). When the owner dies,
the kernel closes the write end; the watcher reads end-of-file and stops every group still
registered: SIGINT to each (the daemon and code server stop their threads; a Dagster run worker
in the code server's group raises its interrupt in the running step, so ``training_run`` cancels
its trainer), then SIGKILL of whatever still runs after ``GRACE_S``; then it runs the owner's
``finally`` command, if it gave one (``factory run`` and ``factory ui`` give
``python -m factory.app.reconcile``: what the killed processes left recorded as running is
ended, with the reason). An owner that ends normally has dropped its groups, and the watcher
exits with nothing to do.

Why not ``PR_SET_PDEATHSIG``: it signals only the direct child (a code server's run workers are
the code server's children, not the owner's) and fires when the *thread* that started the child
ends, not the process. Why not the owner's own process group: a group shares the terminal's
Ctrl-C, and the daemon would be interrupted before the owner could stop a run in order.
A trainer is never registered: it must checkpoint and end its run for good when its owner dies,
which it does itself (``TrainerJob.owner``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

GRACE_S = 20.0
"""How long the groups of a dead owner get after SIGINT before SIGKILL."""
FINALLY_S = 120.0
"""How long the owner's ``finally`` command may run."""

_lock = threading.Lock()
_line: Lifeline | None = None


_START = (
    "import subprocess, sys\n"
    "fd = int(sys.argv[1])\n"
    "p = subprocess.Popen([sys.executable, '-m', 'factory.lifeline', '--fd', str(fd),\n"
    "                      '--grace', sys.argv[2]], pass_fds=(fd,), stdin=subprocess.DEVNULL,\n"
    "                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,\n"
    "                      start_new_session=True)\n"
    "print(p.pid, flush=True)\n"
)
"""Starts the watcher through a short-lived helper, so that it is not the owner's child: no
``Popen`` of the owner is left running at its exit, no zombie when the watcher ends first."""


class Lifeline:
    """This process's watcher (``lifeline()``)."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.owner = os.getpid()
        read_fd, self._fd = os.pipe()  # both close on exec: the watcher alone gets read_fd
        try:
            out = subprocess.run([sys.executable, "-c", _START, str(read_fd), str(grace_s)],
                                 pass_fds=(read_fd,), capture_output=True, text=True,
                                 check=True, timeout=60)
        finally:
            os.close(read_fd)
        self.pid = int(out.stdout.strip())
        """The watcher's pid."""

    def running(self) -> bool:
        """Whether the watcher still runs (a pipe whose reader is gone refuses writes)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _send(self, line: str) -> None:
        with _lock:
            os.write(self._fd, line.encode() + b"\n")

    def add(self, pgid: int, sig: int = signal.SIGINT) -> None:
        """Stop group ``pgid`` with ``sig`` (then SIGKILL) if this process dies first."""
        self._send(f"add {pgid} {int(sig)}")

    def drop(self, pgid: int) -> None:
        """This process stopped group ``pgid`` itself: leave it be."""
        self._send(f"drop {pgid}")

    def finally_run(self, argv: list[str]) -> None:
        """Run ``argv`` after stopping the groups of this process, should it die first."""
        self._send("then " + json.dumps(argv))


def lifeline() -> Lifeline:
    """The lifeline of this process, started on first use (again in a forked child)."""
    global _line
    with _lock:
        if _line is None or _line.owner != os.getpid() or not _line.running():
            _line = Lifeline()
        return _line


def guard(pgid: int, sig: int = signal.SIGINT) -> None:
    """``lifeline().add``, where the watcher can be started; a process whose watcher cannot
    start still runs its groups (they are stopped in order when it ends normally)."""
    try:
        lifeline().add(pgid, sig)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass


def on_death(argv: list[str]) -> None:
    """``lifeline().finally_run``, where the watcher can be started."""
    try:
        lifeline().finally_run(argv)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass


def release(pgid: int) -> None:
    """``lifeline().drop`` of a group ``guard`` registered."""
    try:
        lifeline().drop(pgid)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_groups(groups: dict[int, int], grace_s: float) -> None:
    """Signal each group its own signal, SIGKILL what still runs after ``grace_s``."""
    for pgid, sig in groups.items():
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(group_alive(g) for g in groups):
        time.sleep(0.1)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _watch(pipe: IO[bytes], grace_s: float) -> None:
    groups: dict[int, int] = {}
    then: list[str] | None = None
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", "replace")
        parts = line.split()
        if len(parts) == 3 and parts[0] == "add":
            groups[int(parts[1])] = int(parts[2])
        elif len(parts) == 2 and parts[0] == "drop":
            groups.pop(int(parts[1]), None)
        elif parts and parts[0] == "then":
            then = json.loads(line[len("then"):])
    if not groups:
        return
    stop_groups(groups, grace_s)
    if then:
        subprocess.run(then, stdin=subprocess.DEVNULL, timeout=FINALLY_S, check=False)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    grace_s = float(args[args.index("--grace") + 1]) if "--grace" in args else GRACE_S
    fd = int(args[args.index("--fd") + 1]) if "--fd" in args else sys.stdin.fileno()
    # The owner's end is this watcher's cue; a stray signal must not cut it short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with os.fdopen(fd, "rb") as pipe:
        _watch(pipe, grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
