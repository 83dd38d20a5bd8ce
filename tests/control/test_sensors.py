"""Sensor unit tests: run requests, run keys and cursors."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import dagster as dg

from factory.lake import Lake
from factory.resources.lake import LakeResource
from factory.resources.providers import LocalConfig, ProviderResource
from factory.sensors.training import (
    CHECKPOINT_EVALS,
    checkpoint_sensor,
    recovery_sensor,
    rollover_sensor,
    traffic_sensor,
)

CHECKPOINT_RESOURCES = {"lake": LakeResource(), "provider": ProviderResource()}


def _row(run_id: str, step: int, t: int, verified: bool = True) -> dict:
    return {"run_id": run_id, "experiment": "demo", "step": step, "path": f"/c/{step}",
            "manifest_sha256": f"{step:064d}", "verified": verified,
            "received_at": datetime.fromtimestamp(1_700_000_000 + t, tz=UTC), "event_id": str(t)}


def test_checkpoint_sensor_requests_evals_once_per_checkpoint(factory_home) -> None:
    lake = Lake()
    lake.append("checkpoints", [_row("r1", 2, 1), _row("r1", 4, 2), _row("r1", 6, 3, False)])
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, resources=CHECKPOINT_RESOURCES)
        result = checkpoint_sensor(ctx)
        assert [r.partition_key for r in result.run_requests] == ["r1:2", "r1:4"]
        assert all(r.asset_selection == [CHECKPOINT_EVALS] for r in result.run_requests)
        assert result.run_requests[0].run_key == "r1:2@" + f"{2:064d}"[:16]
        cursor = json.loads(result.cursor)
        assert cursor["keys"] == ["r1:4"]
        assert set(instance.get_dynamic_partitions("checkpoints")) == {"r1:2", "r1:4"}
        mats = instance.fetch_materializations(dg.AssetKey("checkpoints"), limit=10).records
        assert len(mats) == 2

        again = checkpoint_sensor(dg.build_sensor_context(
            instance=instance, cursor=result.cursor, resources=CHECKPOINT_RESOURCES))
        assert isinstance(again, dg.SkipReason)
        lake.append("checkpoints", [_row("r1", 8, 4)])
        third = checkpoint_sensor(dg.build_sensor_context(
            instance=instance, cursor=result.cursor, resources=CHECKPOINT_RESOURCES))
        assert [r.partition_key for r in third.run_requests] == ["r1:8"]


def _samples(n: int, start: int, project: str) -> list[dict]:
    now = datetime.now(UTC)
    return [{"sample_id": f"{project}-{start + i}", "raw_trace_id": "r", "source": "upload",
             "messages": "[]", "tools": "[]", "num_turns": 1, "has_images": False,
             "has_tool_calls": False, "created_at": now, "project": project,
             "tags": [("project", project)]} for i in range(n)]


def test_traffic_sensor_requests_the_dataset_once_enough_new_samples(factory_home, tmp_path,
                                                                     monkeypatch) -> None:
    exp_dir = tmp_path / "experiments"
    exp_dir.mkdir()
    (exp_dir / "support.yaml").write_text(
        "name: support\ndata: {where: \"tags['project'] = 'support'\", min_new_samples: 3}\n"
        "recipe: smollm2-135m-lora\nretrain_on_new_samples: true\n")
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(exp_dir))
    lake = Lake()
    lake.append("samples", _samples(2, 0, "support") + _samples(5, 0, "other"))
    with dg.instance_for_test() as instance:
        def tick(cursor: str | None):
            return traffic_sensor(dg.build_sensor_context(
                instance=instance, cursor=cursor, resources={"lake": LakeResource()}))

        assert isinstance(tick(None), dg.SkipReason)  # never built: the first chain builds it
        lake.append("dataset_profile", [{"experiment": "support", "num_selected": 0,
                                         "created_at": datetime.now(UTC)}])
        assert isinstance(tick(None), dg.SkipReason)  # 2 < 3
        lake.append("samples", _samples(1, 2, "support"))
        result = tick(None)
        [req] = result.run_requests
        # retrain_on_new_samples: the whole chain starts (dataset, then plan and train once
        # the dataset is profiled: chain_sensor)
        assert req.run_key == "retrain:support:3" and req.partition_key == "support"
        assert req.job_name == "start_experiment_job"
        assert "3 new samples" in req.tags["factory/reason"]
        assert json.loads(result.cursor) == {"seen": {"support": 3}}
        assert isinstance(tick(result.cursor), dg.SkipReason)  # nothing new since
        lake.append("dataset_profile", [{"experiment": "support", "num_selected": 3,
                                         "created_at": datetime.now(UTC)}])
        assert isinstance(tick(result.cursor), dg.SkipReason)
        lake.append("samples", _samples(3, 3, "support"))
        assert tick(result.cursor).run_requests[0].run_key == "retrain:support:6"
        # without retrain_on_new_samples only the dataset is refreshed
        (exp_dir / "support.yaml").write_text(
            "name: support\ndata: {where: \"tags['project'] = 'support'\", min_new_samples: 3}\n"
            "recipe: smollm2-135m-lora\n")
        lake.append("samples", _samples(3, 6, "support"))
        [refresh] = tick(result.cursor).run_requests
        assert refresh.job_name == "refresh_dataset_job" and refresh.run_key == "dataset:support:9"


def test_checkpoint_sensor_skips_checkpoints_already_scored(factory_home) -> None:
    """A fresh Dagster instance over an existing lake evaluates only what is not scored."""
    lake = Lake()
    lake.append("checkpoints", [_row("r1", 2, 1), _row("r1", 4, 2)])
    lake.append("eval_scores", [{"run_id": "r1", "experiment": "demo", "step": 2,
                                 "kind": "checkpoint", "score": 0.5, "status": "ok"}])
    with dg.instance_for_test() as instance:
        result = checkpoint_sensor(dg.build_sensor_context(
            instance=instance, resources=CHECKPOINT_RESOURCES))
        assert [r.partition_key for r in result.run_requests] == ["r1:4"]
        assert result.run_requests[0].tags["factory/eval"] == "1"
        lake.append("eval_scores", [{"run_id": "r1", "experiment": "demo", "step": 4,
                                     "kind": "checkpoint", "score": 0.5, "status": "ok"}])
    with dg.instance_for_test() as fresh:
        again = checkpoint_sensor(dg.build_sensor_context(
            instance=fresh, resources=CHECKPOINT_RESOURCES))
        assert not again.run_requests and "already scored" in str(again.skip_reason)


def test_rollover_sensor_dispatches_a_queued_run_at_once(factory_home, make_job,
                                                         monkeypatch) -> None:
    """Evaluated every daemon pass, it acts when a run is submitted or a trainer exits, and
    otherwise skips until a full pass is due (``FULL_PASS_S``)."""
    from factory.control.plane import ControlPlane
    from factory.sensors import training

    provider = ProviderResource(local=LocalConfig(max_gpus=1))
    plane = ControlPlane(Lake(), provider.ladder(), provider.control_config())
    plane.submit(make_job("queued-run", debug={"sleep_per_step_s": 5.0}))
    clock = [1_000_000.0]
    monkeypatch.setattr(training.time, "time", lambda: clock[0])
    try:
        with dg.instance_for_test() as instance:
            def tick(sensor, cursor: str | None):
                return sensor(dg.build_sensor_context(
                    instance=instance, cursor=cursor,
                    resources={"lake": LakeResource(), "provider": provider}))

            result = tick(rollover_sensor, None)
            cursor = json.loads(result.cursor)
            assert (cursor["dispatch"], cursor["rollover"]) == (["queued-run"], [])
            assert cursor["full_at"] == clock[0] and cursor["pulse"] == plane.pulse()
            clock[0] += training.FULL_PASS_S / 2
            again = tick(rollover_sensor, result.cursor)
            assert isinstance(again, dg.SkipReason)  # launched once, never twice
            assert "nothing changed" in str(again.skip_message)
            # A second run submitted: the next pass places it (the ladder is full: it waits).
            plane.submit(make_job("second-run", debug={"sleep_per_step_s": 5.0}))
            waiting = tick(rollover_sensor, result.cursor)
            assert isinstance(waiting, dg.SensorResult) and waiting.skip_reason is not None
            kept = json.loads(waiting.cursor)
            assert kept["dispatch"] == ["queued-run"]  # the last report that did something
            assert [r.status for r in (plane.runs()["second-run"],)] == ["queued"]
            # The first trainer stopped: its exit changes the pulse, and the same pass frees
            # the slot and starts the waiting run.
            plane.stop_run("queued-run")
            assert plane.pulse() != kept["pulse"]
            started = tick(rollover_sensor, waiting.cursor)
            assert json.loads(started.cursor)["dispatch"] == ["second-run"]
            assert isinstance(tick(recovery_sensor, None), dg.SkipReason)
        assert [s.provider for s in plane.segments("queued-run")] == ["local"]
    finally:
        plane.stop_run("queued-run")
        plane.stop_run("second-run")


def test_checkpoint_sensor_syncs_a_trainer_that_exited(factory_home, make_job) -> None:
    """A trainer's last checkpoint is evaluated on the checkpoint sensor's first look after the
    trainer exited, without waiting for a control sensor to sync its events."""
    import time

    from factory.control.plane import ControlPlane

    provider = ProviderResource(local=LocalConfig(max_gpus=1))
    plane = ControlPlane(Lake(), provider.ladder(), provider.control_config())
    plane.submit(make_job("short-run", num_steps=4, checkpoint_every_steps=4))
    plane.dispatch()
    deadline = time.monotonic() + 300
    while not plane.exited():  # the trainer's exit is the event waited on
        assert time.monotonic() < deadline, "the tiny trainer did not exit in 300 s"
        time.sleep(0.2)
    assert not Lake().exists("checkpoints") or not Lake().read("checkpoints").num_rows
    with dg.instance_for_test() as instance:
        result = checkpoint_sensor(dg.build_sensor_context(
            instance=instance, resources={"lake": LakeResource(), "provider": provider}))
        assert [r.partition_key for r in result.run_requests] == ["short-run:4"]
