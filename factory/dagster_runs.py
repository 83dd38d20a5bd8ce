"""Reading runs on the Dagster instance: why a run failed, what an asset recorded in it.

Used by the sensors that chain runs and by the clients that follow them, so a failure reads the
same in the UI's Automation page, in ``factory run``'s output and in a chain's outcome. Also
``read_schema_scripts_once``, which the code location calls as it loads: what every sensor
tick costs the cores a trainer runs on.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import dagster as dg

CHAIN_TAG = "factory/chain"
"""On every run of an experiment's chain: the Dagster run id of its ``start_experiment_job``."""
TRAINER_RUN_TAG = "factory/trainer-run"
"""Set by ``training_run`` on its own Dagster run: the trainer run id it submitted."""

ROLLOVER_SENSOR = "rollover_sensor"
RECOVERY_SENSOR = "recovery_sensor"
CONTROL_SENSORS = (ROLLOVER_SENSOR, RECOVERY_SENSOR)
"""The sensors that tick the training control plane (``sensors/training.py``)."""
SENSOR_PASS_S = 5
"""Seconds between the passes Dagster's sensor daemon makes over the sensors
(``dagster._daemon.sensor.MIN_INTERVAL_LOOP_TIME``): a sensor ticks on a pass only once its
least interval has passed since its last tick started."""


def every_passes(passes: int) -> int:
    """The least interval that makes a sensor tick on every ``passes``-th pass: a second under
    ``passes`` passes, so that a pass starting a moment early does not skip it (at exactly 5 s,
    ``chain_sensor`` ticked 9 s apart, median)."""
    return passes * SENSOR_PASS_S - 1


SENSOR_STALE_S = 60.0
"""A sensor whose latest tick started longer ago than this is not being evaluated (the control
sensors tick every 15 s)."""

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


def sensors_ticking(instance: dg.DagsterInstance, names: tuple[str, ...] = CONTROL_SENSORS, *,
                    now: float | None = None) -> bool:
    """Whether a daemon evaluates every sensor in ``names`` for ``instance``: each is not
    stopped and its latest tick started less than ``SENSOR_STALE_S`` ago and did not fail."""
    now = time.time() if now is None else now
    # Compared by value: Dagster exports none of these enums publicly.
    states = {s.name: s for s in instance.all_instigator_state()
              if s.name in names and s.instigator_type.value == "SENSOR"}
    for name in names:
        state = states.get(name)
        if state is None or state.status.value == "STOPPED":
            return False
        ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)
        if not ticks or ticks[0].status.value == "FAILURE" \
                or now - ticks[0].timestamp > SENSOR_STALE_S:
            return False
    return True


_SCRIPTS: dict[str, Any] = {}
_SCRIPTS_LOCK = threading.Lock()


def read_schema_scripts_once() -> bool:
    """Make Dagster's storages read their schema's migration scripts once per process.

    An instance made from its ref (every sensor tick of a sensor with resources: ~36 a minute
    in the code server, more in run workers) checks each SQLite storage's alembic revision
    against the head of Dagster's migration scripts, and alembic reads and compiles every
    script to find that head: ~70 of the ~85 ms of CPU an instance took on the AVX2 host, on
    the cores the trainer runs on. The scripts of the installed Dagster do not change while a
    process runs; after this call their directory is read once per location and kept (a
    revision check still reads the database's own revision every time). False, changing
    nothing, where Dagster's storage module no longer looks up ``ScriptDirectory`` as this
    expects."""
    from dagster._core.storage import sql

    script_directory = getattr(sql, "ScriptDirectory", None)
    if script_directory is None or not hasattr(script_directory, "from_config"):
        return False
    if getattr(script_directory, "read_once", False):
        return True
    read = script_directory.from_config

    class ScriptsReadOnce:
        read_once = True

        @staticmethod
        def from_config(config: Any) -> Any:
            key = str(config.get_main_option("script_location"))
            with _SCRIPTS_LOCK:
                if key not in _SCRIPTS:
                    _SCRIPTS[key] = read(config)
                return _SCRIPTS[key]

    sql.ScriptDirectory = ScriptsReadOnce  # type: ignore[misc,assignment]
    return True
