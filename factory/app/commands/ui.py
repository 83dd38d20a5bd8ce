"""``factory ui``: the Dagster web UI with the factory's code location.

It runs ``dagster dev`` (webserver and daemon), except on an instance shared between nodes
(``FACTORY_DATABASE_URL``) whose daemon already runs (``factory daemon`` on some node): then
the webserver alone, since a second daemon would evaluate every sensor and dequeue every run
twice. On one machine ``dagster dev`` keeps its own daemon even beside ``factory run``'s, which
stops when that run ends.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Any

from factory.app.instance import RECONCILE, daemon_running, dagster_home, instance
from factory.lifeline import guard, on_death, release
from factory.process import sigint_default
from factory.settings import get_settings

STOP_S = 60.0
"""How long ``dagster dev`` gets to stop after SIGINT before its group is killed."""


def register(sub: Any) -> None:
    p = sub.add_parser("ui", help="start the Dagster web UI with the factory's code location")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.set_defaults(func=_ui)


def ui_command(host: str, port: int) -> list[str]:
    """The ``dagster dev`` command line for the factory's code location."""
    return [sys.executable, "-m", "dagster", "dev", "-m", "factory.definitions",
            "-h", host, "-p", str(port)]


def webserver_command(host: str, port: int) -> list[str]:
    """The ``dagster-webserver`` command line, for an instance whose daemon runs elsewhere."""
    return [sys.executable, "-m", "dagster_webserver", "-m", "factory.definitions",
            "-h", host, "-p", str(port)]


def _ui(args: argparse.Namespace) -> int:
    settings = get_settings().ensure()
    env = dict(os.environ)
    env["DAGSTER_HOME"] = str(dagster_home())
    env["FACTORY_HOME"] = str(settings.home)
    command = ui_command(args.host, args.port)
    note = ""
    if settings.database_url and daemon_running(instance()):
        command = webserver_command(args.host, args.port)
        note = "; the instance's daemon already runs, so this starts the webserver alone"
    print(f"Dagster UI on http://{args.host}:{args.port} (state in {settings.home}{note})",
          flush=True)
    # dagster dev inherits an ignored SIGINT when started in the background; it runs with
    # SIGINT reset, so Ctrl-C and `kill -INT <pid>` stop it. It runs in a session of its own,
    # stopped from here (Ctrl-C, SIGTERM) or by this process's lifeline should this process be
    # killed outright.
    proc = subprocess.Popen(sigint_default(command), env=env, start_new_session=True)
    guard(proc.pid)
    on_death(RECONCILE)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # dagster dev and its webserver, daemon and code servers (run workers included) stop
        # on SIGINT, as on a Ctrl-C in its own terminal.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
    finally:
        release(proc.pid)
