"""``factory daemon``: this node runs the Dagster daemon of the instance until stopped.

On one machine ``factory ui`` (``dagster dev``) or ``factory run`` start a daemon as they need
one. With the instance shared between nodes (``FACTORY_DATABASE_URL``), one node runs it for
all: this command starts it with its code server (``factory.app.instance.ensure_daemon``) and
keeps them until Ctrl-C or SIGTERM, then stops both. A second daemon on one instance would
evaluate every sensor and dequeue every run twice, so a daemon already heartbeating for the
instance (from any node) is an error here.
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

from factory.app.instance import daemon_running, ensure_daemon, instance
from factory.errors import FactoryError
from factory.process import is_alive

CHECK_S = 2.0
"""How often the started processes are checked to be alive."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "daemon", help="run the Dagster daemon of the instance on this node until stopped",
        description="Starts the Dagster daemon and the code server it launches runs through, "
                    "and keeps them running until Ctrl-C or SIGTERM. One per instance: with a "
                    "shared instance (FACTORY_DATABASE_URL), run it on one node.")
    p.set_defaults(func=_daemon)


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _daemon(args: argparse.Namespace) -> int:
    inst = instance()
    if daemon_running(inst):
        raise FactoryError("a Dagster daemon is already running for this instance (fresh "
                           "heartbeats in its storage, from this node or another): one per "
                           "instance")
    signal.signal(signal.SIGTERM, _stop)
    with ensure_daemon(inst, progress=print) as started:
        assert started is not None  # none was running a moment ago
        print(f"daemon {started.pid}, code server {started.code_server_pid} on port "
              f"{started.port}; Ctrl-C stops both", flush=True)
        while is_alive(started.pid) and is_alive(started.code_server_pid):
            time.sleep(CHECK_S)
        raise FactoryError("the Dagster daemon or its code server exited; logs under "
                           f"{started.workspace.parent / 'logs'}")
