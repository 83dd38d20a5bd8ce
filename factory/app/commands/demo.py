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
    from factory.app.demo import run_demo
    from factory.evals.selection import CLEAR_MARGIN

    summary = run_demo(experiment=args.experiment)
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
