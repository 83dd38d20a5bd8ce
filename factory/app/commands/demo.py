"""``factory demo``: the main job on the embedded default, with its verdict."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded default")
    p.add_argument("--experiment", default="demo-extract",
                   help="the demo experiment (default demo-extract, on SmolLM2-135M; "
                        "demo-extract-gemma: the same task on Gemma 3 270M)")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    # the demo loads Dagster, the definitions and the gateway (seconds)
    from factory.app.demo import run_demo, shortfall

    summary = run_demo(experiment=args.experiment)
    print(json.dumps(summary))
    why = shortfall(summary)
    if why is not None:
        # The JSON line stays last on stdout; the verdict goes to stderr and the exit code.
        print(f"factory demo: {why}", file=sys.stderr)
        return 1
    return 0
