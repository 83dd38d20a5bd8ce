"""``factory ui``: the Dagster web UI with the factory's code location."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Any

from factory.settings import get_settings


def register(sub: Any) -> None:
    p = sub.add_parser("ui", help="start the Dagster web UI with the factory's code location")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.set_defaults(func=_ui)


def ui_command(host: str, port: int) -> list[str]:
    """The ``dagster dev`` command line for the factory's code location."""
    return [sys.executable, "-m", "dagster", "dev", "-m", "factory.definitions",
            "-h", host, "-p", str(port)]


def _ui(args: argparse.Namespace) -> int:
    from factory.app.instance import dagster_home

    settings = get_settings().ensure()
    env = dict(os.environ)
    env["DAGSTER_HOME"] = str(dagster_home())
    env["FACTORY_HOME"] = str(settings.home)
    print(f"Dagster UI on http://{args.host}:{args.port} (state in {settings.home})", flush=True)
    # dagster dev inherits an ignored SIGINT when started in the background; reset it so
    # Ctrl-C and `kill -INT <pid>` stop it.
    proc = subprocess.Popen(ui_command(args.host, args.port), env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        return proc.wait()
