"""The training_plan asset and the experiments sensor, in process."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from assets.planning import training_plan
from factory.lake import Lake
from resources.lake import LakeResource
from sensors.experiments import MIN_INTERVAL_S, evaluate, experiments_sensor

EXP = """\
name: sup
data: {where: "true", max_tokens: 2048}
recipe: smollm2-135m-lora
overrides: {packing: true}
sweep: {learning_rate: [1.0e-4, 2.0e-4]}
"""

PROFILE = {
    "experiment": "sup", "dataset_version": "v1", "created_at": datetime.now(UTC),
    "num_train": 300, "num_eval": 30,
    "prompt_tokens_p50": 80, "prompt_tokens_p95": 200, "prompt_tokens_p99": 300,
    "prompt_tokens_max": 400, "completion_tokens_p50": 40, "completion_tokens_p95": 90,
    "completion_tokens_p99": 120, "completion_tokens_max": 150,
    "share_with_images": 0.0, "share_with_tool_calls": 0.0, "languages": '{"en": 1.0}',
}


def _sense(ctx: dg.SensorEvaluationContext) -> Any:
    result: Any = experiments_sensor(ctx)
    assert isinstance(result, dg.SensorResult)
    return result


@pytest.fixture()
def exp_dir(factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = factory_home / "experiments"
    d.mkdir()
    (d / "sup.yaml").write_text(EXP)
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(d))
    return d


def test_training_plan_asset_writes_plan_with_reasons(exp_dir: Path) -> None:
    Lake().append("dataset_profile", [PROFILE])
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", ["sup/learning_rate=0.0002"])
    result = dg.materialize([training_plan], partition_key="sup/learning_rate=0.0002",
                            resources={"lake": LakeResource()}, instance=instance)
    assert result.success
    meta: Any = result.asset_materializations_for_node("training_plan")[0].metadata
    assert "| learning_rate | **0.0002** (override) | sweep point |" in meta["plan"].value
    assert "# Experiment `sup`" in meta["card"].value
    rows = Lake().read("training_plans").to_pylist()
    assert [r["run_key"] for r in rows] == ["sup/learning_rate=0.0002"]
    cfg = json.loads(rows[0]["train_config"])
    assert cfg["learning_rate"] == 2e-4 and cfg["packing"] is True
    assert rows[0]["dataset_version"] == "v1"


def test_plan_refused_before_compute(exp_dir: Path) -> None:
    (exp_dir / "sup.yaml").write_text(EXP.replace("packing: true",
                                                  "micro_batch_size: 64, "
                                                  "gradient_checkpointing: false"))
    Lake().append("dataset_profile", [PROFILE])
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", ["sup/learning_rate=0.0001"])
    result = dg.materialize([training_plan], partition_key="sup/learning_rate=0.0001",
                            resources={"lake": LakeResource()}, instance=instance,
                            raise_on_error=False)
    assert not result.success
    failure: Any = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "GiB per device" in failure.event_specific_data.error.message
    assert "training_plans" not in Lake().existing_tables()


def test_sensor_picks_up_new_and_edited_sweep(exp_dir: Path) -> None:
    instance = dg.DagsterInstance.ephemeral()
    ctx = dg.build_sensor_context(instance=instance)
    first: Any = _sense(ctx)
    keys = sorted(r.partition_key for r in first.run_requests)
    assert keys == ["sup/learning_rate=0.0001", "sup/learning_rate=0.0002"]
    assert all(r.run_key.startswith(r.partition_key + "@") for r in first.run_requests)
    added = {r.partitions_def_name: list(r.partition_keys)
             for r in first.dynamic_partitions_requests}
    assert added == {"experiments": ["sup"], "runs": keys}

    # Unchanged file: nothing new.
    again: Any = _sense(dg.build_sensor_context(instance=instance, cursor=first.cursor))
    assert not again.run_requests

    # Edit the sweep: the new point (and only the changed file) is requested, timed.
    (exp_dir / "sup.yaml").write_text(EXP.replace("[1.0e-4, 2.0e-4]", "[1.0e-4, 2.0e-4, 4.0e-4]"))
    started = time.monotonic()
    edited: Any = _sense(dg.build_sensor_context(instance=instance, cursor=first.cursor))
    elapsed = time.monotonic() - started
    assert "sup/learning_rate=0.0004" in [r.partition_key for r in edited.run_requests]
    assert len(edited.run_requests) == 3
    assert {r.run_key for r in edited.run_requests}.isdisjoint(
        {r.run_key for r in first.run_requests})
    assert json.loads(edited.cursor)["files"]["sup"] != json.loads(first.cursor)["files"]["sup"]
    # The sensor ticks every 15 s; the evaluation itself must leave the rest of the minute.
    assert elapsed < 10


def test_sensor_skips_bad_file_and_fires_on_schedule(exp_dir: Path) -> None:
    (exp_dir / "broken.yaml").write_text("recipe: nope\n")
    (exp_dir / "sup.yaml").write_text(EXP + 'schedule: "0 3 * * *"\n')
    t0 = datetime(2026, 5, 6, 2, 0, tzinfo=UTC)
    requests, _, _, cursor, errors = evaluate(None, t0)
    assert len(requests) == 2 and len(errors) == 1 and "broken.yaml:1: recipe" in errors[0]
    requests, *_ = evaluate(cursor, datetime(2026, 5, 6, 2, 59, tzinfo=UTC))
    assert requests == []
    requests, _, _, cursor, _ = evaluate(cursor, datetime(2026, 5, 6, 3, 0, 20, tzinfo=UTC))
    assert sorted(str(r.run_key) for r in requests) == [
        "sup/learning_rate=0.0001@20260506T0300", "sup/learning_rate=0.0002@20260506T0300"]
    assert evaluate(cursor, datetime(2026, 5, 6, 3, 1, tzinfo=UTC))[0] == []


def test_edited_sweep_is_planned_in_dagster_within_a_minute(exp_dir: Path) -> None:
    """Edit -> sensor tick -> the new point's run exists in the instance with its plan written.

    The daemon's part is done here by hand, as it does it: apply the result's dynamic partition
    requests, then launch each run request (in process). The worst case is a full sensor
    interval before the tick, plus the tick, plus the run.
    """
    Lake().append("dataset_profile", [PROFILE])
    instance = dg.DagsterInstance.ephemeral()
    first: Any = _sense(dg.build_sensor_context(instance=instance))
    for req in first.dynamic_partitions_requests:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))

    (exp_dir / "sup.yaml").write_text(EXP.replace("[1.0e-4, 2.0e-4]", "[1.0e-4, 2.0e-4, 4.0e-4]"))
    started = time.monotonic()
    edited: Any = _sense(dg.build_sensor_context(instance=instance, cursor=first.cursor))
    for req in edited.dynamic_partitions_requests:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    new = next(r for r in edited.run_requests if r.partition_key == "sup/learning_rate=0.0004")
    result = dg.materialize([training_plan], partition_key=new.partition_key,
                            resources={"lake": LakeResource()}, instance=instance,
                            tags={**new.tags, "dagster/run_key": new.run_key})
    elapsed = time.monotonic() - started

    assert result.success
    assert "sup/learning_rate=0.0004" in instance.get_dynamic_partitions("runs")
    runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": new.partition_key}))
    assert [r.tags["dagster/run_key"] for r in runs] == [new.run_key]
    plans = Lake().read("training_plans").to_pylist()
    assert [json.loads(p["train_config"])["learning_rate"] for p in plans] == [4e-4]
    assert MIN_INTERVAL_S + elapsed < 60, f"{MIN_INTERVAL_S} s interval + {elapsed:.1f} s"
