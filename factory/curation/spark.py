"""The Spark engine: the same curation as ``pipeline.curate``, run on a Spark cluster.

Spark runs the row function (``features.sample_features`` in the executors: parsing,
tokenization, MinHash, n-grams, detectors), the LSH bucket self-join with exact Jaccard, the
train/eval n-gram join, the decisions (``spark_decide``: split groups, cleaning steps, judge
scores), the profile and report aggregates (``spark_report``), and writes the datasets and the
drops as Parquet that the lake commits with pyiceberg ``add_files``. What reaches the driver
is bounded by the number of reasons, detectors and distinct token counts, not by the rows,
except for the phrasing split: the driver computes it (``phrasing.split_features``, the
embedded engine's own function) from each sample's id, split group, skeleton key, label and
skeleton bigram hashes, about 100 bytes and 8 a bigram per sample (~0.4 GB at 1M tickets).
Both engines give the same datasets, drops, profile and report (tested).

The master comes from ``FACTORY_SPARK_MASTER`` (``spark_session``). Past ``local``, the
executors open the tokenizer folder and write the staging Parquet by the driver's paths: both
live on the shared filesystem (``FACTORY_MODELS_DIR``, the warehouse).
"""

from __future__ import annotations

import json
import pickle
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from factory.curation import phrasing
from factory.curation.config import CurationConfig
from factory.curation.decide import (
    EVAL,
    NGRAM_WEIGHTS,
    TRAFFIC,
    TRAIN,
    candidate_floor,
)
from factory.curation.features import FEATURES_SCHEMA, sample_features
from factory.curation.pipeline import ROW_ORDER, CurationResult, Judge, _judge_input
from factory.curation.spark_decide import (
    DROP_COLUMNS,
    decide_spark,
    map_arrow,
    overlap_shares,
    split_sides,
)
from factory.curation.spark_report import profile_spark, report_spark
from factory.curation.tokens import RenderCounter
from factory.errors import FactoryError
from factory.settings import check_spark_master
from factory.tables import TABLES

CONNECT_PACKAGES = {"pandas": "pandas", "grpc": "grpcio", "grpc_status": "grpcio-status",
                    "google.rpc": "googleapis-common-protos", "zstandard": "zstandard"}
"""Import name -> package of what pyspark's Spark Connect client needs besides pyarrow."""


