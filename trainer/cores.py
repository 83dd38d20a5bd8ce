"""The CPU cores of one machine, shared by the factory's torch processes on it.

On a CPU machine the loop trains and evaluates at once: a checkpoint's evals run on the CPU
inference server while the trainer goes on, each a torch process with a thread per core. Two
such processes on two cores oversubscribe them, and GNU OpenMP's threads spin at every barrier
while the other process holds the core they wait for: the trainer's step went from 3.3 s alone
to 14.5 s beside a server, and the server answered 0.4 requests a second (BENCHMARKS.md, "CPU
sharing"). Splitting the cores instead keeps both going.

Each CPU torch process of the factory (a trainer on the CPU, the CPU inference server) holds a
*claim*: a file named by its pid in a folder every such process of this user on this machine
reads (``$FACTORY_CORE_SHARES``, default ``<tmp>/factory-cores-<uid>``). ``CoreShare.adjust``
counts the claims of live processes and sets torch's thread count, for the calling thread, to
this process's share: its own thread count (torch's when it joined: the physical cores, unless set
lower) less the threads pinned by processes with a fixed count, divided among the others, at
least one. A process started with its thread count set (``OMP_NUM_THREADS``, the
server's ``--threads``) keeps it and claims that many cores. ``FACTORY_CORE_SHARE=0`` turns
sharing off: no claim, torch's own thread count.

Alone on the machine a process keeps every core; the split happens only while another claim
is live, and ends with it (the next ``adjust`` after that process exits, or after its claim is
found to name a dead pid, which is then removed).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .pids import is_alive

ENV_FOLDER = "FACTORY_CORE_SHARES"
"""The folder of the claims (default ``<tmp>/factory-cores-<uid>``)."""

ENV_SWITCH = "FACTORY_CORE_SHARE"
"""``0`` turns sharing off."""


def default_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"factory-cores-{os.getuid()}"


class CoreShare:
    """This process's claim on the machine's cores (see the module's text)."""

    def __init__(self, *, pinned: int | None = None, folder: Path | None = None,
                 cores: int | None = None) -> None:
        import torch

        self.pinned = pinned
        self.folder = folder or Path(os.environ.get(ENV_FOLDER) or default_folder())
        self.cores = cores or torch.get_num_threads()
        """The threads this process has alone: torch's count when the claim is made (a fresh
        process's default is the machine's physical cores; a count lowered before, by
        ``OMP_NUM_THREADS`` or ``set_num_threads``, is never raised)."""
        self.path: Path | None = None
        self.threads: int | None = None
        """Threads last set by ``adjust`` (None: never set)."""
        self._before: int | None = None  # torch's threads before the first adjust

    @classmethod
    def for_this_process(cls, *, pinned: int | None = None) -> CoreShare | None:
        """A claim for this process (joined), unless sharing is off (``FACTORY_CORE_SHARE=0``).
        ``pinned``: the thread count this process was given; ``OMP_NUM_THREADS`` counts as
        one."""
        if os.environ.get(ENV_SWITCH, "1") == "0":
            return None
        if pinned is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            pinned = int(os.environ["OMP_NUM_THREADS"]) or None
        share = cls(pinned=pinned)
        share.join()
        return share

    def join(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / str(os.getpid())
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(str(self.pinned or ""))
        tmp.replace(path)  # a reader sees a whole claim or none
        self.path = path

    def leave(self) -> None:
        """Remove the claim, and give torch back the thread count it had before ``adjust``
        (a process that goes on after its share, a test process running a trainer in it)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        if self._before is not None and self._before != self.threads:
            import torch

            torch.set_num_threads(self._before)
        self.threads = self._before = None

    def __enter__(self) -> CoreShare:
        if self.path is None:
            self.join()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def share(self) -> int:
        """This process's threads now: its pinned count, else the unpinned cores divided among
        the live unpinned claims (this one included), at least one."""
        if self.pinned:
            return self.pinned
        pinned_total, flexible = 0, 1
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            names = []
        for name in names:
            if not name.isdigit() or int(name) == os.getpid():
                continue
            path = self.folder / name
            if not is_alive(int(name)):
                path.unlink(missing_ok=True)  # its process died without leaving
                continue
            try:
                text = path.read_text().strip()
            except FileNotFoundError:
                continue
            if text.isdigit() and int(text) > 0:
                pinned_total += int(text)
            else:
                flexible += 1
        return max(1, (self.cores - pinned_total) // flexible)

    def adjust(self) -> int:
        """Set torch's threads to ``share()`` when that changed; the count. Call it from the
        thread that runs the model: with OpenMP the count is a setting of the thread that sets
        it (one thread's ``set_num_threads`` is not seen by a thread that already runs). The
        trainer calls it before every step, the server's batch thread before every batch."""
        n = self.share()
        if n != self.threads:
            import torch

            if self._before is None:
                self._before = torch.get_num_threads()
            torch.set_num_threads(n)
            self.threads = n
        return n
