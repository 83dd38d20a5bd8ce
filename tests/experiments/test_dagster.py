"""The training_plan asset and the experiments sensor, in process."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.assets.planning import training_plan
from factory.lake import Lake
from factory.planner.host import cache_path, host_key, size_class
from factory.recipes import load_recipe
from factory.resources.lake import LakeResource
from factory.sensors.experiments import MIN_INTERVAL_S, evaluate, experiments_sensor
from factory.trainer.precision import effective_precision

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


def test_the_asset_plans_with_the_hosts_time_model_by_default(
        exp_dir: Path, factory_home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``FACTORY_TIME_MODEL`` unset (or ``host``) the plan's time model is this host's: the
    calibration cached in ``FACTORY_TIME_MODEL_CACHE`` (seeded here with known rates, so
    nothing is measured), and its step time follows those rates; ``reference``, the reference
    constants, as every machine would plan; anything else fails the step saying what to set."""
    monkeypatch.delenv("FACTORY_TIME_MODEL")
    cache = tmp_path / "time-model"
    monkeypatch.setenv("FACTORY_TIME_MODEL_CACHE", str(cache))
    recipe = load_recipe("smollm2-135m-lora")
    key = host_key()
    entry = f"{size_class(recipe.architecture)}|{effective_precision('bf16-autocast', 'cpu')[0]}"
    path = cache_path(cache, key)
    path.parent.mkdir(parents=True)

    def seed(train_tflops: float) -> None:
        path.write_text(json.dumps({"host": {}, "entries": {entry: {
            "method": "model", "precision": entry.split("|")[1], "train_tflops": train_tflops,
            "attention_tflops": train_tflops / 8,
            "forward_tflops": 0.5, "prefill_tflops": 0.1, "seconds": 3.0, "load": 0.5,
            "measured_at": "2026-12-06T00:00:00+00:00", "torch_threads": 2}}}))

    Lake().append("dataset_profile", [PROFILE])
    instance = dg.DagsterInstance.ephemeral()
    keys = ["sup/learning_rate=0.0001", "sup/learning_rate=0.0002"]
    instance.add_dynamic_partitions("runs", keys)

    def plan_of(partition: str) -> dict[str, Any]:
        result = dg.materialize([training_plan], partition_key=partition,
                                resources={"lake": LakeResource()}, instance=instance,
                                raise_on_error=False)
        if not result.success:
            failure: Any = next(e for e in result.all_events
                                if e.event_type_value == "STEP_FAILURE")
            return {"error": failure.event_specific_data.error.message}
        rows = [r for r in Lake().read("training_plans").to_pylist() if r["run_key"] == partition]
        return dict(json.loads(max(rows, key=lambda r: r["created_at"])["plan"]))

    seed(1.0)
    fast = plan_of(keys[0])
    assert fast["values"]["time_model"] == "calibrated"
    assert fast["reasons"]["time_model"]["reason"].startswith(
        f"calibrated on this host ({key.label}) at 2026-12-06")
    assert "train 1, attention 0.125," in fast["reasons"]["time_model"]["reason"]
    seed(0.25)  # a host a quarter as fast: the same plan's steps take longer
    slow = plan_of(keys[0])
    assert slow["estimates"]["step_seconds"] > 2 * fast["estimates"]["step_seconds"]
    monkeypatch.setenv("FACTORY_TIME_MODEL", "host")
    assert plan_of(keys[1])["values"]["time_model"] == "calibrated"
    monkeypatch.setenv("FACTORY_TIME_MODEL", "reference")
    assert plan_of(keys[1])["values"]["time_model"] == "measured"
    monkeypatch.setenv("FACTORY_TIME_MODEL", "laptop")
    assert "FACTORY_TIME_MODEL='laptop': use host" in plan_of(keys[1])["error"]


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


def _skip(result: Any) -> str:
    reason = result.skip_reason
    return str(getattr(reason, "skip_message", reason))


def _always(_: Any) -> bool:
    return True