def spark_session(master: str | None = None, *, app: str = "factory-curation",
                  cores: int = 2, conf: Mapping[str, str] | None = None) -> Any:
    """A Spark session set up for the lake (UTC, Arrow, microsecond Parquet timestamps).

    ``master``: ``local[N]``, ``spark://``, ``k8s://`` (``.master``) or a Spark Connect
    ``sc://`` URL (``.remote``); None for ``local[cores]``. Executors, memory and the rest of
    a cluster's set-up come from ``spark-defaults.conf`` (``SPARK_CONF_DIR``) as usual; past
    ``local`` the executors' Python is this interpreter's path, so the cluster's nodes need
    the same environment there (one image, or the venv on the shared filesystem). ``conf``
    adds settings on top.
    """
    import os
    import sys

    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pyspark is the optional extra `spark`
        raise FactoryError(f"engine 'spark' needs pyspark (pip install 'factory[spark]'): "
                           f"{exc}") from exc

    master = check_spark_master(master or f"local[{cores}]")
    if master.startswith("sc://"):
        missing = sorted(pkg for name, pkg in CONNECT_PACKAGES.items() if not _importable(name))
        if missing:
            raise FactoryError(f"Spark Connect ({master}) needs the packages "
                               f"{', '.join(missing)} in this environment (the `spark` extra "
                               "installs them)")
        # the server owns the executors' environment and the static settings
        builder = SparkSession.builder.remote(master).appName(app)
    else:
        # Python workers run this interpreter (our venv), not whatever `python3` is first.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        builder = (SparkSession.builder.master(master).appName(app)
                   .config("spark.ui.enabled", "false")
                   .config("spark.driver.memory", "1g"))
        if master.startswith("local"):
            builder = builder.config("spark.sql.shuffle.partitions", str(cores)) \
                .config("spark.default.parallelism", str(cores))
    builder = (builder.config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no RDDs, no SparkContext)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _feature_batches(config: CurationConfig, tokenizer_dir: str
                     ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Partition function over Arrow batches: the input columns in, the features out."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        counter = RenderCounter(tokenizer_dir)
        for batch in batches:
            yield from sample_features(batch, config, counter).to_batches()
    return run


_INPUT = pa.schema([("sample_id", pa.string()), ("messages", pa.string()),
                    ("tools", pa.string()), ("tags", pa.map_(pa.string(), pa.string()))])


@dataclass(kw_only=True)
class SparkCurationResult(CurationResult[Any]):
    """``pipeline.CurationResult`` with the datasets and the drops as Spark DataFrames."""

    drops: Any  # type: ignore[assignment]
    """One row per dropped row (``DROP_COLUMNS``), in ``decide``'s order."""

    def drops_by_reason(self) -> dict[str, int]:
        return dict(sorted(json.loads(self.profile["drops_by_reason"]).items()))


def curate_spark(spark: Any, samples: Any, config: CurationConfig, tokenizer_dir: str, *,
                 judge: Judge | None = None) -> SparkCurationResult:
    """Curate ``samples`` (a Spark DataFrame with the ``samples`` columns) on Spark: the
    datasets and the drops are DataFrames; the report and the profile come from aggregates."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = [F.col(c).asc_nulls_first() for c in ROW_ORDER[1:] if c in samples.columns]
    rows = samples.withColumn("row_rank", F.row_number().over(
        Window.partitionBy("sample_id").orderBy(*order)) - 1).cache()
    num_selected = rows.count()
    distinct = rows.where("row_rank = 0").select("sample_id", "messages", "tools", "tags")
    features = map_arrow(spark, distinct, _feature_batches(config, tokenizer_dir), _INPUT,
                         _ddl(FEATURES_SCHEMA)).cache()

    # near-duplicate edges: pairs sharing a band key, verified by exact Jaccard
    bands = features.select("sample_id", F.posexplode("band_keys").alias("band", "key")) \
        .where("key != 0")
    a, b = bands.alias("a"), bands.alias("b")
    pairs = a.join(b, (F.col("a.band") == F.col("b.band")) & (F.col("a.key") == F.col("b.key"))
                   & (F.col("a.sample_id") < F.col("b.sample_id"))) \
        .select(F.col("a.sample_id").alias("x"), F.col("b.sample_id").alias("y")).distinct()
    sh = features.select("sample_id", "shingles")
    pairs = pairs.join(sh.withColumnRenamed("sample_id", "x").withColumnRenamed("shingles", "sx"),
                       "x").join(sh.withColumnRenamed("sample_id", "y")
                                 .withColumnRenamed("shingles", "sy"), "y")
    inter = F.size(F.array_intersect("sx", "sy"))
    edges = pairs.select("x", "y", (inter / (F.size("sx") + F.size("sy") - inter)).alias("jac")) \
        .where(F.col("jac") >= config.near_dup_threshold).localCheckpoint()

    row_keys = rows.select("sample_id", "raw_trace_id", "row_rank")
    # one row per feature row: the split groups are computed once and read once
    groups = split_sides(features, row_keys, edges, config).select("sample_id", "split_group")
    held_out = phrasing.split_features(
        features.select("sample_id", "phrasing_key", "phrasing_ngrams", "answer_label")
        .toArrow(),
        {r["sample_id"]: r["split_group"] for r in groups.toArrow().to_pylist()}, config)
    sides = spark.createDataFrame(
        [(sid, held_out.group[sid], side) for sid, side in sorted(held_out.side.items())],
        "sample_id string, split_group string, split string").localCheckpoint()
    with_side = features.select("sample_id", "prompt_key", "prompt_ngrams", "shingles") \
        .join(sides, "sample_id")
    ev, tr = with_side.where(f"split = '{EVAL}'"), with_side.where(f"split = '{TRAIN}'")
    # the same prompt as an eval sample: the smallest eval sample of that prompt
    eval_prompt = ev.where("prompt_key != ''").groupBy("prompt_key").agg(
        F.min("sample_id").alias("e"))
    overlaps = tr.where("prompt_key != ''").join(eval_prompt, "prompt_key").select(
        F.col("sample_id").alias("t"), F.lit("eval_prompt_match").alias("kind"), "e",
        F.lit(1.0).alias("share"))
    for kind, column in (("eval_ngram_overlap", "prompt_ngrams"),
                         ("eval_conversation_overlap", "shingles")):
        overlaps = overlaps.unionByName(overlap_shares(
            _weighted_overlaps(with_side, column, candidate_floor(kind, config)), kind))

    judge_scores = None
    if judge is not None:
        _check_shippable(judge)

        def judge_scores(ids: Any) -> Any:
            got = distinct.join(ids, "sample_id").select("sample_id", "messages", "tools")
            return map_arrow(spark, got, _judge_batches(judge), _JUDGE_INPUT,
                             "sample_id string, score double")

    decisions = decide_spark(spark, features=features, rows=row_keys, edges=edges,
                             overlaps=overlaps, sides=sides, config=config,
                             judge_scores=judge_scores)
    stats = sides.join(features.select("sample_id", "num_tokens", "num_prompt_tokens",
                                       "language", "size_bytes"), "sample_id")
    kept = rows.where("row_rank = 0").join(decisions.kept, "sample_id").join(stats, "sample_id") \
        .withColumn("num_completion_tokens",
                    (F.col("num_tokens") - F.col("num_prompt_tokens")).cast("int")) \
        .withColumn("origin", F.lit(TRAFFIC)) \
        .drop("row_rank").cache()
    train_df = kept.where(f"split = '{TRAIN}'").orderBy("sample_id")
    eval_df = kept.where(f"split = '{EVAL}'").orderBy("sample_id")
    drops = decisions.drops.orderBy("sample_id", "step", F.coalesce("raw_trace_id", F.lit("")),
                                    "row_rank").select(*DROP_COLUMNS)
    profile = profile_spark(spark, train_df, eval_df, drops, num_selected=num_selected)
    profile.update(held_out.profile_fields())
    report = report_spark(features, decisions.drops, decisions, config,
                          num_selected=num_selected,
                          num_kept=profile["num_train"] + profile["num_eval"])
    return SparkCurationResult(train=train_df.drop("size_bytes"),
                               eval=eval_df.drop("size_bytes"), drops=drops, report=report,
                               profile=profile, num_selected=num_selected,
                               num_clean=decisions.num_clean, clean_lost=decisions.clean_lost)


_JUDGE_INPUT = pa.schema([("sample_id", pa.string()), ("messages", pa.string()),
                          ("tools", pa.string())])


def _check_shippable(judge: Judge) -> None:
    """Refuse, before any Spark work, a judge that cannot be pickled to the executors (the
    judges the factory ships can: an ``LLMJudge`` opens its own HTTP client there). Scoring
    in the driver instead would bring every selected sample to one process."""
    from pyspark import cloudpickle

    try:
        cloudpickle.dumps(judge)
    except (TypeError, AttributeError, pickle.PicklingError) as e:
        raise FactoryError(
            f"the judge {getattr(judge, 'name', type(judge).__name__)} cannot be sent to "
            f"Spark's executors ({type(e).__name__}: {e}); give it __getstate__/__setstate__ "
            "that leave out what cannot be pickled (clients, locks), or curate with the "
            "embedded engine") from e


def _judge_batches(judge: Judge) -> Callable[[Iterator[pa.RecordBatch]],
                                             Iterator[pa.RecordBatch]]:
    """Partition function: the judge's score of each sample (``score_many`` per batch when
    the judge has it), in the executor holding the samples."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            rows = batch.to_pylist()
            inputs = [_judge_input(r) for r in rows]
            many = getattr(judge, "score_many", None)
            scores = many(inputs) if many is not None else [judge.score(x) for x in inputs]
            yield pa.RecordBatch.from_pydict(
                {"sample_id": [r["sample_id"] for r in rows],
                 "score": [float(v) for v in scores]},
                schema=pa.schema([("sample_id", pa.string()), ("score", pa.float64())]))
    return run


