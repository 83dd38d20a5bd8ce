"""``factory base-model``, ``factory ui`` and ``factory demo``: set-up and the main job."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Any

from factory.settings import get_settings


def register(sub: Any) -> None:
    p = sub.add_parser("base-model", help="build (or reuse) the embedded SmolLM2-135M directory")
    p.set_defaults(func=_base_model)

    p = sub.add_parser("ui", help="start the Dagster web UI with the factory's code location")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.set_defaults(func=_ui)

    p = sub.add_parser("demo", help="run the main job on the embedded default")
    p.set_defaults(func=_demo)


def _base_model(args: argparse.Namespace) -> int:
    from factory.app.runner import materialize

    result = materialize(["base_model"])
    mat = result.asset_materializations_for_node("base_model")[0]
    print(json.dumps({"path": mat.metadata["path"].value,
                      "num_parameters": mat.metadata["num_parameters"].value}))
    return 0


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


def _demo(args: argparse.Namespace) -> int:
    from factory.app.demo import run_demo
    from factory.evals.selection import CLEAR_MARGIN

    summary = run_demo()
    print(json.dumps(summary))
    base, best = summary["base_score"], summary["best_score"]
    gain = best - base if base is not None and best is not None else None
    if gain is None or gain < CLEAR_MARGIN:
        # The JSON line stays last on stdout; the verdict goes to stderr and the exit code.
        verdict = "no score" if gain is None else f"a gain of {gain:.3f}"
        print(f"factory demo: {verdict} of the best checkpoint over the base model; the "
              f"embedded task requires at least {CLEAR_MARGIN}", file=sys.stderr)
        return 1
    return 0
