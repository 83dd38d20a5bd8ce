"""The loop under Dagster's daemon: an experiment's chain from its dataset to a live endpoint.

A chain starts with a successful run of ``start_experiment_job`` (``synthetic_samples``,
``dataset``, ``dataset_profile``, ``rubric`` for one experiment): a click on the job in the UI, the
experiments sensor (a new or edited file, a schedule tick), the traffic sensor (new samples with
``retrain_on_new_samples``) or ``factory run``. Its Dagster run id is the chain's id, carried by
every later run as the tag ``factory/chain``. ``chain_sensor`` then moves each chain forward, one
step per tick, each request with a stable run key (a tick evaluated twice launches nothing
twice) and a ``factory/reason`` tag saying why:

1. ``train_run_job`` (``training_plan`` + ``training_run``) for every sweep point, as the
   experiment file says when the chain starts (a file edited since its start supersedes the
   chain: the experiments sensor starts a new one). The plan reads the profile the start run
   wrote, so no plan is requested before its profile exists.
2. ``select_checkpoint_job`` (``final_evals``, then ``best_checkpoint``, in one run) once every
   training run of the chain succeeded and each of their verified checkpoints is scored in
   ``eval_scores`` or its ``checkpoint_evals`` run ended (the ``checkpoint_sensor`` requests
   those while the runs train): the leading checkpoints are judged on the whole eval set where
   the plans judged a subset, then the best is chosen. Its run carries the evals' queue tag,
   since its final evals boot an inference server too. A failed training run stops the chain:
   nothing of it is selected or deployed.
3. ``deploy_model_job`` (``deployment``) once the best checkpoint is selected, when the
   experiment's ``deploy`` policy is ``auto``.

What a tick decided per chain is the sensor's skip reason or its run requests' tags, so the
UI's Automation page shows why each run was requested and what each chain waits for.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from factory.dagster_runs import (
    CHAIN_TAG,
    FAILED,
    FINISHED,
    TRAINER_RUN_TAG,
    every_passes,
    failure_message,
)
from factory.evals.progress import unscored_checkpoints
from factory.experiments import ExperimentError, experiment_sha, load_experiment, run_keys
from factory.resources.lake import LakeResource

REASON_TAG = "factory/reason"
SHA_TAG = "factory/experiment-sha"
DEPLOY_TAG = "factory/deploy"
EVAL_TAG = "factory/eval"
"""The tag the instance's run queue runs one at a time (``factory.app.instance``): the
checkpoint evals' (``checkpoint_sensor``) and the selection's, each booting an inference server."""
PARTITION_TAG = "dagster/partition"
MIN_INTERVAL_S = every_passes(1)
"""Least seconds between ticks: every pass of the sensor daemon ticks it, so each step of a
chain waits at most ~5 s for the next."""
MAX_DONE = 500
"""Ended chains remembered in the cursor (older ones are no longer looked at)."""

start_experiment_job = dg.define_asset_job(
    "start_experiment_job", selection=dg.AssetSelection.assets(
        "synthetic_samples", "dataset", "dataset_profile", "rubric"),
    description="Runs an experiment to a live endpoint: builds its synthetic samples (with "
                "data.synthesize), dataset, profile and rubric; "
                "then chain_sensor trains every sweep point, checkpoint_sensor evaluates each "
                "checkpoint as it lands, and the best checkpoint is selected and deployed per "
                "the experiment's deploy policy.")
train_run_job = dg.define_asset_job(
    "train_run_job", selection=dg.AssetSelection.assets("training_plan", "training_run"),
    tags={"factory/kind": "training"},
    description="Plans one run of an experiment (a sweep point) from its dataset profile and "
                "trains it to the end.")
select_checkpoint_job = dg.define_asset_job(
    "select_checkpoint_job",
    selection=dg.AssetSelection.assets("final_evals", "best_checkpoint"),
    description="Judges the leading checkpoints on the whole eval set (where mid-training evals "
                "judged a subset), then picks the experiment's best checkpoint by task score.")
deploy_model_job = dg.define_asset_job(
    "deploy_model_job", selection=dg.AssetSelection.assets("deployment"),
    description="Serves the experiment's best checkpoint behind factory/<experiment>.")


@dataclass
class Step:
    """What one tick decided for one chain."""

    requests: list[dg.RunRequest] = field(default_factory=list)
    partitions: list[str] = field(default_factory=list)
    """``runs`` partition keys to add before the requests."""
    waiting: str | None = None
    """Why nothing is requested yet (the chain stays active)."""
    ended: str | None = None
    """The chain's outcome, when this tick ends it."""


