"""``factory.process``'s reading of ``/proc``: the resident memory of a process group, summed
over real processes that each hold a known amount."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.process import group_rss, is_alive, stop_group
from tests.waiting import wait_until

MIB = 1 << 20

HOLDER = """
import subprocess, sys

block = b"\\1" * (64 << 20)  # 64 MiB written, so resident
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, __file__, "child"], stdout=subprocess.PIPE)
    child.stdout.readline()
print("ready", flush=True)
sys.stdin.read()  # until the test closes stdin
"""


def test_group_rss_sums_the_resident_memory_of_every_process_of_the_group(
        tmp_path: Path) -> None:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    # Its own session: the group is the parent and the child it starts, not this process.
    proc = subprocess.Popen([sys.executable, str(script), "parent"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        rss = group_rss(proc.pid)
        # Two interpreters holding 64 MiB each, plus each one's own ~10-30 MiB: one process
        # alone stays under 128 MiB, so the sum counts both.
        assert 128 * MIB <= rss < 256 * MIB, rss / MIB
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        stop_group(proc.pid, timeout_s=10)
        proc.wait(timeout=30)
    # Once its processes are gone (the child exits on its own signal, after the parent), the
    # group holds nothing.
    wait_until(lambda: group_rss(proc.pid) == 0, timeout_s=30, what="the group to be gone")


STUBBORN = """
import signal, subprocess, sys

if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, __file__, "child"], stdout=subprocess.PIPE)
    print(child.stdout.readline().decode().strip(), flush=True)  # the child's pid
    signal.pause()  # until a signal's default action ends it
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import os
    print(os.getpid(), flush=True)
    signal.pause()
"""


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_stop_group_leaves_nothing_of_the_group_when_its_leader_exits_first(
        tmp_path: Path, first: int) -> None:
    """The leader exits on the first signal, its child ignores it: the child goes too (the
    leader's exit is no reason to leave its group running), and the call says ``terminated``
    without waiting out its timeout."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    proc = subprocess.Popen([sys.executable, str(script), "parent"], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        started = time.monotonic()
        assert stop_group(proc.pid, timeout_s=60, first=first) == "terminated"
        assert time.monotonic() - started < 30
        proc.wait(timeout=30)
        wait_until(lambda: not is_alive(child), timeout_s=30, what="the child to be gone")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert stop_group(proc.pid, timeout_s=1) == "gone"


def test_a_sigterm_dropped_by_a_finalizer_is_raised_again() -> None:
    """A signal handler's exception raised inside a weakref callback (or any finalizer) is
    printed and dropped by Python; the CLI's SIGTERM handler keeps it pending, and the next
    ``raise_pending`` of a waiting loop raises it where it is handled."""


    class Held:
        pass

    # The CLI's handler goes in only over SIGTERM's default action (an earlier test's in-process
    # Dagster run may have left SIGINT's handler on it).
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        _dropped_sigterm_is_raised_again(Held)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _dropped_sigterm_is_raised_again(held_type: type) -> None:
    import gc
    import weakref

    from factory.app.cli import Terminated, _terminate_as_interrupt
    from factory.process import interrupt_handled, raise_pending

    with _terminate_as_interrupt():
        held = held_type()
        ref = weakref.ref(held, lambda _: os.kill(os.getpid(), signal.SIGTERM))
        del held  # the callback runs now; the handler raises in it, and Python drops that
        gc.collect()
        assert ref() is None
        with pytest.raises(Terminated):
            raise_pending()
        raise_pending()  # raised once
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, between two bytecodes
            raise AssertionError("SIGTERM raised nothing")
        except Terminated:
            interrupt_handled()
        raise_pending()  # it arrived: nothing pending
