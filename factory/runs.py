"""Reading runs on the Dagster instance: why a run failed, what an asset recorded in it.

Used by the sensors that chain runs and by the clients that follow them, so a failure reads the
same in the UI's Automation page, in ``factory run``'s output and in a chain's outcome.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

CHAIN_TAG = "factory/chain"
"""On every run of an experiment's chain: the Dagster run id of its ``start_experiment_job``."""
TRAINER_RUN_TAG = "factory/trainer-run"
"""Set by ``training_run`` on its own Dagster run: the trainer run id it submitted."""

FINISHED = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE,
            dg.DagsterRunStatus.CANCELED)
FAILED = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


def failure_message(instance: dg.DagsterInstance, run_id: str) -> str:
    """The first step failure's message of a run (what the asset raised), or its status."""
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        error: Any = getattr(entry.dagster_event, "event_specific_data", None)
        error = getattr(error, "error", None)
        while getattr(error, "cause", None) is not None:
            error = error.cause
        if error is not None:
            text = str(getattr(error, "message", error)).strip()
            return text.removeprefix("dagster._core.definitions.events.Failure: ").splitlines()[0]
    run = instance.get_run_by_id(run_id)
    return f"run {run_id} ended {run.status.value if run else 'unknown'}"


def materialized(instance: dg.DagsterInstance, run_id: str, asset: str) -> dict[str, Any]:
    """The metadata values of ``asset``'s materialization in run ``run_id`` ({} if none)."""
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION):
        mat = entry.asset_materialization
        if mat is not None and mat.asset_key == dg.AssetKey(asset):
            return {k: v.value for k, v in mat.metadata.items()}
    return {}
