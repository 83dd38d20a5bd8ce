"""``factory sweep EXPERIMENT``: run every point of the sweep to the end, then compare.

The sweep runs as the experiment's chain on the Dagster instance (``factory run``'s client):
every point is planned and trained, each checkpoint evaluated, the best checkpoint selected
among the points by task score and promoted per the experiment's ``deploy`` policy (``manual``
by default for a sweep). The comparison table shows each point's plan values, final loss and
best eval score from the lake; ``--compare`` only prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from factory.experiments import load_experiment
from factory.lake import Lake


def register(sub: Any) -> None:
    p = sub.add_parser("sweep", help="run an experiment's sweep points to the end and compare "
                                     "them by task score")
    p.add_argument("experiment", help="experiment name (experiments folder) or YAML path")
    p.add_argument("--compare", action="store_true", help="only print the comparison table")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=_sweep)


def _sweep(args: argparse.Namespace) -> int:
    # the planner loads factory.evals and httpx (0.5 s): the CLI's other commands start without
    from factory.planner import render, service

    experiment = load_experiment(args.experiment)
    if not args.compare:
        # the run's client loads Dagster and the definitions (seconds)
        from factory.app.loop import run_experiment

        run_experiment(experiment.name,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    rows = service.sweep_comparison(Lake(), experiment)
    if args.json:
        print(json.dumps(rows, default=str))
    else:
        print(render.comparison_table(rows))
    return 0