def test_sensor_starts_a_chain_for_new_and_edited_files(exp_dir: Path) -> None:
    Lake().append("samples", [_sample()])
    instance = dg.DagsterInstance.ephemeral()
    ctx = dg.build_sensor_context(instance=instance, resources={"lake": LakeResource()})
    first: Any = _sense(ctx)
    [req] = first.run_requests
    assert req.job_name == "start_experiment_job" and req.partition_key == "sup"
    assert req.run_key.startswith("sup@")
    assert req.tags["factory/experiment-sha"] == json.loads(first.cursor)["files"]["sup"]
    added = {r.partitions_def_name: list(r.partition_keys)
             for r in first.dynamic_partitions_requests}
    assert added == {"experiments": ["sup"]}

    # Unchanged file: nothing new.
    again: Any = _sense(dg.build_sensor_context(instance=instance, cursor=first.cursor,
                                                resources={"lake": LakeResource()}))
    assert not again.run_requests

    # Edit the sweep: a new chain, timed.
    (exp_dir / "sup.yaml").write_text(EXP.replace("[1.0e-4, 2.0e-4]", "[1.0e-4, 2.0e-4, 4.0e-4]"))
    started = time.monotonic()
    edited: Any = _sense(dg.build_sensor_context(instance=instance, cursor=first.cursor,
                                                 resources={"lake": LakeResource()}))
    elapsed = time.monotonic() - started
    [new] = edited.run_requests
    assert new.run_key != req.run_key and new.partition_key == "sup"
    assert json.loads(edited.cursor)["files"]["sup"] != json.loads(first.cursor)["files"]["sup"]
    # The sensor ticks every 15 s; the evaluation itself must leave the rest of the minute.
    assert MIN_INTERVAL_S + elapsed < 60


def _sample() -> dict[str, Any]:
    return {"sample_id": "s1", "raw_trace_id": "r", "source": "upload", "messages": "[]",
            "tools": "[]", "num_turns": 1, "has_images": False, "has_tool_calls": False,
            "created_at": datetime.now(UTC), "project": "p", "tags": [("project", "p")]}


def test_a_file_waits_for_its_samples(exp_dir: Path) -> None:
    """No chain (and so no plan) before samples match: the tick says why, and the file starts
    once samples arrive."""
    (exp_dir / "sup.yaml").write_text(EXP.replace('where: "true"',
                                                  "where: \"tags['project'] = 'p'\""))
    instance = dg.DagsterInstance.ephemeral()

    def tick(cursor: str | None) -> Any:
        return _sense(dg.build_sensor_context(instance=instance, cursor=cursor,
                                              resources={"lake": LakeResource()}))

    waiting = tick(None)
    assert not waiting.run_requests
    assert "sup: waiting for samples matching data.where" in _skip(waiting)
    Lake().append("samples", [_sample()])
    assert [r.partition_key for r in tick(waiting.cursor).run_requests] == ["sup"]


def test_sensor_skips_bad_file_and_fires_on_schedule(exp_dir: Path) -> None:
    (exp_dir / "broken.yaml").write_text("recipe: nope\n")
    (exp_dir / "sup.yaml").write_text(EXP + 'schedule: "0 3 * * *"\n')
    t0 = datetime(2026, 5, 6, 2, 0, tzinfo=UTC)
    requests, _, cursor, problems = evaluate(None, t0, _always)
    # a scheduled file waits for its tick; the broken one is reported
    assert requests == [] and "broken.yaml:1: recipe" in problems[0]
    assert "sup: scheduled (0 3 * * *)" in problems[1]
    requests, *_ = evaluate(cursor, datetime(2026, 5, 6, 2, 59, tzinfo=UTC), _always)
    assert requests == []
    requests, _, cursor, _ = evaluate(cursor, datetime(2026, 5, 6, 3, 0, 20, tzinfo=UTC),
                                      _always)
    assert [str(r.run_key) for r in requests] == ["sup@20260506T0300"]
    assert evaluate(cursor, datetime(2026, 5, 6, 3, 1, tzinfo=UTC), _always)[0] == []


def test_broken_file_is_reported_on_the_tick(exp_dir: Path) -> None:
    (exp_dir / "broken.yaml").write_text("name: broken\nrecipe: smollm2-135m-lora\n"
                                         "overrides: {learnig_rate: 1}\n")
    Lake().append("samples", [_sample()])
    result = _sense(dg.build_sensor_context(instance=dg.DagsterInstance.ephemeral(),
                                            resources={"lake": LakeResource()}))
    assert [r.partition_key for r in result.run_requests] == ["sup"]  # the others go on
    result_none = _sense(dg.build_sensor_context(instance=dg.DagsterInstance.ephemeral(),
                                                 cursor=result.cursor,
                                                 resources={"lake": LakeResource()}))
    assert "broken.yaml:3: overrides.learnig_rate" in _skip(result_none)
    assert "did you mean 'learning_rate'" in _skip(result_none)


def test_a_file_already_started_by_factory_run_is_not_started_twice(exp_dir: Path) -> None:
    from factory.experiments import experiment_sha, load_experiment
    from factory.sensors.chains import SHA_TAG

    Lake().append("samples", [_sample()])
    instance = dg.DagsterInstance.ephemeral()
    sha = experiment_sha(load_experiment("sup"))
    instance.add_run(dg.DagsterRun(job_name="start_experiment_job",
                                   tags={SHA_TAG: sha, "dagster/partition": "sup"}))
    result = _sense(dg.build_sensor_context(instance=instance,
                                            resources={"lake": LakeResource()}))
    assert not result.run_requests
    assert json.loads(result.cursor)["files"]["sup"] == sha
