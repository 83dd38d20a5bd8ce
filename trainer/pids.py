"""Whether a process still runs, knowing only its pid (Linux's /proc where it has one)."""

from __future__ import annotations

import os
from pathlib import Path


def _proc_state(pid: int) -> str | None:
    """The state letter from /proc (Linux), '' where /proc is not available, None if gone."""
    stat = Path(f"/proc/{pid}/stat")
    if not Path("/proc/self/stat").exists():
        return ""
    try:
        text = stat.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()[0]


def is_alive(pid: int | None) -> bool:
    """True while ``pid`` runs (a zombie waiting for init to reap it counts as gone)."""
    if not pid or pid <= 0:
        return False
    state = _proc_state(pid)
    if state is None or state in ("Z", "X"):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22): with the
    pid it names one process, since a reused pid has a later start. None if gone or unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[19])


def owner_token(pid: int | None = None) -> str:
    """``host:pid:start`` naming this process (or ``pid``) for as long as it runs: what a
    trainer is given as its owner (``TrainerJob.owner``)."""
    import socket

    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{start_time(pid) or 0}"


def owner_alive(token: str | None) -> bool | None:
    """Whether the process ``token`` (``owner_token``) names still runs: None where this
    process cannot tell (no token, or the owner is on another host)."""
    import socket

    if not token:
        return None
    try:
        host, pid_text, start_text = token.rsplit(":", 2)
        pid, start = int(pid_text), int(start_text)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    if not is_alive(pid):
        return False
    now = start_time(pid)
    return not (start and now is not None and now != start)
