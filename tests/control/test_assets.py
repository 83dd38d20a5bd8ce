"""``training_run`` materialized in process on the local provider: one job, its segments, one
loss curve and what tokenizing dropped in the metadata; rows in the control tables. A plan that
does not fit its data is refused before anything is launched, and a trainer's data error fails
the step (and ``factory run``) at once with the trainer's message."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.assets.training import training_run
from factory.control.jobs import job_from_plan
from factory.lake import Lake
from factory.resources.lake import LakeResource
from factory.resources.providers import LocalConfig, ProviderResource
from factory.trainer.config import TrainerJob
from tests.control.conftest import ONE_THREAD, write_data

pytestmark = pytest.mark.slow


def _long_sample(i: int) -> dict[str, Any]:
    """A conversation of ~600 tokens: over the tests' max_seq_len of 256."""
    return {"sample_id": f"long-{i}", "tools": "[]", "messages": json.dumps([
        {"role": "user", "content": [{"type": "text", "text": "moon river " * 300}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}])}


def _with_long_samples(job: TrainerJob, path: Path, *, num_short: int, num_long: int) -> TrainerJob:
    short = pq.read_table(write_data(path, n=num_short)).to_pylist()
    pq.write_table(pa.Table.from_pylist(short + [_long_sample(i) for i in range(num_long)]),
                   path)
    return replace(job, data_files=[str(path)])


def _materialize(job: TrainerJob, tmp_path: Path, **kwargs: Any) -> Any:
    job_file = tmp_path / f"{job.run_id}.json"
    job_file.write_text(json.dumps(job.to_dict()))
    provider = ProviderResource(local=LocalConfig(env=ONE_THREAD, warm_start=True), backoff_s=0)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", ["adhoc"])
        return dg.materialize(
            [training_run], resources={"lake": LakeResource(), "provider": provider},
            partition_key="adhoc", instance=instance, **kwargs,
            run_config={"ops": {"training_run": {"config": {"job_file": str(job_file),
                                                            "experiment": "demo",
                                                            "poll_s": 0.3}}}})


def test_training_run_materializes_segments_and_loss_curve(factory_home, make_job,
                                                           tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # One sample in 100 is longer than the plan: dropped before training, and counted. The
    # plan's bf16 autocast, on a CPU said to emulate bf16, runs fp32: said after the warm
    # trainers' forkserver started, as a setting changed in a long-lived process would be.
    from factory.control.providers import LocalProvider

    LocalProvider(warm_start=True).warm_up()
    monkeypatch.setenv("FACTORY_CPU_BF16", "emulated")
    job = _with_long_samples(make_job("asset-run", num_steps=4, precision="bf16-autocast"),
                             tmp_path / "some-long.parquet", num_short=99, num_long=1)
    result = _materialize(job, tmp_path)
    assert result.success
    [mat] = result.asset_materializations_for_node("training_run")
    md = mat.metadata
    assert md["status"].value == "finished" and md["num_segments"].value == 1
    curve = md["loss_curve"].value
    assert curve["step"] == [1, 2, 3, 4] and len(curve["loss"]) == 4
    assert "| asset-run-s000 | local |" in md["segments"].value
    assert (md["num_samples"].value, md["num_examples"].value, md["num_dropped"].value) == \
        (100, 99, 1)
    assert md["num_dropped_too_long_for_plan"].value == 1
    assert md["num_dropped_no_target"].value == md["num_dropped_unrenderable"].value == 0
    assert md["max_sample_tokens"].value > 256
    # Those numbers are the trainer's own report.
    [started] = [json.loads(r["payload"]) for r in Lake().read("training_events").to_pylist()
                 if r["type"] == "started"]
    assert started["data"]["num_dropped_by_reason"]["too_long_for_plan"] == 1
    # What share_prefix saved (nothing: the job does not ask for it), as the trainer reports it.
    assert md["shared_prefix"].value == started["shared_prefix"]
    assert started["shared_prefix"]["tokens_computed"] == started["shared_prefix"]["tokens"] > 0
    assert md["precision"].value.startswith("fp32 (bf16-autocast planned, fp32 run: this CPU "
                                            "(FACTORY_CPU_BF16=emulated) emulates bf16")
    lake = Lake()
    rows = lake.read("checkpoints").to_pylist()
    assert sorted(r["step"] for r in rows) == [2, 4]
    assert all(r["verified"] and r["experiment"] == "demo" for r in rows)
    assert [r["provider"] for r in lake.read("scheduler_assignments").to_pylist()] == ["local"]


def test_a_plan_that_drops_over_one_percent_is_refused_before_launch(
        factory_home, make_job, tmp_path: Path) -> None:
    job = _with_long_samples(make_job("too-short"), tmp_path / "many-long.parquet",
                             num_short=47, num_long=3)
    with pytest.raises(dg.Failure, match=r"training_run: plan max_seq_len 256 would drop 3 of "
                                         r"50 training samples \(6.0%, over the 1% limit\): "
                                         r"3 too_long_for_plan \(longest \d+ tokens\)"):
        _materialize(job, tmp_path)
    assert not Lake().exists("training_runs")  # nothing submitted, nothing launched


def test_a_trainer_data_error_fails_the_step_with_its_message(factory_home, make_job,
                                                             tmp_path: Path) -> None:
    job = make_job("bad-modules", lora_target_modules=["no_such_proj"])
    result = _materialize(job, tmp_path, raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failure.event_specific_data.error
    assert "training run bad-modules failed: data or configuration error in bad-modules-s000 " \
           "(not retried): plan.lora_target_modules: the model has no module 'no_such_proj'" \
           in error.message
    segments = [r["segment_id"] for r in Lake().read("training_segments").to_pylist()]
    assert set(segments) == {"bad-modules-s000"}  # launched once, never retried


def test_bad_job_file_fails_with_the_field(factory_home, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"run_id": "x", "plan": {}, "output_dir": str(tmp_path)}))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", ["adhoc", "never-planned"])
        with pytest.raises(dg.Failure, match="plan.base_model: required"):
            dg.materialize([training_run], resources={"lake": LakeResource(),
                                                      "provider": ProviderResource()},
                           partition_key="adhoc", instance=instance,
                           run_config={"ops": {"training_run": {"config": {
                               "job_file": str(bad)}}}})
        with pytest.raises(dg.Failure, match="no plan yet"):
            dg.materialize([training_run], resources={"lake": LakeResource(),
                                                      "provider": ProviderResource()},
                           partition_key="never-planned", instance=instance)


def test_job_from_plan_exports_the_dataset_and_names_the_run(factory_home,
                                                             tiny_model_dir) -> None:
    lake = Lake()
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    msgs = json.dumps([{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                       {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}])
    lake.append("dataset_train", [{"experiment": e, "sample_id": f"{e}-{i}", "messages": msgs,
                                   "tools": "[]", "split": "train"}
                                  for e in ("demo", "other") for i in range(3)])
    config = {"base_model": str(tiny_model_dir), "max_seq_len": 64, "learning_rate": 1e-3,
              "num_steps": 2, "eval_every_steps": 1}
    lake.append("training_plans", [{"run_key": "demo/lora_rank=8", "experiment": "demo",
                                    "dataset_version": "abcdef0123456789", "created_at": now,
                                    "train_config": json.dumps(config)}])
    job, experiment = job_from_plan(lake, "demo/lora_rank=8")
    assert experiment == "demo"
    assert job.run_id.startswith("demo-lora_rank-8-") and job.run_id.endswith("20260102T030405")
    assert pq.read_table(job.data_files[0]).column("sample_id").to_pylist() == \
        ["demo-0", "demo-1", "demo-2"]
    assert job.plan.eval_every_steps is None and job.eval_data_files == []  # no eval rows
    assert job.output_dir.startswith(str(factory_home))


def test_a_failed_training_run_says_why(factory_home, tiny_model_dir) -> None:
    """The message the chain ends with (``chain_sensor``'s outcome, ``factory run``'s error)
    is the training_run step's: the refused plan's numbers, or the trainer's data error."""
    from factory.app.materialize import instance, materialize
    from factory.dagster_runs import failure_message

    lake = Lake()
    question = "tell me about the moon " * 5  # ~40 tokens rendered
    msgs = json.dumps([{"role": "user", "content": [{"type": "text", "text": question}]},
                       {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}])
    lake.append("dataset_train", [{"experiment": "demo", "sample_id": f"demo-{i}",
                                   "messages": msgs, "tools": "[]", "split": "train"}
                                  for i in range(8)])
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    plans = {"demo/fits": 64, "demo/too-short": 16}
    lake.append("training_plans", [{
        "run_key": key, "experiment": "demo", "dataset_version": "abcdef0123456789",
        "created_at": now, "train_config": json.dumps({
            "base_model": str(tiny_model_dir), "max_seq_len": max_seq_len,
            "learning_rate": 1e-3, "num_steps": 2, "lora_target_modules": ["no_such_proj"]})}
        for key, max_seq_len in plans.items()])
    instance().add_dynamic_partitions("runs", list(plans))

    def why(key: str) -> str:
        result = materialize(["training_run"], partition_key=key, raise_on_error=False,
                             run_config={"ops": {"training_run": {"config": {"poll_s": 0.5}}}})
        assert not result.success
        return failure_message(instance(), result.run_id)

    # The pre-launch check refuses the plan: nothing is launched.
    assert why("demo/too-short").startswith(
        "training_run: plan max_seq_len 16 would drop 8 of 8 training "
        "samples (100.0%, over the 1% limit): 8 too_long_for_plan (longest ")
    # The trainer's data error: the run fails after one segment, with the trainer's message.
    failed = why("demo/fits")
    assert failed.startswith("training run demo-fits-")
    assert "failed: data or configuration error in demo-fits-" in failed
    assert failed.split("(not retried): ")[1].startswith(
        "plan.lora_target_modules: the model has no module 'no_such_proj'")



def test_an_early_stopped_run_ends_its_step_with_the_stop_checkpoint_in_the_lake(
        factory_home, make_job, tmp_path: Path) -> None:
    # The evals flag the run while it trains; the trainer checkpoints where SIGTERM finds it,
    # and that checkpoint must be a row of `checkpoints` when the step ends (the best checkpoint
    # is selected right after, and must not miss it).
    import threading

    from tests.waiting import wait_until

    job = make_job("stop-run", num_steps=400, checkpoint_every_steps=1000,
                   debug={"sleep_per_step_s": 0.2})
    lake = Lake()

    def flag() -> None:
        def training() -> bool:
            if not lake.exists("training_events"):
                return False
            return any(r["type"] == "progress" and r["run_id"] == "stop-run"
                       for r in lake.read("training_events").to_pylist())

        wait_until(training, timeout_s=240, what="the trainer's first progress event")
        lake.append("early_stops", [{
            "run_id": "stop-run", "experiment": "demo", "peak_step": 1, "peak_score": 0.9,
            "last_step": 3, "last_score": 0.9, "reason": "plateau (test)",
            "created_at": datetime.now(UTC)}])

    flagger = threading.Thread(target=flag, daemon=True)
    flagger.start()
    result = _materialize(job, tmp_path)
    flagger.join(timeout=5)
    assert result.success
    [mat] = result.asset_materializations_for_node("training_run")
    assert mat.metadata["status"].value == "stopped"
    last = max(s for s in mat.metadata["loss_curve"].value["step"])
    assert last < 400
    steps = {int(r["step"]) for r in Lake().read("checkpoints").to_pylist()
             if r["run_id"] == "stop-run" and r["verified"]}
    assert steps and max(steps) >= last
