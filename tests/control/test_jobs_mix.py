"""A planned mixture becomes a job: each ``data.mix`` source exported to Parquet (a file source
normalized to canonical samples, once per content) with its weight, and the planner's row
counts come from the same sources."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from factory.control.jobs import (
    EXPORT_ROW_GROUP,
    job_from_plan,
    mix_source_rows,
    traffic_group_rows,
)
from factory.errors import FactoryError
from factory.lake import Lake


def _chat(text: str) -> str:
    return json.dumps([{"role": "user", "content": [{"type": "text", "text": text}]},
                       {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}])


def test_a_planned_mix_exports_every_source_with_its_weight(factory_home: Path, tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    lake = Lake()
    lake.append("dataset_train", [{"experiment": e, "sample_id": f"{e}-{i}",
                                   "messages": _chat(f"{e} {i}"), "tools": "[]",
                                   "split": "train"}
                                  for e, n in (("demo", 3), ("other", 5)) for i in range(n)])
    general = tmp_path / "general.jsonl"
    records = [{"messages": [{"role": "user", "content": f"question {i}"},
                             {"role": "assistant", "content": f"answer {i}"}]}
               for i in range(7)]
    general.write_text("\n".join(json.dumps(r) for r in records)
                       + "\n{\"neither\": 1}\n")  # a line no normalizer takes is skipped
    mix = [{"source": "traffic", "weight": 6.0}, {"source": "experiment:other", "weight": 1.0},
           {"source": f"file:{general}", "weight": 3.0}]
    sources = [m["source"] for m in mix]
    assert mix_source_rows(lake, "demo", sources) == {
        "traffic": 3, "experiment:other": 5, f"file:{general}": 7}
    config = {"base_model": str(tiny_model_dir), "max_seq_len": 64, "learning_rate": 1e-3,
              "num_steps": 2}
    lake.append("training_plans", [{
        "run_key": "demo", "experiment": "demo", "dataset_version": "abcdef0123456789",
        "created_at": datetime(2026, 1, 2, tzinfo=UTC), "train_config": json.dumps(config),
        "plan": json.dumps({"mix": mix})}])
    job, _ = job_from_plan(lake, "demo")
    assert job.data_files == [] and [(s.name, s.weight) for s in job.mix] == \
        [(m["source"], m["weight"]) for m in mix]
    ids = [pq.read_table(s.data_files[0]).column("sample_id").to_pylist() for s in job.mix]
    assert ids[0] == ["demo-0", "demo-1", "demo-2"]
    assert ids[1] == [f"other-{i}" for i in range(5)]
    assert len(ids[2]) == 7
    canonical = pq.read_table(job.mix[2].data_files[0]).to_pylist()[0]
    assert json.loads(canonical["messages"])[0]["content"][0]["type"] == "text"
    assert pq.ParquetFile(job.mix[2].data_files[0]).metadata.row_group(0).num_rows <= \
        EXPORT_ROW_GROUP
    again, _ = job_from_plan(lake, "demo")  # the file source is exported once per content
    assert again.mix[2].data_files == job.mix[2].data_files

    lake.append("training_plans", [{
        "run_key": "lonely", "experiment": "lonely", "dataset_version": "",
        "created_at": datetime(2026, 1, 3, tzinfo=UTC), "train_config": json.dumps(config),
        "plan": json.dumps({"mix": [{"source": "traffic", "weight": 1.0}]})}])
    with pytest.raises(FactoryError, match="data.mix source 'traffic' has no samples"):
        job_from_plan(lake, "lonely")


def test_traffic_and_synthetic_are_the_rows_of_each_origin(factory_home: Path) -> None:
    lake = Lake()
    lake.append("dataset_train", [
        {"experiment": "demo", "sample_id": f"demo-{i}", "messages": _chat(str(i)),
         "tools": "[]", "split": "train", "origin": origin}
        for i, origin in enumerate(["traffic", None, "synthetic", "traffic", "synthetic",
                                    "synthetic"])])
    assert mix_source_rows(lake, "demo", ["traffic", "synthetic"]) == {"traffic": 3,
                                                                       "synthetic": 3}


def test_balance_groups_count_and_export_the_traffic_by_language(factory_home: Path) -> None:
    lake = Lake()
    langs = ["en"] * 5 + ["fr"] * 2 + [None]
    lake.append("dataset_train", [{"experiment": "demo", "sample_id": f"demo-{i}",
                                   "messages": _chat(f"hello {i}"), "tools": "[]",
                                   "split": "train", "language": lang}
                                  for i, lang in enumerate(langs)]
                + [{"experiment": "other", "sample_id": "other-0", "messages": _chat("x"),
                    "tools": "[]", "split": "train", "language": "fr"}])
    assert traffic_group_rows(lake, "demo", "language") == {
        "traffic[language=en]": 5, "traffic[language=fr]": 2, "traffic[language=und]": 1}
    with pytest.raises(ValueError, match="not a column to group by"):
        traffic_group_rows(lake, "demo", "messages")
    mix = [{"source": "traffic[language=en]", "weight": 0.6},
           {"source": "traffic[language=fr]", "weight": 0.3},
           {"source": "traffic[language=und]", "weight": 0.1}]
    lake.append("training_plans", [{
        "run_key": "demo", "experiment": "demo", "dataset_version": "abcdef0123456789",
        "created_at": datetime(2026, 1, 2, tzinfo=UTC),
        "train_config": json.dumps({"base_model": "m", "max_seq_len": 64,
                                    "learning_rate": 1e-3, "num_steps": 2}),
        "plan": json.dumps({"mix": mix})}])
    job, _ = job_from_plan(lake, "demo")
    ids = [pq.read_table(s.data_files[0]).column("sample_id").to_pylist() for s in job.mix]
    assert ids == [[f"demo-{i}" for i in range(5)], ["demo-5", "demo-6"], ["demo-7"]]
    assert [s.name for s in job.mix] == [m["source"] for m in mix]
