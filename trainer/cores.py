"""The CPU cores of one machine, shared by the factory's torch processes on it that work.

On a CPU machine the loop trains and evaluates at once: a checkpoint's evals run on the CPU
inference server while the trainer goes on, each a torch process with a thread per core. Two
such processes on two cores oversubscribe them, and GNU OpenMP's threads spin at every barrier
while the other process holds the core they wait for: the trainer's step went from 3.55 s alone
to 17.5 s beside a server, and the server answered 0.35 requests a second (BENCHMARKS.md, "CPU
sharing"). Splitting the cores instead keeps both going.

Each CPU torch process of the factory holds a *claim* while it computes: a file named by its
pid in a folder every such process of this user on this machine reads (``$FACTORY_CORE_SHARES``,
default ``<tmp>/factory-cores-<uid>``). A trainer on the CPU claims for as long as its loop
runs; the CPU inference server only while it has requests in flight (``join`` on the first,
``release`` once none is left), so an idle server, a deployment waiting for traffic, takes no
core from a trainer. ``CoreShare.adjust`` counts the claims of live processes and sets torch's
thread count, for the calling thread, to this process's share: its own thread count (torch's
when it joined: the physical cores, unless set lower) less the threads pinned by processes with
a fixed count, divided among the others, at least one. A process started with its thread count
set (``OMP_NUM_THREADS``, the server's ``--threads``) keeps it and claims that many cores.
``FACTORY_CORE_SHARE=0`` turns sharing off: no claim, torch's own thread count.

A server that cannot claim per request itself (vLLM's CPU build: its engine is not our code) is
given a *busy-while* claim by the process that starts it (``claim_for``): a pinned count and the
server's Prometheus ``/metrics`` URL. Such a claim counts only while the server reports requests
running or waiting (``vllm:num_requests_running``, ``vllm:num_requests_waiting``), or cannot be
asked: a reader GETs the URL each time it counts (5 ms and 54 kB for vLLM 0.32's, idle), so a
trainer reading the claims before each step (3.3 s) pays 0.2% for it.

Alone on the machine, or beside idle servers, a process keeps every core; the split happens
only while another claim is live, and ends with it (the next ``adjust`` after that process
releases its claim or exits, or after its claim is found to name a dead pid, which is then
removed). A trainer reads the claims before every step and, within it, as each decoder layer's
forward starts and as its input's gradient arrives, at most every ``POLL_S`` (``poll``): an eval
that starts mid-step splits the cores within a layer or two, where waiting for the step's end
made training and eval together slower than one after the other (``bench/eval_overlap.py``).
The CPU server reads them before every batch, and claims and releases around its work: measured
on dev-cpu, ``share`` beside one claim takes 32 us, a ``join`` and ``release`` together 32 us,
and a changed ``torch.set_num_threads`` 4 us more on the next matmul, against steps and requests
of 0.1-5 s.
"""

from __future__ import annotations

import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from .pids import is_alive

ENV_FOLDER = "FACTORY_CORE_SHARES"
"""The folder of the claims (default ``<tmp>/factory-cores-<uid>``)."""

ENV_SWITCH = "FACTORY_CORE_SHARE"
"""``0`` turns sharing off."""

BUSY_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
"""The Prometheus gauges whose sum says a busy-while claim's server has work (vLLM's names)."""

POLL_S = 0.5
"""How often, at most, ``poll`` reads the claims again (the trainer's layers call it)."""

ENV_POLL = "FACTORY_CORE_POLL"
"""``0``: the trainer reads the claims between steps only, not within them (a baseline for
``bench/eval_overlap.py``)."""

BUSY_TIMEOUT_S = 1.0
"""How long a reader waits for a busy-while claim's ``/metrics``; past it the claim counts (a
server too loaded to answer is busy)."""


def default_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"factory-cores-{os.getuid()}"


