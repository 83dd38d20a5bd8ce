"""The experiments sensor: experiment files edited in git start their chain without a restart.

Every ``MIN_INTERVAL_S`` seconds it reads ``settings.experiments_dir``. For a new or edited file
(by content hash) it adds the experiment to the ``experiments`` partitions and requests
``start_experiment_job`` for it with the stable run key ``<experiment>@<file hash>`` (an
unchanged file never re-requests; an edited one starts a new chain, which ``chain_sensor`` takes
to a deployment). A file whose ``data.where`` matches no sample yet waits (the tick says so)
and starts once samples arrive. A file with a ``schedule`` starts at each cron tick
(``<experiment>@<tick>``) instead, not when it is added or edited. A file whose exact content already started a chain
(``factory run``, or this sensor under an earlier cursor) is recorded without a second one. The cursor (JSON) keeps each started file's hash and
last tick. A broken file is reported with its file and line in the tick's log and skip reason
and skipped; the others go through.
"""

import functools
import json
from collections.abc import Callable
from datetime import UTC, datetime

import dagster as dg

from factory.dagster_runs import every_passes
from factory.experiments import (
    Experiment,
    ExperimentError,
    experiment_files,
    experiment_sha,
    last_cron_tick,
    load_experiment,
)
from factory.lake import Lake
from factory.resources.lake import LakeResource
from factory.sensors.chains import SHA_TAG, start_experiment_job
from factory.settings import get_settings

MIN_INTERVAL_S = every_passes(3)
"""Least seconds between evaluations (15 s, every third pass of the sensor daemon): an edited
file starts its chain well under a minute later."""


def _request(experiment: Experiment, tag: str, reason: str) -> dg.RunRequest:
    return dg.RunRequest(run_key=f"{experiment.name}@{tag}", partition_key=experiment.name,
                         job_name=start_experiment_job.name,
                         tags={"factory/experiment": experiment.name, "factory/reason": reason,
                               SHA_TAG: experiment_sha(experiment)})


def evaluate(cursor: str | None, now: datetime, has_samples: Callable[[Experiment], bool],
             started_elsewhere: Callable[[str], bool] = lambda sha: False,
             ) -> tuple[list[dg.RunRequest], list[str], str, list[str]]:
    """(run requests, experiments to add as partitions, new cursor, problems) at ``now``.

    ``has_samples(experiment)``: whether any sample matches the experiment's selection;
    ``started_elsewhere(sha)``: whether a chain of this exact file was already started (by
    ``factory run``, or by this sensor before a fresh cursor). Problems are broken files
    (file:line: field: what is wrong) and files waiting for samples.
    """
    state = json.loads(cursor) if cursor else {}
    files: dict[str, str] = dict(state.get("files", {}))
    ticks: dict[str, str] = dict(state.get("ticks", {}))
    requests: list[dg.RunRequest] = []
    started: list[str] = []
    problems: list[str] = []
    seen: set[str] = set()
    for path in experiment_files(get_settings().experiments_dir):
        try:
            experiment = load_experiment(path)
        except ExperimentError as exc:
            problems.append(f"skipped {exc}")
            continue
        seen.add(experiment.name)
        sha = experiment_sha(experiment)
        if files.get(experiment.name) != sha and started_elsewhere(sha):
            files[experiment.name] = sha
        if files.get(experiment.name) != sha and experiment.schedule:
            # A scheduled file runs on its ticks (a click on start_experiment_job runs it now):
            # a nightly sweep committed at noon waits for the night.
            files[experiment.name] = sha
            problems.append(f"{experiment.name}: scheduled ({experiment.schedule}); starts at "
                            "its next tick")
        if files.get(experiment.name) != sha:
            if not has_samples(experiment):
                problems.append(f"{experiment.name}: waiting for samples matching data.where")
                continue
            files[experiment.name] = sha
            started.append(experiment.name)
            requests.append(_request(experiment, sha[:12], "experiment file added or changed"))
        if experiment.schedule:
            tick = last_cron_tick(experiment.schedule, now)
            previous = ticks.get(experiment.name)
            if tick is not None and previous is not None and tick.isoformat() > previous:
                started.append(experiment.name)
                requests.append(_request(experiment, tick.strftime("%Y%m%dT%H%M"),
                                         f"schedule {experiment.schedule}"))
            if tick is not None:  # the first sighting records the tick without firing
                ticks[experiment.name] = max(tick.isoformat(), previous or "")
        else:
            ticks.pop(experiment.name, None)
    files = {k: v for k, v in files.items() if k in seen}
    ticks = {k: v for k, v in ticks.items() if k in seen}
    new_cursor = json.dumps({"files": files, "ticks": ticks}, sort_keys=True)
    return requests, sorted(set(started)), new_cursor, problems


def _has_samples(lake: Lake, experiment: Experiment) -> bool:
    if not lake.exists("samples"):
        return False
    # data.where is the experiment file's own SQL predicate (validated with the file).
    found = lake.sql(f"SELECT 1 AS one FROM samples WHERE ({experiment.data.where}) LIMIT 1")
    return found.num_rows > 0


@dg.sensor(job=start_experiment_job, minimum_interval_seconds=MIN_INTERVAL_S,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Starts an experiment's chain (dataset to deployment) when its file is "
                       "added or edited, once samples match it, and at each tick of its "
                       "schedule. Broken files are reported with file and line and skipped.")
def experiments_sensor(context: dg.SensorEvaluationContext,
                       lake: LakeResource) -> dg.SensorResult:
    has_samples = functools.partial(_has_samples, lake.lake())

    def started_elsewhere(sha: str) -> bool:
        return bool(context.instance.get_runs(filters=dg.RunsFilter(
            job_name=start_experiment_job.name, tags={SHA_TAG: sha}), limit=1))

    requests, experiments, cursor, problems = evaluate(context.cursor, datetime.now(UTC),
                                                       has_samples, started_elsewhere)
    for problem in problems:
        context.log.warning(problem)
    partitions = [dg.AddDynamicPartitionsRequest(partitions_def_name="experiments",
                                                 partition_keys=experiments)] if experiments else []
    skip = None
    if not requests:
        skip = "; ".join(problems) if problems else "no experiment changed"
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=partitions,
                           cursor=cursor, skip_reason=skip)


SENSORS = [experiments_sensor]
JOBS: list = []
