"""Detached server processes: started in their own session, not children of the caller.

A deployed server must outlive the ``factory deploy`` process (or Dagster run) that started it
and be stoppable later by another process, knowing only its pid. A tiny helper interpreter
starts the server in a new session and exits at once, so the server is re-parented to init: no
zombie in the caller, no ``Popen`` object whose garbage collection complains, and the pid is
also the process group id (the server's own children stop with it).

Where such a server is placed: a server that binds port 0 writes the port it got to a pipe
handed down to it (``pass_fds``, ``read_report``); for one that can only bind the port it is
told, ``/proc/net`` says which sockets listen on or are connected through a port
(``port_sockets``), ``/proc/<pid>/fd`` whether they are the server's (``socket_inodes``), and a
bind whether the port is held at all (``port_taken``). What a server holds in memory, its
children included, is its group's resident memory (``group_rss``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from factory.errors import FactoryError
from factory.trainer.pids import is_alive

_HELPER = (
    "import os, subprocess, sys\n"
    "log = open(sys.argv[1], 'ab')\n"
    "fds = tuple(int(fd) for fd in sys.argv[2].split(',') if fd)\n"
    "p = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL, stdout=log,\n"
    "                     stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds)\n"
    "print(p.pid, flush=True)\n"
    "os._exit(0)\n"
)

LISTEN = "0A"
"""``/proc/net/tcp``'s state of a listening socket."""


class ProcessError(FactoryError):
    """A server process could not be started."""


def spawn_detached(argv: Sequence[str], *, log_path: Path, env: Mapping[str, str],
                   cwd: Path | None = None, pass_fds: Sequence[int] = ()) -> int:
    """Start ``argv`` detached (own session, output appended to ``log_path``); its pid.
    ``pass_fds``: descriptors of the caller the server inherits, at the same numbers (the write
    end of a pipe it reports its port on)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fds = ",".join(str(fd) for fd in pass_fds)
    out = subprocess.run([sys.executable, "-c", _HELPER, str(log_path), fds, *argv],
                         env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=60,
                         check=False, pass_fds=tuple(pass_fds))
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ProcessError(f"cannot start {argv[0]!r}: {last}")
    return int(out.stdout.strip())


def read_report(fd: int, timeout_s: float) -> str | None:
    """The first line a started process writes to the pipe whose read end is ``fd`` (closed
    here), without its newline; None when every write end is closed without one (the process
    exited); ``TimeoutError`` when no line came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        data = b""
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                raise TimeoutError(f"no report within {timeout_s:.0f} s")
            chunk = pipe.read(64)
            if not chunk:
                return None
            data += chunk
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


def tcp_sockets() -> list[tuple[int, str, str]] | None:
    """``(local port, state, inode)`` of every TCP socket of this machine's network namespace
    (IPv4 and IPv6) that ``/proc/net`` lists; None where ``/proc`` cannot say."""
    found: list[tuple[int, str, str]] = []
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            found.append((int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]))
    return found if read else None


def port_sockets(port: int) -> list[tuple[str, str]] | None:
    """``(state, inode)`` of every TCP socket whose local port is ``port`` in this machine's
    network namespace (IPv4 and IPv6), from ``/proc/net``: listeners (state ``0A``),
    connections, and connections in TIME_WAIT (inode ``0``, owned by no process); None where
    ``/proc`` cannot say. A socket bound but not listening yet is not shown (the kernel lists
    only its listening and connection tables): ``port_taken`` finds it."""
    sockets = tcp_sockets()
    if sockets is None:
        return None
    return [(state, inode) for local, state, inode in sockets if local == port]


def port_taken(host: str, port: int, *, reuse_port: bool = False) -> bool:
    """Whether a socket holds ``host:port``, bound or listening: a bind fails with
    ``EADDRINUSE``. With ``reuse_port`` the bind sets ``SO_REUSEPORT``, as vLLM's does, and fails
    only for a socket that did not set it too (or is another user's). A free port is held by
    the probe for the instant of its bind: a server binding it at that very instant fails (and,
    started through ``on_free_port``, is started again)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        if reuse_port:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process ``pid`` has open (``/proc/<pid>/fd``); empty when it is
    gone or its descriptors cannot be read."""
    folder = Path(f"/proc/{pid}/fd")
    inodes: set[str] = set()
    try:
        fds = os.listdir(folder)
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(folder / fd)
        except OSError:  # closed since it was listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def group_rss(pgid: int) -> int:
    """Resident bytes of the processes of group ``pgid`` together (``/proc/<pid>/stat``; a page
    two of them share counts in each); 0 for a group with no process, or where ``/proc`` cannot
    say."""
    try:
        entries = [e for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return 0
    total = 0
    for entry in entries:
        try:
            # The fields after the command name, which may hold spaces and parentheses.
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) == pgid:  # field 5: pgrp
                total += int(stat[21])  # field 24: rss, in pages
        except (OSError, ValueError, IndexError):  # gone since it was listed
            continue
    return total * os.sysconf("SC_PAGE_SIZE")