def folder_of(env: Mapping[str, str] | None = None) -> Path | None:
    """The claims folder of a process with environment ``env`` (default this one's), None when
    sharing is off there (``FACTORY_CORE_SHARE=0``)."""
    env = os.environ if env is None else env
    if env.get(ENV_SWITCH, "1") == "0":
        return None
    return Path(env.get(ENV_FOLDER) or default_folder())


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a reader sees a whole claim or none


def claim_for(pid: int, *, pinned: int, busy_url: str, folder: Path) -> Path:
    """Write a busy-while claim for process ``pid`` (a server started by this process): it
    counts as ``pinned`` threads while the server at ``busy_url`` (its Prometheus ``/metrics``)
    reports requests running or waiting, and goes with the process (a reader removes a dead
    pid's claim)."""
    if pinned < 1:
        raise ValueError(f"pinned: must be at least 1 thread, got {pinned}")
    if not busy_url.startswith(("http://", "https://")):
        raise ValueError(f"busy_url: must be the server's http(s) /metrics URL, got {busy_url!r}")
    path = folder / str(pid)
    _write(path, f"{pinned}\n{busy_url}\n")
    return path


def server_busy(url: str) -> bool:
    """Whether the server whose Prometheus metrics are at ``url`` has requests running or
    waiting (``BUSY_METRICS``); True when it cannot be asked within ``BUSY_TIMEOUT_S`` or does
    not report them (the claim then counts, as a fixed one would)."""
    try:
        with urllib.request.urlopen(url, timeout=BUSY_TIMEOUT_S) as r:
            text = r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return True
    seen, work = False, 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in BUSY_METRICS:
            seen = True
            try:
                work += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                return True
    return work > 0 or not seen


def _threads_claimed(text: str) -> int | None:
    """The threads a claim's text pins (None: a flexible claim; 0: one that does not count now,
    a busy-while claim whose server is idle)."""
    first, _, rest = text.partition("\n")
    first, url = first.strip(), rest.strip()
    pinned = int(first) if first.isdigit() and int(first) > 0 else None
    if url and not server_busy(url):
        return 0
    return pinned


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
        """The claim's file while this process holds it (None: no claim now)."""
        self.threads: int | None = None
        """Threads last set by ``adjust`` (None: never set)."""
        self._before: int | None = None  # torch's threads before the first adjust
        self._polled = 0.0  # time.monotonic() of poll's last adjust

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
        """Claim this process's share (nothing to do while it holds the claim)."""
        if self.path is not None:
            return
        path = self.folder / str(os.getpid())
        _write(path, str(self.pinned or ""))
        self.path = path

    def release(self) -> None:
        """Drop the claim while this process has no work (a server between requests); torch's
        thread count stays as ``adjust`` set it, and ``join`` claims again."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def leave(self) -> None:
        """Remove the claim, and give torch back the thread count it had before ``adjust``
        (a process that goes on after its share, a test process running a trainer in it)."""
        self.release()
        if self._before is not None and self._before != self.threads:
            import torch

            torch.set_num_threads(self._before)
        self.threads = self._before = None

    def __enter__(self) -> CoreShare:
        self.join()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def share(self) -> int:
        """This process's threads now: its pinned count, else the unpinned cores divided among
        the live unpinned claims that count now (this one included), at least one."""
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
                threads = _threads_claimed(path.read_text())
            except FileNotFoundError:  # released while this one listed the folder
                continue
            if threads is None:
                flexible += 1
            else:
                pinned_total += threads
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

    def poll(self) -> None:
        """``adjust``, unless this process did within the last ``POLL_S`` seconds: what the
        trainer's decoder layers call within a step, so that a claim made mid-step (an eval
        server's first request) splits the cores within a layer or two instead of after the
        step, which the oversubscription itself slows (BENCHMARKS.md, "CPU sharing")."""
        now = time.monotonic()
        if now - self._polled >= POLL_S:
            self._polled = now
            self.adjust()
