"""The experiments sensor: experiment files edited in git reach Dagster without a restart.

Every ``MIN_INTERVAL_S`` seconds it reads ``settings.experiments_dir``. For a new or edited file
(by content hash) it adds the experiment to the ``experiments`` partitions and every sweep point
to the ``runs`` partitions, and requests one ``plan_runs`` run per point with the stable run key
``<run_key>@<file hash>`` (an unchanged file never re-requests; an edited one plans again). For a
file with a ``schedule`` it requests the runs again at each cron tick (``<run_key>@<tick>``).
The cursor (JSON) keeps each file's hash and last tick. A bad file is reported in the tick's
log and skipped; the others still go through.
"""

import json
from datetime import UTC, datetime

import dagster as dg

from factory.experiments import (
    Experiment,
    ExperimentError,
    experiment_files,
    experiment_sha,
    last_cron_tick,
    load_experiment,
    run_keys,
)
from factory.settings import get_settings

MIN_INTERVAL_S = 15
"""Seconds between evaluations: an edited sweep is planned well under a minute later."""

plan_runs_job = dg.define_asset_job(
    "plan_runs", selection=dg.AssetSelection.assets("training_plan"),
    description="Plan one experiment run (a sweep point) from its dataset profile.")


def _requests(experiment: Experiment, tag: str, reason: str) -> list[dg.RunRequest]:
    return [dg.RunRequest(run_key=f"{key}@{tag}", partition_key=key, job_name="plan_runs",
                          tags={"factory/experiment": experiment.name, "factory/reason": reason})
            for key in run_keys(experiment)]


def evaluate(cursor: str | None, now: datetime) -> tuple[list[dg.RunRequest], list[str],
                                                         list[str], str, list[str]]:
    """(run requests, experiment keys, run keys to add, new cursor, errors) at ``now``."""
    state = json.loads(cursor) if cursor else {}
    files: dict[str, str] = dict(state.get("files", {}))
    ticks: dict[str, str] = dict(state.get("ticks", {}))
    requests: list[dg.RunRequest] = []
    new_experiments: list[str] = []
    new_runs: list[str] = []
    errors: list[str] = []
    seen: set[str] = set()
    for path in experiment_files(get_settings().experiments_dir):
        try:
            experiment = load_experiment(path)
        except ExperimentError as exc:
            errors.append(str(exc))
            continue
        seen.add(experiment.name)
        sha = experiment_sha(experiment)
        if files.get(experiment.name) != sha:
            files[experiment.name] = sha
            new_experiments.append(experiment.name)
            new_runs.extend(run_keys(experiment))
            requests.extend(_requests(experiment, sha[:12], "file changed"))
        if experiment.schedule:
            tick = last_cron_tick(experiment.schedule, now)
            previous = ticks.get(experiment.name)
            if tick is not None and previous is not None and tick.isoformat() > previous:
                requests.extend(_requests(experiment, tick.strftime("%Y%m%dT%H%M"),
                                          f"schedule {experiment.schedule}"))
            if tick is not None:  # the first sighting records the tick without firing
                ticks[experiment.name] = max(tick.isoformat(), previous or "")
        else:
            ticks.pop(experiment.name, None)
    files = {k: v for k, v in files.items() if k in seen}
    ticks = {k: v for k, v in ticks.items() if k in seen}
    new_cursor = json.dumps({"files": files, "ticks": ticks}, sort_keys=True)
    return requests, new_experiments, new_runs, new_cursor, errors


@dg.sensor(job=plan_runs_job, minimum_interval_seconds=MIN_INTERVAL_S,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Picks up new and edited experiment files (and their schedules) and "
                       "plans each sweep point.")
def experiments_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    requests, experiments, runs, cursor, errors = evaluate(context.cursor, datetime.now(UTC))
    for error in errors:
        context.log.warning(f"experiment file skipped: {error}")
    partitions: list[dg.AddDynamicPartitionsRequest] = []
    if experiments:
        partitions.append(dg.AddDynamicPartitionsRequest(partitions_def_name="experiments",
                                                         partition_keys=experiments))
    if runs:
        partitions.append(dg.AddDynamicPartitionsRequest(partitions_def_name="runs",
                                                         partition_keys=runs))
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=partitions,
                           cursor=cursor,
                           skip_reason=None if requests else "no experiment changed")


SENSORS = [experiments_sensor]
JOBS = [plan_runs_job]
