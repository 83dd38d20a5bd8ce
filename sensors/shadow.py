"""``shadow_sensor``: new shadow pairs are scored (and may promote their candidate).

On each tick it looks at ``shadow_pairs``; when its snapshot changed since the last request, it
asks for one run of ``shadow_scores_job`` per experiment with pairs newer than the cursor's
time. The run key names the experiment and the snapshot, so a re-evaluated tick never launches
a run twice.
"""

import json
from datetime import datetime
from typing import Any

import dagster as dg

from factory.resources.lake import LakeResource

shadow_scores_job = dg.define_asset_job(
    "shadow_scores_job", selection=dg.AssetSelection.assets("shadow_scores"),
    description="Score new shadow pairs of one experiment (and promote its candidate when its "
                "shadow policy is met).")


@dg.sensor(job=shadow_scores_job, name="shadow_sensor", minimum_interval_seconds=30,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Scores new live-traffic shadow pairs, per experiment.")
def shadow_sensor(context: dg.SensorEvaluationContext, lake: LakeResource) -> Any:
    store = lake.lake()
    if not store.exists("shadow_pairs"):
        return dg.SkipReason("no shadow pairs yet")
    state: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
    snapshot = store.snapshot_id("shadow_pairs")
    if snapshot == state.get("snapshot"):
        return dg.SkipReason("no new shadow pairs")
    since = state.get("since")
    where, params = ("WHERE created_at > ?", [datetime.fromisoformat(since)]) if since \
        else ("", [])
    rows = store.sql(f"SELECT experiment, max(created_at) AS newest, count(*) AS n FROM "
                   f"shadow_pairs {where} GROUP BY experiment", params).to_pylist()
    known = set(context.instance.get_dynamic_partitions("experiments"))
    requests = [dg.RunRequest(run_key=f"shadow:{r['experiment']}:{snapshot}",
                              partition_key=r["experiment"],
                              tags={"factory/reason": f"{r['n']} new shadow pair(s)"})
                for r in rows if r["experiment"] in known]
    newest = max((r["newest"] for r in rows), default=None)
    context.update_cursor(json.dumps({
        "snapshot": snapshot, "since": newest.isoformat() if newest else since}))
    return requests or dg.SkipReason("new pairs only for experiments without a partition")


SENSORS = [shadow_sensor]
JOBS = [shadow_scores_job]
