"""``factory sweep EXPERIMENT``: launch every run of the sweep through Dagster, then compare.

Each sweep point becomes a ``runs`` partition (its stable run key) and is materialized in
process on the persistent instance, the same run a click on ``training_plan`` in the UI makes.
The comparison table shows each run's plan values, final loss and best eval score (once the
training and eval tables have them). ``--compare`` only prints the table.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("sweep", help="launch an experiment's sweep runs and compare them")
    p.add_argument("experiment", help="experiment name (experiments folder) or YAML path")
    p.add_argument("--compare", action="store_true", help="only print the comparison table")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=_sweep)


def _sweep(args: argparse.Namespace) -> int:
    from factory.errors import FactoryError
    from factory.experiments import load_experiment, run_keys
    from factory.lake import Lake
    from factory.planner.render import comparison_table
    from factory.planner.service import sweep_comparison

    experiment = load_experiment(args.experiment)
    keys = run_keys(experiment)
    if not args.compare:
        from factory.runner import instance, materialize

        inst = instance()
        for name, partitions in (("experiments", [experiment.name]), ("runs", keys)):
            missing = [k for k in partitions if not inst.has_dynamic_partition(name, k)]
            if missing:
                inst.add_dynamic_partitions(name, missing)
        failures = []
        for key in keys:
            result = materialize(["training_plan"], partition_key=key, raise_on_error=False,
                                 tags={"factory/experiment": experiment.name})
            if not result.success:
                errors = [_why(e.event_specific_data.error) for e in result.all_events
                          if e.event_type_value == "STEP_FAILURE"
                          and getattr(e.event_specific_data, "error", None)]
                failures.append(f"{key}: {'; '.join(errors) or 'failed'}")
        if failures:
            raise FactoryError("sweep runs failed: " + " | ".join(failures))
    rows = sweep_comparison(Lake(), experiment)
    if args.json:
        print(json.dumps(rows, default=str))
    else:
        print(comparison_table(rows))
    return 0


def _why(error: Any) -> str:
    """The user-facing line of a step failure (a refused plan's message)."""
    while getattr(error, "cause", None) is not None:
        error = error.cause
    text = str(getattr(error, "message", error)).strip()
    return text.removeprefix("dagster._core.definitions.events.Failure: ").splitlines()[0]
