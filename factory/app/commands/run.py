"""``factory run EXPERIMENT``: dataset, rubric, plan, training with mid-training evals, best
checkpoint and deployment for one experiment, through Dagster, ending in one JSON line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="materialize an experiment from its dataset to a live "
                                   "deployment (progress on stderr, JSON summary last)")
    p.add_argument("experiment", help="experiment name (experiments folder) or YAML path")
    p.add_argument("--no-deploy", action="store_true", help="stop after best_checkpoint")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # the run's client loads Dagster and the definitions (seconds)
    from factory.app.loop import run_experiment, terminal_plot

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    out = run_experiment(args.experiment, progress=progress, deploy=not args.no_deploy)
    if out["curve"]:
        progress(terminal_plot(out["curve"], label="mean rubric score by step"))
    print(json.dumps({k: out[k] for k in ("base_score", "best_score", "best_step", "endpoint",
                                          "model", "factory_home")}
                     | {k: v for k, v in out.items()
                        if k in ("experiment", "chain", "run_id", "version", "curve_png",
                                 "seconds", "best_score_interval", "base_score_interval",
                                 "eval_split")}))
    return 0
