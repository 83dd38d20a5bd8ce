"""The Spark engine gives the embedded engine's datasets (one local session, small data)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from factory.curation.pipeline import curate
from factory.curation.synthetic import planted
from tests.curation.conftest import CONFIG

pytestmark = [pytest.mark.spark, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Delete operation did not match any records"),
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:pyspark.*")]


def test_spark_matches_embedded_and_commits_with_add_files(
        factory_home: Path, counter: Any, smollm2_dir: Path) -> None:
    pytest.importorskip("pyspark")
    import pyarrow.parquet as pq

    from factory.curation.spark import commit, curate_spark, local_session
    from factory.lake import Lake

    data = planted(80, config=CONFIG, seed=5)
    embedded = curate(data.table(), CONFIG, counter)
    path = factory_home / "in.parquet"
    pq.write_table(data.table(), path)
    spark = local_session()
    try:
        result = curate_spark(spark, spark.read.parquet(str(path)), CONFIG, str(smollm2_dir))
        train, ev = result.train.toArrow(), result.eval.toArrow()
        for mine, theirs in ((train, embedded.train), (ev, embedded.eval)):
            assert mine.select(theirs.column_names).to_pylist() == theirs.to_pylist()
        assert result.drops == embedded.drops
        assert result.profile == embedded.profile
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