def _weighted_overlaps(sides: Any, column: str, floor: float) -> Any:
    """``pipeline.weighted_overlaps`` as a Spark query: (t, e, shared, total) of the train x
    eval pairs sharing an n-gram of ``column`` with nonzero weight, kept where the share
    reaches ``floor`` (``decide.candidate_floor``)."""
    from pyspark.sql import functions as F

    entries = sides.select("sample_id", "split", F.explode(column).alias("ng"))
    df = entries.groupBy("ng").agg(F.count("*").alias("df"))
    lookup = F.array(*[F.lit(float(w)) for w in NGRAM_WEIGHTS])
    weighted = entries.join(df, "ng").withColumn(
        "w", F.element_at(lookup, (F.least("df", F.lit(len(NGRAM_WEIGHTS) - 1)) + 1).cast("int"))) \
        .where("w > 0")
    ev = weighted.where(f"split = '{EVAL}'")
    total = ev.groupBy(F.col("sample_id").alias("e")).agg(F.sum("w").alias("total"))
    pairs = weighted.where(f"split != '{EVAL}'").select(F.col("sample_id").alias("t"), "ng", "w") \
        .join(ev.select(F.col("sample_id").alias("e"), "ng"), "ng") \
        .groupBy("t", "e").agg(F.sum("w").alias("shared")).join(total, "e")
    return pairs.where(F.col("shared") >= F.lit(floor) * F.col("total"))


