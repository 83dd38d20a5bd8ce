"""The ingest multi-asset materialized in process, and the uploads sensor's run requests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import dagster as dg

from factory.assets.ingest import traces
from factory.lake import Lake
from factory.resources.lake import LakeResource
from factory.sensors.uploads import build_uploads_sensor, ingest_uploads_job
from factory.settings import get_settings
from tests.ingest import conversations as conv


def _drop(name: str, records: list[object], age_s: float = 7200.0) -> Path:
    path = get_settings().ensure().uploads / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def test_materialize_ingests_the_configured_file_with_lineage(factory_home: Path) -> None:
    _drop("a.jsonl", [conv.openai_call(), {"nope": 1}])
    config = {"ops": {"traces": {"config": {"paths": ["a.jsonl"], "tags": {"k": "v"}}}}}
    result = dg.materialize([traces], resources={"lake": LakeResource()}, run_config=config)
    assert result.success
    lake = Lake()
    assert lake.read("samples").num_rows == 1
    assert lake.read("rejected_traces").num_rows == 1
    for table in ("raw_traces", "samples", "rejected_traces"):
        info = lake.snapshot_info(table)
        assert (info["run_id"], info["asset_key"]) == (result.run_id, table)
    mats = {m.asset_key.to_user_string(): m.metadata
            for m in result.asset_materializations_for_node("traces")}
    assert mats["samples"]["ingested"].value == 1
    assert mats["samples"]["written_snapshots"].value == {"samples": lake.snapshot_id("samples")}
    # The sensor's run config for the same file: a re-ingest, so nothing new is committed.
    sensor = build_uploads_sensor(ingest_uploads_job, settle_s=0)
    with dg.instance_for_test() as instance:
        tick = sensor(dg.build_sensor_context(instance=instance))
        assert isinstance(tick, dg.SensorResult)
        [req] = tick.run_requests
        again = dg.materialize([traces], resources={"lake": LakeResource()},
                               run_config=req.run_config, instance=instance)
    assert again.success
    assert lake.snapshot_info("samples")["run_id"] == result.run_id


def test_uploads_sensor_requests_each_new_file_once(factory_home: Path) -> None:
    sensor = build_uploads_sensor(ingest_uploads_job, settle_s=3600)
    _drop("one.jsonl", [conv.anthropic_call()])
    _drop("sub/two.json", [conv.gemini_call()])
    _drop("fresh.jsonl", [conv.gemini_call()], age_s=0)  # still being written
    _drop("notes.txt", ["ignored"])
    with dg.instance_for_test() as instance:
        result = sensor(dg.build_sensor_context(instance=instance))
        assert isinstance(result, dg.SensorResult)
        keys = sorted(r.run_key for r in result.run_requests)
        assert [k.split("@")[0] for k in keys] == ["one.jsonl", "sub/two.json"]
        req = next(r for r in result.run_requests if r.run_key.startswith("one"))
        assert req.run_config["ops"]["traces"]["config"]["paths"] == [
            str(get_settings().uploads / "one.jsonl")]
        cursor = result.cursor
        assert cursor is not None and set(json.loads(cursor)) == {"one.jsonl", "sub/two.json"}
        again = sensor(dg.build_sensor_context(instance=instance, cursor=cursor))
        assert isinstance(again, dg.SkipReason) and "still being written" in str(again.skip_message)
        changed = _drop("one.jsonl", [conv.anthropic_call(), conv.openai_call()])
        third = sensor(dg.build_sensor_context(instance=instance, cursor=cursor))
        assert isinstance(third, dg.SensorResult)
        [req3] = third.run_requests
        assert req3.run_key.startswith("one.jsonl@") and req3.run_key not in keys
        assert changed.exists()