def runs_command(pid: int, needle: Sequence[str]) -> bool:
    """True if ``pid``'s command line contains ``needle`` as consecutive arguments.

    Guards a stop against a recycled pid: a pid recorded days ago may now be someone else's.
    Where /proc is not available the check cannot be made and passes. A server started on port
    0 that reported the port it bound (``--port 0 ... --port-fd FD``) cannot name its port on
    its command line: ``--port P`` matches it while it holds port P (``holds_port``).
    """
    path = Path(f"/proc/{pid}/cmdline")
    if not Path("/proc/self/cmdline").exists():
        return True
    try:
        args = path.read_bytes().decode("utf-8", "replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    if _contains(args, needle):
        return True
    if (len(needle) == 2 and needle[0] == "--port" and needle[1].isdigit()
            and _contains(args, ["--port", "0"]) and "--port-fd" in args):
        return holds_port(pid, int(needle[1]))
    return False


def _contains(args: Sequence[str], needle: Sequence[str]) -> bool:
    n = len(needle)
    return any(list(args[i:i + n]) == list(needle) for i in range(len(args) - n + 1))


def holds_port(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds TCP ``port``: one of its sockets listens there, or, while it
    listens nowhere yet (a server binds before it loads its model, and ``/proc/net`` does not
    show a socket that is only bound), the port is taken."""
    mine = socket_inodes(pid)
    listening = {local for local, state, inode in tcp_sockets() or []
                 if state == LISTEN and inode in mine}
    if listening:
        return port in listening
    return port_taken("0.0.0.0", port)


def stop_group(pid: int, *, timeout_s: float = 60.0, first: int = signal.SIGTERM) -> str:
    """Stop the process group ``pid``: ``first`` to it (SIGTERM: servers finish in-flight
    requests; SIGINT: Dagster's daemon stops its threads, its code server its runs), SIGKILL
    after ``timeout_s`` if its leader still runs, then SIGKILL to whatever of the group outlived
    its leader: nothing started in the group outlives it. Returns ``terminated``, ``killed``,
    or ``gone`` (no leader to signal: nothing is sent, since the pid may name another group by
    now). The leader of a child of this process stays a zombie for its ``Popen`` to reap."""
    if not is_alive(pid):
        return "gone"
    try:
        os.killpg(pid, first)
    except ProcessLookupError:
        return "gone"
    outcome = "terminated"
    deadline = time.monotonic() + timeout_s
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if is_alive(pid):
        outcome = "killed"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return outcome


_pending: list[type[BaseException]] = []
"""The interrupt a signal handler raised (``interrupt``) until its handler says it arrived."""


def interrupt(exc: type[BaseException]) -> NoReturn:
    """Raise ``exc`` from a signal handler, and keep it pending until ``interrupt_handled``.

    Python runs a handler between any two bytecodes of the main thread, finalizers and weakref
    callbacks included, and an exception raised there is printed ("Exception ignored in ...")
    and dropped: a SIGTERM landing in a garbage collection's callback would be lost. A loop that
    waits calls ``raise_pending`` each round, which raises it again."""
    _pending[:] = [exc]
    raise exc()


def interrupt_handled() -> None:
    """The pending interrupt arrived where it is handled: nothing to raise again."""
    _pending.clear()


def raise_pending() -> None:
    """Raise the interrupt a handler raised where it was dropped (see ``interrupt``)."""
    if _pending:
        exc = _pending.pop()
        raise exc()


_SIGINT_DEFAULT = ("import os, signal, sys\n"
                   "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                   "os.execvp(sys.argv[1], sys.argv[1:])\n")


def sigint_default(argv: Sequence[str]) -> list[str]:
    """``argv``, to be run with SIGINT at its default action. A process started in the
    background by a shell inherits SIGINT ignored, and so do its children; Dagster's code
    server then ignores SIGINT and SIGTERM both (``setup_interrupt_handlers`` gives SIGTERM
    SIGINT's handler) and is only ended by SIGKILL. Where this process ignores SIGINT, the
    command runs through a helper interpreter that resets it and execs ``argv`` (a reset in
    ``preexec_fn`` is not safe with threads); elsewhere ``argv`` as is (exec resets handlers)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return list(argv)
    return [sys.executable, "-S", "-c", _SIGINT_DEFAULT, *argv]


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
