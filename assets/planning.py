"""``training_plan``: one plan per experiment run (sweep point), every value with its reason.

Partitioned by the dynamic partitions ``runs``, whose keys are the stable run keys of
``factory.experiments.run_key`` (``<experiment>`` or ``<experiment>/k=v/...``); the experiments
sensor and ``factory sweep`` add them. The asset reads the experiment's newest
``dataset_profile`` row, plans the run (with this host's calibrated time model under
``FACTORY_TIME_MODEL=host``: ``factory.planner.host``), refuses a plan that cannot run (the run
fails with a message saying what to change, before any compute is asked for) and appends the plan to
``training_plans``. Metadata: the value + reason table, the experiment card and the trainer
config.
"""

import json

import dagster as dg

from factory.errors import FactoryError
from factory.experiments import load_experiment
from factory.partitions import RUNS
from factory.planner.host import time_model_cache
from factory.planner.profile import read_profile
from factory.planner.render import experiment_card, plan_table
from factory.planner.service import mix_rows, plan_for_key, plan_row, profile_version
from factory.recipes import load_recipe
from factory.resources.lake import LakeResource


@dg.asset(
    partitions_def=RUNS,
    # Each run reads its own experiment's profile row; Dagster has no mapping from run keys to
    # experiment keys, so the edge is declared over all profile partitions (lineage only).
    deps=[dg.AssetDep("dataset_profile", partition_mapping=dg.AllPartitionMapping())],
    group_name="training",
    kinds={"python", "iceberg"},
    description="The training plan of one experiment run (sweep point): sequence length, "
                "packing, batch, learning rate, steps, cadences, parallelism, frozen modules, "
                "eval serving size, each with the rule that chose it; estimated peak memory checked "
                "against the hardware. Table training_plans.",
    code_version="1",
)
def training_plan(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    key = context.partition_key
    experiment = load_experiment(key.split("/", 1)[0])
    session = lake.session(context)
    try:
        profile = read_profile(session, experiment.name)
        plan = plan_for_key(experiment, profile, key,
                            source_rows=mix_rows(experiment, session.lake),
                            time_cache=time_model_cache())
    except (FactoryError, ValueError) as exc:
        # A refused plan is the user's to fix: show the message, not a traceback.
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    session.append("training_plans",
                   [plan_row(plan, experiment, profile_version(session, experiment.name))])
    card = experiment_card(experiment, load_recipe(experiment.recipe), [plan])
    return dg.MaterializeResult(metadata={
        "plan": dg.MetadataValue.md(plan_table(plan)),
        "card": dg.MetadataValue.md(card),
        "train_config": dg.MetadataValue.json(plan.train_config()),
        "eval_serving": dg.MetadataValue.json(plan.eval_serving()),
        "peak_memory_gib": plan.memory.as_gib()["total"] if plan.memory else 0.0,
        "estimated_hours": plan.estimates.get("hours", 0.0),
        "overridden": dg.MetadataValue.json(
            sorted(k for k, d in plan.decisions.items() if d.overridden)),
        "point": dg.MetadataValue.json(json.loads(json.dumps(plan.point, default=str))),
        **session.metadata(),
    })
