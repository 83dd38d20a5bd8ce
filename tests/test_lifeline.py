"""A lifeline stops the process groups of an owner killed outright (SIGKILL), and leaves alone
the groups the owner released: a real owner process, real children in sessions of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from factory.lifeline import group_alive
from tests.waiting import wait_until

# An owner: starts two children in sessions of their own (one stops on SIGINT, one ignores
# it), registers both, releases a third, prints the pids, then waits to be killed.
OWNER = textwrap.dedent("""
    import signal, subprocess, sys, time
    from factory.lifeline import Lifeline
    line = Lifeline(grace_s=float(sys.argv[1]))
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              start_new_session=True)
    stubborn = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(600)"],
        start_new_session=True, stdout=subprocess.PIPE)
    stubborn.stdout.readline()
    kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)
    line.add(polite.pid)
    line.add(stubborn.pid)
    line.add(kept.pid)
    line.drop(kept.pid)
    print(polite.pid, stubborn.pid, kept.pid, line.pid, flush=True)
    time.sleep(600)
""")


def test_the_groups_of_a_killed_owner_stop_and_released_ones_stay(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "2"], stdout=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parents[1])
    assert owner.stdout is not None
    polite, stubborn, kept, watcher = map(int, owner.stdout.readline().split())
    try:
        assert all(group_alive(g) for g in (polite, stubborn, kept))
        owner.kill()
        owner.wait()
        # SIGINT ends the polite one at once; the one ignoring it is killed after the grace.
        wait_until(lambda: not group_alive(polite), timeout_s=10, what="the polite group")
        wait_until(lambda: not group_alive(stubborn), timeout_s=15,
                   what="the stubborn group (SIGKILL after the grace)")
        wait_until(lambda: not group_alive(watcher), timeout_s=10, what="the watcher to exit")
        assert group_alive(kept)  # released by its owner: not the lifeline's to stop
    finally:
        for pid in (polite, stubborn, kept):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_owner_that_stops_its_groups_leaves_the_watcher_nothing_to_do() -> None:
    script = textwrap.dedent("""
        import subprocess, sys
        from factory.lifeline import lifeline
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        lifeline().add(child.pid)
        child.kill(); child.wait()
        lifeline().drop(child.pid)
        print(lifeline().pid, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    watcher = int(out.stdout.split()[0])
    # The owner exited normally: the watcher reads end-of-file and exits with nothing to stop.
    wait_until(lambda: not group_alive(watcher), timeout_s=10, what="the watcher to exit")