def _newest_by_partition(runs: Iterable[dg.DagsterRun]) -> dict[str, dg.DagsterRun]:
    out: dict[str, dg.DagsterRun] = {}
    for run in runs:  # newest first
        out.setdefault(run.tags.get(PARTITION_TAG, ""), run)
    return out


class ChainView:
    """Reads a chain's state from the Dagster instance and the lake."""

    def __init__(self, instance: dg.DagsterInstance, lake: Any) -> None:
        self.instance = instance
        self.lake = lake

    def runs(self, job: str, chain: str) -> list[dg.DagsterRun]:
        return list(self.instance.get_runs(
            filters=dg.RunsFilter(job_name=job, tags={CHAIN_TAG: chain})))

    def unscored(self, trainer_runs: list[str]) -> tuple[list[str], int]:
        """(checkpoint keys of these runs whose evaluation has not ended, number scored)."""
        return unscored_checkpoints(self.instance, self.lake, trainer_runs)


def advance(view: ChainView, chain: str, info: dict[str, Any]) -> Step:
    """The next step of chain ``chain`` (``info``: experiment, keys, deploy policy)."""
    exp, keys = info["experiment"], info["keys"]
    tags = {CHAIN_TAG: chain, "factory/experiment": exp}
    # 1. training: one run per sweep point
    trains = _newest_by_partition(view.runs(train_run_job.name, chain))
    missing = [k for k in keys if k not in trains]
    if missing:
        return Step(partitions=missing, waiting=f"training {len(missing)} run(s) requested",
                    requests=[dg.RunRequest(
                        run_key=f"train:{chain}:{k}", job_name=train_run_job.name,
                        partition_key=k,
                        tags={**tags, REASON_TAG: "the experiment's dataset is profiled"})
                        for k in missing])
    failed = [(k, r) for k, r in trains.items() if r.status in FAILED]
    if failed:
        k, r = failed[0]
        return Step(ended=f"training of {k} failed: {failure_message(view.instance, r.run_id)}")
    running = [k for k, r in trains.items() if r.status not in FINISHED]
    if running:
        return Step(waiting=f"training {', '.join(running)}")
    # 2. every checkpoint of the finished runs scored (or its evaluation ended)
    trainer_runs = [trains[k].tags.get(TRAINER_RUN_TAG, "") for k in keys]
    pending, num_scored = view.unscored([r for r in trainer_runs if r])
    if pending:
        return Step(waiting=f"{len(pending)} checkpoint(s) not scored yet: {', '.join(pending)}")
    if num_scored == 0:
        return Step(ended="no checkpoint of the chain's runs was scored: nothing to select")
    runs = {"config": {"runs": sorted(r for r in trainer_runs if r)}}
    step = _once(view, chain, dg.RunRequest(
        run_key=f"select:{chain}", job_name=select_checkpoint_job.name, partition_key=exp,
        run_config={"ops": {"final_evals": runs, "best_checkpoint": runs}},
        tags={**tags, EVAL_TAG: "1", REASON_TAG: f"every checkpoint of {len(keys)} finished "
                                                 f"run(s) is scored ({num_scored})"}),
        doing="judging the leading checkpoints on the whole eval set, then selecting the best",
        what="the selection (final_evals, best_checkpoint)")
    if step is not None:
        return step
    # 3. deployment, per the experiment's policy
    if info["deploy"] not in ("auto", "shadow"):
        return Step(ended="best checkpoint selected; deploy: manual (materialize deployment "
                          "to promote it)")
    # deploy: shadow serves it as a candidate beside the shadowed route (the deployment asset
    # reads the policy); shadow_scores promotes it once it agrees often enough.
    step = _once(view, chain, dg.RunRequest(
        run_key=f"deploy:{chain}", job_name=deploy_model_job.name, partition_key=exp,
        tags={**tags, REASON_TAG: f"deploy: {info['deploy']} and the best checkpoint is "
                                  "selected"}),
        doing="deploying", what="deployment")
    if step is not None:
        return step
    return Step(ended="deployed as a candidate, shadowing live traffic"
                if info["deploy"] == "shadow" else "deployed")


