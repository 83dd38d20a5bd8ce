"""``factory dataset EXPERIMENT``: build the experiment's train/eval sets and profile via Dagster."""

from __future__ import annotations

import argparse
import json
from typing import Any

from factory.app.materialize import instance, materialize
from factory.curation.config import check_experiment_name
from factory.errors import FactoryError
from factory.experiments import CURATION_ENGINES, load_experiment
from factory.lake import Lake


def register(sub: Any) -> None:
    p = sub.add_parser("dataset", help="materialize an experiment's dataset and dataset_profile "
                                       "(the run a click in the UI makes)")
    p.add_argument("experiment", help="experiment name (experiments folder) or YAML path")
    p.add_argument("--engine", choices=CURATION_ENGINES, default=None,
                   help="curation engine: in process or a local Spark session (needs the "
                        "`spark` extra); both give the same datasets (default: the "
                        "experiment's data.engine, itself embedded by default)")
    p.set_defaults(func=_dataset)


def _dataset(args: argparse.Namespace) -> int:
    experiment = load_experiment(args.experiment)
    name = check_experiment_name(experiment.name)
    inst = instance()
    if not inst.has_dynamic_partition("experiments", name):
        inst.add_dynamic_partitions("experiments", [name])
    engine = args.engine or experiment.data.engine
    run_config = {"ops": {"dataset": {"config": {"engine": engine}}}}
    result = materialize(["synthetic_samples", "dataset", "dataset_profile"], partition_key=name,
                         run_config=run_config, raise_on_error=False)
    failed = [e.asset_check_evaluation_data.check_name
              for e in result.all_events
              if e.event_type_value == "ASSET_CHECK_EVALUATION"
              and not e.asset_check_evaluation_data.passed]
    if not result.success:
        errors = [e.event_specific_data.error.message.strip().splitlines()[0]
                  for e in result.all_events if e.event_type_value == "STEP_FAILURE"
                  and getattr(e.event_specific_data, "error", None)]
        why = f"failed checks: {', '.join(failed)}" if failed else "; ".join(errors) or "failed"
        raise FactoryError(f"dataset for {name!r}: {why} (see the run in `factory ui`)")
    lake = Lake()
    flt = f"experiment = '{name}'"
    drops = lake.read("dataset_drops", row_filter=flt, columns=["reason"]).column("reason")
    by_reason: dict[str, int] = {}
    for reason in drops.to_pylist():
        by_reason[reason] = by_reason.get(reason, 0) + 1
    train = lake.read("dataset_train", row_filter=flt, columns=["sample_id", "origin"])
    print(json.dumps({
        "experiment": name,
        "engine": engine,
        "train": train.num_rows,
        "synthetic": train.column("origin").to_pylist().count("synthetic"),
        "eval": lake.read("dataset_eval", row_filter=flt, columns=["sample_id"]).num_rows,
        "drops": dict(sorted(by_reason.items())),
    }))
    return 0
