"""Training sensors: checkpoint -> evals, rollover, recovery, new traffic -> dataset.

``rollover_sensor`` and ``recovery_sensor`` act through the control loop
(``factory.control.loop.ControlPlane``: the same functions the tests drive), which is
idempotent over the lake: a continuation or recovery is recorded as a segment before any later
tick looks again, so a re-evaluated tick launches nothing twice. Their cursors hold the last
tick's report. ``checkpoint_sensor`` turns each new verified row of ``checkpoints`` into a
``checkpoints`` materialization and a run of ``checkpoint_evals`` for partition
``<run_id>:<step>``; ``traffic_sensor`` re-materializes an experiment's dataset once
``data.min_new_samples`` new samples match its selection and, if the file says
``retrain_on_new_samples``, requests ``training_plan`` + ``training_run`` for each of its run keys
once the new dataset is profiled (a later tick; the pending retrain is kept in the cursor).
"""

import json
from datetime import datetime
from typing import Any

import dagster as dg

from factory.control import CHECKPOINT_PARTITIONS, checkpoint_partition_key
from factory.experiments import list_experiments, run_keys
from resources.lake import LakeResource
from resources.providers import ProviderResource

CHECKPOINT_EVALS = dg.AssetKey("checkpoint_evals")
CHECKPOINTS = dg.AssetKey("checkpoints")
DATASET_ASSETS = [dg.AssetKey("dataset"), dg.AssetKey("dataset_profile")]
TRAINING_ASSETS = [dg.AssetKey("training_plan"), dg.AssetKey("training_run")]


def _ts(value: datetime) -> str:
    return value.isoformat()


@dg.sensor(name="checkpoint_sensor", asset_selection=[CHECKPOINT_EVALS],
           minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Each new verified checkpoint requests checkpoint_evals for it.")
def checkpoint_sensor(context: dg.SensorEvaluationContext, lake: LakeResource):
    cursor: dict[str, Any] = json.loads(context.cursor) if context.cursor else {"t": "",
                                                                                 "keys": []}
    rows = [r for r in lake.lake().read("checkpoints").to_pylist() if r["verified"]]
    fresh = [r for r in rows if _ts(r["received_at"]) > cursor["t"] or (
        _ts(r["received_at"]) == cursor["t"]
        and checkpoint_partition_key(r["run_id"], r["step"]) not in cursor["keys"])]
    if not fresh:
        return dg.SkipReason("no new verified checkpoints")
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
        # The manifest hash in the key: a re-written step (a resumed run redoing it) with other
        # bytes is evaluated again, the same bytes never twice.
        requests.append(dg.RunRequest(run_key=f"{key}@{r['manifest_sha256'][:16]}",
                                      partition_key=key, asset_selection=[CHECKPOINT_EVALS],
                                      tags={"factory/run-id": r["run_id"],
                                            "factory/step": str(r["step"])}))
    last = fresh[-1]["received_at"]
    at_last = [checkpoint_partition_key(r["run_id"], r["step"]) for r in rows
               if r["received_at"] == last]
    return dg.SensorResult(run_requests=requests,
                           cursor=json.dumps({"t": _ts(last), "keys": sorted(at_last)}))


def _control_sensor(name: str, steps: tuple[str, ...], description: str) -> Any:
    @dg.sensor(name=name, minimum_interval_seconds=15,
               default_status=dg.DefaultSensorStatus.RUNNING, description=description)
    def control(context: dg.SensorEvaluationContext, lake: LakeResource,
                provider: ProviderResource):
        plane = provider.plane(lake.lake())
        plane.sync_events()
        plane.observe()
        report: dict[str, list[str]] = {}
        for step in steps:
            done = getattr(plane, step)()
            report[step] = [x if isinstance(x, str) else
                            str(getattr(x, "segment_id", None) or getattr(x, "job_id", ""))
                            for x in done if getattr(x, "provider", True)]
        if not any(report.values()):
            return dg.SkipReason(f"{name}: nothing to do")
        return dg.SensorResult(cursor=json.dumps(report, sort_keys=True))

    return control


rollover_sensor = _control_sensor(
    "rollover_sensor", ("dispatch", "rollover"),
    "Places queued runs on the provider ladder; gives a sandbox near its deadline a "
    "continuation from the latest verified checkpoint and stops it once that one started.")
recovery_sensor = _control_sensor(
    "recovery_sensor", ("early_stop", "recover"),
    "Resumes failed, NaN or silent training segments from the last good checkpoint, with "
    "bounded retries, backoff and an optional learning-rate backoff; stops runs the evals "
    "flagged for early stopping.")


@dg.sensor(name="traffic_sensor", asset_selection=DATASET_ASSETS + TRAINING_ASSETS,
           minimum_interval_seconds=300, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Re-materializes an experiment's dataset once data.min_new_samples new "
                       "samples match its selection; with retrain_on_new_samples, plans and "
                       "trains each of its runs once that dataset is profiled.")
def traffic_sensor(context: dg.SensorEvaluationContext, lake: LakeResource):
    the_lake = lake.lake()
    cursor: dict[str, dict[str, int]] = json.loads(context.cursor) if context.cursor else {}
    seen, pending = cursor.setdefault("seen", {}), cursor.setdefault("retrain", {})
    if not the_lake.exists("samples"):
        return dg.SkipReason("no samples yet")
    profiles: dict[str, int] = {}
    if the_lake.exists("dataset_profile"):
        for r in the_lake.sql("SELECT experiment, num_selected FROM dataset_profile "
                              "QUALIFY row_number() OVER (PARTITION BY experiment "
                              "ORDER BY created_at DESC) = 1").to_pylist():
            profiles[r["experiment"]] = int(r["num_selected"] or 0)
    requests = []
    for exp in list_experiments():
        # A retrain waits for the dataset it asked for: the newest profile covers the samples.
        want = pending.get(exp.name)
        if want is not None and profiles.get(exp.name, -1) >= want:
            keys = run_keys(exp)
            context.instance.add_dynamic_partitions("runs", keys)
            requests += [dg.RunRequest(run_key=f"retrain:{key}:{want}", partition_key=key,
                                       asset_selection=TRAINING_ASSETS,
                                       tags={"factory/trigger": "new-samples"})
                         for key in keys]
            del pending[exp.name]
        # data.where is the experiment file's own SQL predicate (validated with the file).
        count = int(the_lake.sql(f"SELECT count(*) AS n FROM samples WHERE {exp.data.where}")
                    .column("n")[0].as_py())
        base = max(profiles.get(exp.name, 0), seen.get(exp.name, 0))
        if count - base < exp.data.min_new_samples:
            continue
        seen[exp.name] = count
        if exp.retrain_on_new_samples:
            pending[exp.name] = count
        context.instance.add_dynamic_partitions("experiments", [exp.name])
        requests.append(dg.RunRequest(run_key=f"dataset:{exp.name}:{count}",
                                      partition_key=exp.name, asset_selection=DATASET_ASSETS,
                                      tags={"factory/trigger": "new-samples"}))
    if not requests:
        return dg.SkipReason("not enough new samples for any experiment")
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(cursor, sort_keys=True))


SENSORS = [checkpoint_sensor, rollover_sensor, recovery_sensor, traffic_sensor]
JOBS: list[Any] = []