def _once(view: ChainView, chain: str, request: dg.RunRequest, *, doing: str,
          what: str) -> Step | None:
    """The step of a job a chain runs once (``request``): request it, wait for it, or end the
    chain when it failed; None once it succeeded."""
    runs = view.runs(str(request.job_name), chain)
    if not runs:
        return Step(requests=[request], waiting=doing)
    if runs[0].status in FAILED:
        return Step(ended=f"{what} failed: {failure_message(view.instance, runs[0].run_id)}")
    if runs[0].status not in FINISHED:
        return Step(waiting=doing)
    return None


def chain_info(start: dg.DagsterRun) -> dict[str, Any] | str:
    """What a chain trains (from the experiment file as it is when the chain starts), or why
    it cannot go on."""
    name = start.tags.get(PARTITION_TAG, "")
    try:
        experiment = load_experiment(name)
    except ExperimentError as exc:
        return f"experiment {name!r} cannot be loaded: {exc}"
    wanted = start.tags.get(SHA_TAG)
    if wanted and wanted != experiment_sha(experiment):
        return "superseded: the experiment file changed after the chain started"
    # A start run may narrow the policy (``factory run --no-deploy``), never widen it.
    deploy = "manual" if start.tags.get(DEPLOY_TAG) == "manual" else experiment.deploy
    return {"experiment": experiment.name, "keys": run_keys(experiment), "deploy": deploy}


def evaluate(instance: dg.DagsterInstance, lake: Any, cursor: str | None
             ) -> tuple[list[dg.RunRequest], list[str], dict[str, str], str]:
    """(run requests, run partition keys to add, chain -> what it waits for or how it ended,
    new cursor)."""
    state = json.loads(cursor) if cursor else {}
    active: dict[str, dict[str, Any]] = state.get("active", {})
    done: dict[str, str] = state.get("done", {})
    starts = instance.get_runs(filters=dg.RunsFilter(job_name=start_experiment_job.name,
                                                     statuses=[dg.DagsterRunStatus.SUCCESS]),
                               limit=50)
    for start in reversed(list(starts)):
        if start.run_id not in done and start.run_id not in active:
            info = chain_info(start)
            if isinstance(info, str):
                done[start.run_id] = info
            else:
                active[start.run_id] = info
    view = ChainView(instance, lake)
    requests: list[dg.RunRequest] = []
    partitions: list[str] = []
    report: dict[str, str] = {}
    for chain, info in list(active.items()):
        step = advance(view, chain, info)
        requests += step.requests
        partitions += step.partitions
        label = f"{info['experiment']} ({chain[:8]})"
        if step.ended is not None:
            done[chain] = step.ended
            del active[chain]
            report[label] = step.ended
        else:
            report[label] = step.waiting or "waiting"
    done = dict(list(done.items())[-MAX_DONE:])
    new_cursor = json.dumps({"active": active, "done": done}, sort_keys=True)
    return requests, sorted(set(partitions)), report, new_cursor


@dg.sensor(name="chain_sensor", minimum_interval_seconds=MIN_INTERVAL_S,
           jobs=[train_run_job, select_checkpoint_job, deploy_model_job],
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Moves each experiment chain forward: trains every sweep point once the "
                       "dataset is profiled, judges the leading checkpoints on the whole eval "
                       "set and selects the best once every checkpoint of the finished runs is "
                       "scored, deploys it when the experiment's deploy policy is auto. A "
                       "failed training run stops its chain.")
def chain_sensor(context: dg.SensorEvaluationContext, lake: LakeResource) -> dg.SensorResult:
    requests, partitions, report, cursor = evaluate(context.instance, lake.lake(),
                                                    context.cursor)
    for chain, what in report.items():
        context.log.info(f"{chain}: {what}")
    adds = [dg.AddDynamicPartitionsRequest(partitions_def_name="runs",
                                           partition_keys=partitions)] if partitions else []
    skip = None
    if not requests:
        skip = "; ".join(f"{k}: {v}" for k, v in report.items()) or "no experiment chain is active"
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=adds,
                           cursor=cursor, skip_reason=skip)


SENSORS = [chain_sensor]
JOBS = [start_experiment_job, train_run_job, select_checkpoint_job, deploy_model_job]
