"""Training sensors: checkpoint -> evals, rollover, recovery, new traffic -> dataset.

``rollover_sensor`` and ``recovery_sensor`` act through the control loop
(``factory.control.plane.ControlPlane``: the same functions the tests drive), which is
idempotent over the lake: a continuation or recovery is recorded as a segment before any later
tick looks again, so a re-evaluated tick launches nothing twice. Their cursors hold the last
report that did something; ``rollover_sensor``, which places queued runs, looks every daemon
pass and acts as soon as a run is submitted or a trainer exits (``_control_sensor``'s
``prompt``), ``recovery_sensor`` every third. ``checkpoint_sensor`` (every pass; it syncs the
events of a trainer that exited) turns each new verified row of ``checkpoints`` into a
``checkpoints`` materialization and a run of ``checkpoint_evals`` for partition
``<run_id>:<step>`` (a checkpoint already scored in ``eval_scores``, e.g. seen again by a fresh
Dagster instance over an existing lake, is not evaluated again); ``traffic_sensor``
re-materializes an experiment's dataset once ``data.min_new_samples`` new samples match its
selection since its last profile (an experiment never built is left to its first chain) or, if the file says ``retrain_on_new_samples``, starts the experiment's chain
(``start_experiment_job``: dataset, then ``chain_sensor`` trains, evaluates and deploys).
"""

import json
import time
from datetime import datetime
from typing import Any

import dagster as dg

from factory.control import CHECKPOINT_PARTITIONS, checkpoint_partition_key
from factory.dagster_runs import RECOVERY_SENSOR, ROLLOVER_SENSOR, every_passes
from factory.experiments import list_experiments
from factory.lake import Lake
from factory.resources.lake import LakeResource
from factory.resources.providers import ProviderResource
from factory.sensors.chains import EVAL_TAG, start_experiment_job

CHECKPOINT_EVALS = dg.AssetKey("checkpoint_evals")
CHECKPOINTS = dg.AssetKey("checkpoints")
DATASET_ASSETS = [dg.AssetKey("synthetic_samples"), dg.AssetKey("dataset"),
                  dg.AssetKey("dataset_profile")]


def _ts(value: datetime) -> str:
    return value.isoformat()


@dg.sensor(name="checkpoint_sensor", asset_selection=[CHECKPOINT_EVALS],
           minimum_interval_seconds=every_passes(1), default_status=dg.DefaultSensorStatus.RUNNING,
           description="Each new verified checkpoint requests checkpoint_evals for it, unless "
                       "it is already scored.")
def checkpoint_sensor(context: dg.SensorEvaluationContext, lake: LakeResource,
                      provider: ProviderResource):
    # A trainer that exited wrote its last checkpoint event: synced here, it is evaluated this
    # pass, not after the control sensor's next one (which may come later in the same pass).
    plane = provider.plane(lake.lake())
    if plane.exited():
        plane.sync_events()
    return _request_checkpoint_evals(context, plane.lake)


