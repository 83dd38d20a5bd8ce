"""An experiment's curation as its assets run it (``factory.curation.build``), on a real lake and
without Dagster: an unknown engine and synthetic samples on Spark refused with the fix before
anything is read, a dataset built and read back (the judge made only for rejection sampling, and
named then), and its profile written with what the dataset's materialization recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from factory.curation.build import build_dataset, profile_dataset
from factory.curation.phrasing import SPLIT_FIELDS
from factory.errors import FactoryError
from factory.evals.judges import EmbeddedJudge
from factory.experiments import Experiment, load_experiment
from factory.lake import Lake, LakeSession
from factory.tasks.planted import planted
from tests.curation.conftest import CONFIG

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")


def _experiment(home: Path, monkeypatch: pytest.MonkeyPatch, data: str) -> Experiment:
    exps = home / "experiments"
    exps.mkdir(exist_ok=True)
    (exps / "support.yaml").write_text(f"name: support\nrecipe: smollm2-135m-lora\ndata: {data}\n")
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(exps))
    return load_experiment("support")


def _session(asset: str) -> LakeSession:
    return Lake().session(run_id="test", asset_key=asset)


def _no_judge() -> Any:
    raise AssertionError("no judge threshold: no judge is made")


def test_an_unknown_engine_is_refused_before_anything_is_read(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    experiment = _experiment(factory_home, monkeypatch, '{where: "true"}')
    Lake().append("samples", planted(20, config=CONFIG, seed=1).table())
    session = _session("dataset")
    with pytest.raises(FactoryError, match="engine 'duckdb': choose one of embedded, spark"):
        build_dataset(session, experiment, judge=_no_judge, engine="duckdb")
    assert session.lineage.reads == {} and not Lake().exists("dataset_train")


def test_the_spark_engine_asked_for_refuses_synthetic_samples_with_the_fix(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path) -> None:
    """The experiment file cannot pair them (its loader refuses); the run config can."""
    experiment = _experiment(factory_home, monkeypatch,
                             "{where: \"true\", synthesize: {teacher: t, "
                             "base_url: 'http://127.0.0.1:9/v1'}}")
    session = _session("dataset")
    with pytest.raises(FactoryError, match="the spark engine does not curate synthetic samples; "
                                           "use the embedded engine"):
        build_dataset(session, experiment, judge=_no_judge, engine="spark")
    assert session.lineage.reads == {} and not Lake().exists("dataset_train")


def test_a_dataset_is_built_read_back_and_profiled_with_its_materializations_values(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path) -> None:
    experiment = _experiment(factory_home, monkeypatch, '{where: "true", max_tokens: 1024}')
    samples = planted(60, config=CONFIG, seed=2).table()
    Lake().append("samples", samples)
    lake = Lake()
    built = build_dataset(_session("dataset"), experiment, judge=_no_judge, num_workers=1)
    assert (built.engine, built.judged) == ("embedded", {})
    assert built.samples_snapshot_id == lake.snapshot_id("samples")
    assert built.result.num_selected == samples.num_rows
    flt = "experiment = 'support'"
    for mine, table in ((built.train, "dataset_train"), (built.ev, "dataset_eval")):
        assert mine.num_rows > 0
        assert mine.sort_by("sample_id").equals(lake.read(table, row_filter=flt)
                                                .sort_by("sample_id"))

    # what the dataset's materialization recorded (here: another engine, another split reason)
    made = {**{k: built.result.profile[k] for k in SPLIT_FIELDS}, "engine": "spark",
            "eval_split_reason": "as the materialization recorded it"}
    profiled = profile_dataset(_session("dataset_profile"), experiment, made)
    [row] = lake.read("dataset_profile", row_filter=flt).to_pylist()
    assert (row["engine"], row["eval_split_reason"]) == ("spark",
                                                         "as the materialization recorded it")
    assert row["eval_split"] == made["eval_split"]
    assert row["num_train"] == built.train.num_rows == profiled.profile["num_train"]
    assert row["samples_snapshot_id"] == built.samples_snapshot_id
    assert row["tokenizer"] == smollm2_dir.name
    assert [s.key for s in profiled.slices] and row["shared_prefix_tokens"] >= 0


def test_rejection_sampling_makes_one_judge_and_names_it(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path) -> None:
    experiment = _experiment(factory_home, monkeypatch,
                             '{where: "true", max_tokens: 1024, judge_threshold: 0.0}')
    Lake().append("samples", planted(40, config=CONFIG, seed=3).table())
    made: list[EmbeddedJudge] = []

    def judge() -> EmbeddedJudge:
        made.append(EmbeddedJudge())
        return made[-1]

    built = build_dataset(_session("dataset"), experiment, judge=judge, num_workers=1)
    assert len(made) == 1
    assert built.judged["judge"] == made[0].name
    assert built.judged["judge_rubric_version"]
    assert built.train.num_rows > 0
