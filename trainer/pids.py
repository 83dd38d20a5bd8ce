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
