"""``training_run`` materialized in process on the local provider: one job, its segments and
one loss curve in the metadata; rows in the control tables."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.training import training_run
from factory.control.jobs import job_from_plan
from factory.lake import Lake
from resources.lake import LakeResource
from resources.providers import LocalConfig, ProviderResource
from tests.control.conftest import ONE_THREAD

pytestmark = pytest.mark.slow


def test_training_run_materializes_segments_and_loss_curve(factory_home, make_job,
                                                           tmp_path: Path) -> None:
    job = make_job("asset-run", num_steps=4)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job.to_dict()))
    provider = ProviderResource(local=LocalConfig(env=ONE_THREAD, warm_start=True))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", ["adhoc"])
        result = dg.materialize(
            [training_run], resources={"lake": LakeResource(), "provider": provider},
            partition_key="adhoc", instance=instance,
            run_config={"ops": {"training_run": {"config": {"job_file": str(job_file),
                                                            "experiment": "demo",
                                                            "poll_s": 0.3}}}})
    assert result.success
    [mat] = result.asset_materializations_for_node("training_run")
    md = mat.metadata
    assert md["status"].value == "finished" and md["num_segments"].value == 1
    curve = md["loss_curve"].value
    assert curve["step"] == [1, 2, 3, 4] and len(curve["loss"]) == 4
    assert "| asset-run-s000 | local |" in md["segments"].value
    lake = Lake()
    rows = lake.read("checkpoints").to_pylist()
    assert sorted(r["step"] for r in rows) == [2, 4]
    assert all(r["verified"] and r["experiment"] == "demo" for r in rows)
    assert [r["provider"] for r in lake.read("scheduler_assignments").to_pylist()] == ["local"]


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