def _request_checkpoint_evals(context: dg.SensorEvaluationContext,
                              lake: Lake) -> dg.SkipReason | dg.SensorResult:
    cursor: dict[str, Any] = json.loads(context.cursor) if context.cursor else {"t": "",
                                                                                 "keys": []}
    if not lake.exists("checkpoints"):
        return dg.SkipReason("no checkpoints yet")
    # Every daemon pass: the table is read only when a commit changed it since the last look.
    snapshot = lake.snapshot_id("checkpoints")
    if snapshot is not None and cursor.get("snapshot") == snapshot:
        return dg.SkipReason("no new verified checkpoints")
    rows = [r for r in lake.read("checkpoints", snapshot_id=snapshot).to_pylist()
            if r["verified"]]
    fresh = [r for r in rows if _ts(r["received_at"]) > cursor["t"] or (
        _ts(r["received_at"]) == cursor["t"]
        and checkpoint_partition_key(r["run_id"], r["step"]) not in cursor["keys"])]
    scored: set[tuple[str, int]] = set()
    if fresh and lake.exists("eval_scores"):
        scored = {(r["run_id"], int(r["step"])) for r in lake.sql(
            "SELECT DISTINCT run_id, step FROM eval_scores WHERE kind = 'checkpoint'"
        ).to_pylist()}
    if not fresh:
        return dg.SensorResult(cursor=json.dumps({**cursor, "snapshot": snapshot}),
                               skip_reason="no new verified checkpoints")
    fresh.sort(key=lambda r: (r["received_at"], r["run_id"], r["step"]))
    keys = sorted({checkpoint_partition_key(r["run_id"], r["step"]) for r in fresh})
    context.instance.add_dynamic_partitions(CHECKPOINT_PARTITIONS, keys)
    requests = []
    done: set[str] = set()
    for r in fresh:
        key = checkpoint_partition_key(r["run_id"], r["step"])
        if key in done:
            continue
        done.add(key)
        context.instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key=CHECKPOINTS, partition=key,
            metadata={"path": r["path"], "manifest_sha256": r["manifest_sha256"],
                      "experiment": r["experiment"] or "", "step": int(r["step"])}))
        if (r["run_id"], int(r["step"])) in scored:
            continue
        # The manifest hash in the key: the same bytes are never evaluated twice, even when the
        # scores of a first evaluation have not landed yet.
        requests.append(dg.RunRequest(run_key=f"{key}@{r['manifest_sha256'][:16]}",
                                      partition_key=key, asset_selection=[CHECKPOINT_EVALS],
                                      tags={"factory/run-id": r["run_id"],
                                            "factory/step": str(r["step"]), EVAL_TAG: "1"}))
    if not requests:
        return dg.SensorResult(cursor=_cursor_after(fresh, rows, snapshot),
                               skip_reason="new checkpoints are already scored")
    return dg.SensorResult(run_requests=requests, cursor=_cursor_after(fresh, rows, snapshot))


def _cursor_after(fresh: list[dict[str, Any]], rows: list[dict[str, Any]],
                  snapshot: int | None) -> str:
    last = fresh[-1]["received_at"]
    at_last = [checkpoint_partition_key(r["run_id"], r["step"]) for r in rows
               if r["received_at"] == last]
    return json.dumps({"t": _ts(last), "keys": sorted(at_last), "snapshot": snapshot})


FULL_PASS_S = every_passes(3)
"""Seconds between a control sensor's full passes when nothing changed (a ``prompt`` one)."""


def _control_sensor(name: str, steps: tuple[str, ...], description: str, *,
                    prompt: bool = False) -> Any:
    """A sensor ticking the control loop's ``steps`` after syncing events and observing.

    ``prompt``: it is evaluated every daemon pass, and makes its full pass when the plane's
    ``pulse`` changed since its last (a run submitted, a trainer exited) or ``FULL_PASS_S``
    went by; other passes skip after reading two snapshot ids and the live trainers' states.
    A queued run then starts within a pass, and a finished trainer's last checkpoint reaches
    the lake within one, where a 15-s sensor waited 7 s on average for each. Without it, a full
    pass every ``FULL_PASS_S``."""

    @dg.sensor(name=name, minimum_interval_seconds=every_passes(1) if prompt else FULL_PASS_S,
               default_status=dg.DefaultSensorStatus.RUNNING, description=description)
    def control(context: dg.SensorEvaluationContext, lake: LakeResource,
                provider: ProviderResource):
        plane = provider.plane(lake.lake())
        state: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
        now = time.time()
        if prompt and state.get("pulse") == plane.pulse() \
                and now - float(state.get("full_at", 0.0)) < FULL_PASS_S:
            return dg.SkipReason(f"{name}: nothing changed")
        plane.sync_events()
        plane.observe()
        report: dict[str, list[str]] = {}
        for step in steps:
            done = getattr(plane, step)()
            report[step] = [x if isinstance(x, str) else
                            str(getattr(x, "segment_id", None) or getattr(x, "job_id", ""))
                            for x in done if getattr(x, "provider", True)]
        acted = any(report.values())
        if not prompt:
            return dg.SensorResult(cursor=json.dumps(report, sort_keys=True)) if acted \
                else dg.SkipReason(f"{name}: nothing to do")
        # The last report that did something stays in the cursor beside the pulse.
        last = report if acted else {k: state.get(k, []) for k in steps}
        cursor = json.dumps({**last, "pulse": plane.pulse(), "full_at": now}, sort_keys=True)
        return dg.SensorResult(cursor=cursor) if acted \
            else dg.SensorResult(cursor=cursor, skip_reason=f"{name}: nothing to do")

    return control


