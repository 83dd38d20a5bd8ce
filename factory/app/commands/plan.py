"""``factory plan EXPERIMENT``: every planned value of each run with the rule that chose it,
and the run's predicted wall time split into training and evals.

Plans from the experiment's newest ``dataset_profile`` row (or ``--profile FILE.json``, a row as
JSON, to try a plan before any data exists). A plan that cannot run exits 2 with what to change.
``--card`` also writes the experiment card to ``docs/experiments/<name>.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from factory.errors import FactoryError
from factory.experiments import load_experiment
from factory.lake import Lake
from factory.recipes import load_recipe


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="plan an experiment's runs and explain every value")
    p.add_argument("experiment", help="experiment name (experiments folder) or YAML path")
    p.add_argument("--run", help="only the run with this key (default: every sweep point)")
    p.add_argument("--profile", type=Path,
                   help="a dataset_profile row as a JSON file, instead of reading the lake")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.add_argument("--card", nargs="?", const=Path("docs/experiments"), type=Path,
                   metavar="DIR", help="write the experiment card to DIR/<name>.md "
                                       "(default DIR: docs/experiments)")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    # the planner loads factory.evals and httpx (0.5 s): the CLI's other commands start without
    from factory.planner import host, profile, render, service

    experiment = load_experiment(args.experiment)
    recipe = load_recipe(experiment.recipe)
    source_rows: dict[str, int] = {}
    if args.profile:
        try:
            row = json.loads(args.profile.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FactoryError(f"--profile {args.profile}: {exc}") from None
        dataset_profile = profile.DatasetProfile.from_row(row)
    else:
        lake = Lake()
        dataset_profile = profile.read_profile(lake, experiment.name)
        source_rows = service.mix_rows(experiment, lake)
    plans = service.plan_runs(experiment, dataset_profile, source_rows=source_rows,
                              time_cache=host.time_model_cache())
    if args.run:
        plans = [p for p in plans if p.run_key == args.run]
        if not plans:
            raise FactoryError(f"no run {args.run!r} in {experiment.name}")
    if args.card is not None:
        args.card.mkdir(parents=True, exist_ok=True)
        dest = args.card / f"{experiment.name}.md"
        dest.write_text(render.experiment_card(experiment, recipe, plans), encoding="utf-8")
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], default=str))
        return 0
    for plan in plans:
        print(f"## {plan.run_key}: {render.wall_summary(plan)}\n")
        print(render.plan_table(plan))
        print()
    return 0