def _ddl(schema: pa.Schema) -> str:
    """Spark DDL of the features schema."""
    names = {pa.string(): "string", pa.int32(): "int", pa.int64(): "bigint", pa.bool_(): "boolean",
             pa.list_(pa.int64()): "array<bigint>"}
    return ", ".join(f"{f.name} {names[f.type]}" for f in schema)


def commit(session: Any, experiment: str, result: SparkCurationResult, staging: str
           ) -> dict[str, Any]:
    """Write the datasets and the drops as Parquet with Spark and commit them to the lake with
    ``add_files``.

    The experiment's previous rows are deleted first (``where experiment = '<name>'``), then the
    new files are added: a version is the set of snapshots.

    Executors write the files and this process commits them by path, so ``staging`` must be
    the same folder for both (the shared filesystem past ``local``): a ``FactoryError`` when
    the files found there do not hold the rows written.
    """
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    # the lake (pyiceberg) is the driver's: Spark's Python workers import this module too
    from factory.curation.store import experiment_filter

    flt = experiment_filter(experiment)
    snaps: dict[str, Any] = {}
    expected = {"dataset_train": result.profile["num_train"],
                "dataset_eval": result.profile["num_eval"],
                "dataset_drops": result.profile["num_dropped"]}
    for name, df in (("dataset_train", result.train), ("dataset_eval", result.eval),
                     ("dataset_drops", result.drops)):
        cols = [f.name for f in TABLES[name]]
        out = df.withColumn("experiment", F.lit(experiment)).select(*cols)
        path = f"{staging.rstrip('/')}/{name}/{experiment}-{uuid.uuid4().hex[:12]}"
        out.coalesce(1).write.mode("error").parquet(path)
        spark_files = sorted(str(p) for p in Path(path).glob("*.parquet"))
        found = sum(pq.ParquetFile(f).metadata.num_rows for f in spark_files)
        if found != expected[name]:
            raise FactoryError(
                f"Spark wrote {expected[name]} {name} rows under {path} but this process finds "
                f"{found} there: the staging folder must be on a filesystem the executors "
                "and the driver share (the warehouse on shared storage)")
        table = session.lake.table(name)
        props = session.lineage.snapshot_properties()
        with table.transaction() as tx:
            tx.delete(delete_filter=flt, snapshot_properties=props)
            if spark_files:
                tx.add_files(spark_files, snapshot_properties=props)
        snap = session.lake.table(name).current_snapshot()
        snaps[name] = snap.snapshot_id if snap else None
        session.writes[name] = snaps[name]
    return snaps
