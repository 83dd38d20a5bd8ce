"""The Spark engine gives the embedded engine's datasets (one local session, small data)."""

from __future__ import annotations

import gc
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from factory.curation.pipeline import curate
from factory.tasks.planted import Planted, planted, templated
from tests.curation.conftest import CONFIG
from tests.curation.test_assets import _checks, _run, _setup
from tests.curation.test_pipeline import LengthJudge


@pytest.fixture(autouse=True)
def _collect_spark_garbage():
    """Run the finalizers of this test's py4j/Spark objects now. Left to a later garbage
    collection they can run inside another test's import, where Python 3.11's import lock
    fails with ``KeyError: <thread id>`` (seen once in tests/curation/test_assets.py)."""
    yield
    gc.collect()

class LockedJudge(LengthJudge):
    """``LengthJudge`` holding a lock, which cannot be pickled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


pytestmark = [pytest.mark.spark, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Delete operation did not match any records"),
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:pyspark.*")]


def test_spark_matches_embedded_and_commits_with_add_files(
        factory_home: Path, counter: Any, smollm2_dir: Path) -> None:
    pytest.importorskip("pyspark")
    import pyarrow.parquet as pq

    from factory.curation.spark import commit, curate_spark, spark_session
    from factory.lake import Lake

    mixed, tickets = planted(80, config=CONFIG, seed=5), templated(150, seed=1, config=CONFIG)
    data = Planted(rows=mixed.rows + tickets.rows)
    # the judge scores in the executors; at 80 it drops 12 samples here, and every other step
    # still drops some
    config = replace(CONFIG, judge_threshold=80.0)
    embedded = curate(data.table(), config, counter, judge=LengthJudge())
    assert embedded.drops_by_reason()["judge_below_threshold"] > 0
    # the rarity-weighted overlaps agree too: both decontamination views drop their sample
    assert set(tickets.expected.items()) <= {(d["sample_id"], d["reason"])
                                             for d in embedded.drops}
    path = factory_home / "in.parquet"
    pq.write_table(data.table(), path)
    spark = spark_session()
    try:
        result = curate_spark(spark, spark.read.parquet(str(path)), config, str(smollm2_dir),
                              judge=LengthJudge())
        train, ev = result.train.toArrow(), result.eval.toArrow()
        for mine, theirs in ((train, embedded.train), (ev, embedded.eval)):
            assert mine.select(theirs.column_names).to_pylist() == theirs.to_pylist()
        assert result.drops.toArrow().to_pylist() == embedded.drops
        assert result.profile == embedded.profile
        assert result.report == embedded.report
        assert (result.num_clean, result.clean_lost) == (embedded.num_clean,
                                                         embedded.clean_lost)
        # held out by phrasing cluster: both engines run phrasing.split_features
        by_phrasing = replace(config, phrasing_threshold=0.3)
        mine_p = curate_spark(spark, spark.read.parquet(str(path)), by_phrasing,
                              str(smollm2_dir), judge=LengthJudge())
        theirs_p = curate(data.table(), by_phrasing, counter, judge=LengthJudge())
        assert theirs_p.profile["eval_split"] == "phrasing"
        assert mine_p.profile == theirs_p.profile
        assert mine_p.eval.toArrow().column("sample_id").to_pylist() == \
            theirs_p.eval.column("sample_id").to_pylist()
        assert mine_p.drops.toArrow().to_pylist() == theirs_p.drops
        lake = Lake()
        session = lake.session(run_id="r1", asset_key="dataset")
        lake.append("dataset_train", embedded.train.append_column(
            "experiment", __import__("pyarrow").array(["exp"] * embedded.train.num_rows)))
        commit(session, "exp", result, str(lake.settings.warehouse / "spark-staging"))
    finally:
        spark.stop()
    back = lake.read("dataset_train").sort_by("sample_id")
    assert back.num_rows == embedded.train.num_rows  # the commit replaced the earlier rows
    assert back.column("tags").to_pylist() == embedded.train.column("tags").to_pylist()
    assert back.column("created_at").equals(embedded.train.column("created_at"))


def test_an_llm_judge_scores_in_the_executors_as_in_the_embedded_engine(
        factory_home: Path, counter: Any, smollm2_dir: Path, judge_server: str) -> None:
    """Rejection sampling by an LLM judge on Spark: the judge (its HTTP client left behind)
    goes to the executors, which call the judge model themselves; the same samples are
    dropped as by the embedded engine. A judge that cannot be pickled is refused by name
    before any Spark work, rather than scored in the driver."""
    pytest.importorskip("pyspark")
    import pyarrow.parquet as pq

    from factory.curation.spark import curate_spark, spark_session
    from factory.errors import FactoryError
    from factory.evals import LLMJudge
    from factory.evals.rejection import RejectionJudge
    from factory.evals.rubric import Rubric
    from tests.evals.conftest import JudgeHandler

    rubric = Rubric.from_dict({"criteria": [
        {"name": "names_intent", "check": "llm", "description": "Names the intent."}]})
    judge = RejectionJudge(LLMJudge(base_url=judge_server, model="judge-1", max_retries=0),
                           rubric)
    data = templated(40, seed=4, config=CONFIG)
    config = replace(CONFIG, judge_threshold=0.5)
    embedded = curate(data.table(), config, counter, judge=judge)
    judged = len(JudgeHandler.calls)
    assert embedded.drops_by_reason()["judge_below_threshold"] > 0 and embedded.train.num_rows
    path = factory_home / "in.parquet"
    pq.write_table(data.table(), path)
    spark = spark_session("local[1]", cores=1)
    try:
        with pytest.raises(FactoryError, match=r"the judge LockedJudge cannot be sent to "
                                               r"Spark's executors \(TypeError"):
            curate_spark(spark, spark.read.parquet(str(path)), config, str(smollm2_dir),
                         judge=LockedJudge())
        result = curate_spark(spark, spark.read.parquet(str(path)), config, str(smollm2_dir),
                              judge=judge)
        train = result.train.toArrow()
        drops = result.drops.toArrow().to_pylist()
    finally:
        spark.stop()
    assert len(JudgeHandler.calls) == 2 * judged  # the executors asked the judge model
    assert train.select(embedded.train.column_names).to_pylist() == embedded.train.to_pylist()
    assert drops == embedded.drops


def test_dagster_engine_spark_writes_the_embedded_datasets(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pyspark")
    from factory.lake import Lake

    # the same selection predicate runs in DuckDB (embedded) and Spark SQL (spark)
    _setup(factory_home, monkeypatch, planted(60, config=CONFIG, seed=7),
           "tags['project'] = 'support'")
    lake = Lake()
    flt = "experiment = 'support'"
    tables = ("dataset_train", "dataset_eval", "dataset_drops")
    assert _run(engine="embedded").success
    embedded = [lake.read(t, row_filter=flt).sort_by("sample_id") for t in tables]
    embedded_profile = lake.read("dataset_profile").to_pylist()[0]
    # The experiment file picks the engine when the run config does not.
    exp = factory_home / "experiments" / "support.yaml"
    exp.write_text(exp.read_text().replace("max_tokens: 1024}", "max_tokens: 1024, "
                                           "engine: spark}"))
    spark_run = _run()
    assert spark_run.success
    assert _checks(spark_run) == {"no_empty_assistant_turns": True,
                                  "no_train_eval_overlap": True, "eval_not_empty": True}
    spark = [lake.read(t, row_filter=flt).sort_by("sample_id") for t in tables]
    assert embedded[0].num_rows > 0 and embedded[1].num_rows > 0 and embedded[2].num_rows > 0
    for mine, theirs in zip(spark, embedded, strict=True):
        assert sorted(mine.to_pylist(), key=repr) == sorted(theirs.to_pylist(), key=repr)
    # the spark run committed Parquet files written by Spark (add_files), not lake rows
    files = lake.table("dataset_train").inspect.files().column("file_path").to_pylist()
    assert files and all("spark-staging" in f for f in files)
    profile = lake.read("dataset_profile").to_pylist()[0]
    assert profile["engine"] == "spark" and embedded_profile["engine"] == "embedded"
    assert {k: v for k, v in profile.items() if k not in ("engine", "created_at")} == \
        {k: v for k, v in embedded_profile.items() if k not in ("engine", "created_at")}
    mat = spark_run.asset_materializations_for_node("dataset")[0]
    assert mat.metadata["engine"].value == "spark"


def test_components_match_union_find_on_chains_and_stars() -> None:
    pytest.importorskip("pyspark")
    import random

    from factory.curation.neardup import components as union_find
    from factory.curation.spark import spark_session
    from factory.curation.spark_decide import components

    rng = random.Random(3)
    names = [f"{rng.getrandbits(32):08x}" for _ in range(60)]
    chain = names[:33]  # a path of 33 nodes, named in no order: many rounds without jumps
    edges = list(zip(chain, chain[1:], strict=False))
    edges += [(names[40], n) for n in names[41:50]]  # a star
    edges += [(names[55], names[56]), (names[56], names[56])]  # a pair and a self-loop
    spark = spark_session()
    try:
        got = components(spark.createDataFrame(edges, "src string, dst string"))
        roots = {r["node"]: r["root"] for r in got.collect()}
    finally:
        spark.stop()
    assert roots == union_find(edges)


def test_rejection_sampling_reads_a_spark_selection_only_for_its_rubric(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rubric of a Spark selection is the embedded one's (its first samples with an answer,
    in sample_id order), read by streaming the ordered DataFrame, not by collecting it."""
    pytest.importorskip("pyspark")
    from types import SimpleNamespace

    import pyarrow.parquet as pq

    from factory.curation.build import rejection
    from factory.curation.spark import spark_session
    from factory.evals import rejection as rejection_module
    from factory.resources.judge import EmbeddedJudgeResource

    monkeypatch.setattr(rejection_module, "MAX_RUBRIC_EXAMPLES", 8)
    table = templated(60, seed=3, config=CONFIG).table()
    path = factory_home / "sel.parquet"
    pq.write_table(table, path)
    experiment = SimpleNamespace(eval=SimpleNamespace(rubric="auto"))
    config = replace(CONFIG, judge_threshold=0.5)
    embedded = rejection(EmbeddedJudgeResource().judge, experiment, config, table)
    spark = spark_session("local[1]", cores=1)
    try:
        on_spark = rejection(EmbeddedJudgeResource().judge, experiment, config,
                             spark.read.parquet(str(path)))
    finally:
        spark.stop()
    assert on_spark.rubric.to_dict() == embedded.rubric.to_dict()