rollover_sensor = _control_sensor(
    ROLLOVER_SENSOR, ("dispatch", "rollover"),
    "Places queued runs on the provider ladder; gives a sandbox near its deadline a "
    "continuation from the latest verified checkpoint and stops it once that one started.",
    prompt=True)
recovery_sensor = _control_sensor(
    RECOVERY_SENSOR, ("early_stop", "recover"),
    "Resumes failed, NaN or silent training segments from the last good checkpoint, with "
    "bounded retries, backoff and an optional learning-rate backoff; stops runs the evals "
    "flagged for early stopping.")


refresh_dataset_job = dg.define_asset_job(
    "refresh_dataset_job", selection=dg.AssetSelection.assets(*DATASET_ASSETS),
    description="Rebuilds an experiment's synthetic samples (with data.synthesize), dataset and "
                "profile from the samples as they are now.")


@dg.sensor(name="traffic_sensor", jobs=[start_experiment_job, refresh_dataset_job],
           minimum_interval_seconds=300, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Re-materializes an experiment's dataset once data.min_new_samples new "
                       "samples match its selection; with retrain_on_new_samples, starts the "
                       "experiment's chain instead (dataset to deployment).")
def traffic_sensor(context: dg.SensorEvaluationContext, lake: LakeResource):
    return _request_datasets(context, lake.lake())


def _request_datasets(context: dg.SensorEvaluationContext,
                      lake: Lake) -> dg.SkipReason | dg.SensorResult:
    cursor: dict[str, dict[str, int]] = json.loads(context.cursor) if context.cursor else {}
    seen = cursor.setdefault("seen", {})
    if not lake.exists("samples"):
        return dg.SkipReason("no samples yet")
    profiles: dict[str, int] = {}
    if lake.exists("dataset_profile"):
        for r in lake.sql("SELECT experiment, num_selected FROM dataset_profile "
                          "QUALIFY row_number() OVER (PARTITION BY experiment "
                          "ORDER BY created_at DESC) = 1").to_pylist():
            profiles[r["experiment"]] = int(r["num_selected"] or 0)
    requests = []
    for exp in list_experiments():
        # data.where is the experiment file's own SQL predicate (validated with the file).
        if exp.name not in profiles:
            continue  # never built: its first dataset is its chain's (experiments_sensor)
        count = int(lake.sql(f"SELECT count(*) AS n FROM samples WHERE {exp.data.where}")
                    .column("n")[0].as_py())
        base = max(profiles.get(exp.name, 0), seen.get(exp.name, 0))
        if count - base < exp.data.min_new_samples:
            continue
        seen[exp.name] = count
        context.instance.add_dynamic_partitions("experiments", [exp.name])
        tags = {"factory/trigger": "new-samples", "factory/experiment": exp.name,
                "factory/reason": f"{count - base} new samples (data.min_new_samples "
                                  f"{exp.data.min_new_samples})"}
        if exp.retrain_on_new_samples:
            requests.append(dg.RunRequest(run_key=f"retrain:{exp.name}:{count}",
                                          partition_key=exp.name,
                                          job_name=start_experiment_job.name, tags=tags))
        else:
            requests.append(dg.RunRequest(run_key=f"dataset:{exp.name}:{count}",
                                          partition_key=exp.name,
                                          job_name=refresh_dataset_job.name, tags=tags))
    if not requests:
        return dg.SkipReason("not enough new samples for any experiment")
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(cursor, sort_keys=True))


SENSORS = [checkpoint_sensor, rollover_sensor, recovery_sensor, traffic_sensor]
JOBS: list[Any] = [refresh_dataset_job]
