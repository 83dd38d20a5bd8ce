"""The Spark engine: the same curation as ``pipeline.curate``, with the heavy work on Spark.

Spark runs the row function (``features.sample_features`` inside ``mapInArrow``: parsing,
tokenization, MinHash, n-grams, detectors), the LSH bucket self-join with exact Jaccard, the
train/eval n-gram join and the split hash, and writes the datasets as Parquet that the lake
commits with pyiceberg ``add_files``. The driver collects compact per-sample facts (ids, flags,
counts: no text) and the related-pair edges, and runs the same ``decide`` as the embedded
engine, so both engines give the same datasets (tested).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from factory.curation.config import CurationConfig
from factory.curation.decide import (
    EVAL,
    NGRAM_WEIGHTS,
    TRAFFIC,
    candidate_floor,
    decide,
    eval_cutoff,
    overlap_share,
    split_groups,
)
from factory.curation.features import FEATURES_SCHEMA, sample_features
from factory.curation.pipeline import (
    ROW_ORDER,
    CurationResult,
    Judge,
    _judge_input,
    facts_from,
)
from factory.curation.profile import build_profile
from factory.curation.report import pattern_report
from factory.curation.tokens import RenderCounter
from factory.errors import FactoryError

_FACT_COLUMNS = ["sample_id", "empty_reason", "num_tokens", "num_prompt_tokens", "prefix_key",
                 "prompt_key", "format_key", "is_json", "json_cut", "refusal", "truncated",
                 "tool_schema", "agent_loop", "language", "size_bytes"]


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

    from pyspark.sql import SparkSession

    from factory.settings import check_spark_master

    master = check_spark_master(master or f"local[{cores}]")
    if master.startswith("sc://"):
        missing = sorted(pkg for name, pkg in CONNECT_PACKAGES.items() if not _importable(name))
        if missing:
            raise FactoryError(f"Spark Connect ({master}) needs the packages "
                               f"{', '.join(missing)} in this environment")
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


def _features(spark: Any, distinct: Any, config: CurationConfig, tokenizer_dir: str) -> Any:
    """``features.sample_features`` over ``distinct`` in the executors: ``mapInArrow`` on
    Spark Connect, else over the RDD (``mapInArrow`` needs pandas on a classic session, which
    is not a dependency; Spark Connect needs it anyway)."""
    schema = _ddl(FEATURES_SCHEMA)
    if is_connect(spark):
        return distinct.mapInArrow(_feature_batches(config, tokenizer_dir), schema)
    return spark.createDataFrame(distinct.rdd.mapPartitions(_feature_fn(config, tokenizer_dir)),
                                 schema)


def _feature_batches(config: CurationConfig, tokenizer_dir: str
                     ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Partition function over Arrow batches: the input columns in, the features out."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        counter = RenderCounter(tokenizer_dir)
        for batch in batches:
            yield from sample_features(batch, config, counter).to_batches()
    return run


def _feature_fn(config: CurationConfig, tokenizer_dir: str) -> Callable[[Iterator[Any]],
                                                                         Iterator[Any]]:
    """Partition function: Spark rows in, feature tuples out, in Arrow batches of 2,000."""
    names = [f.name for f in FEATURES_SCHEMA]
    batches = _feature_batches(config, tokenizer_dir)

    def run(rows: Iterator[Any]) -> Iterator[tuple[Any, ...]]:
        def chunks() -> Iterator[pa.RecordBatch]:
            chunk: list[dict[str, Any]] = []
            for row in rows:
                d = row.asDict()
                d["tags"] = list((d.get("tags") or {}).items())
                chunk.append(d)
                if len(chunk) >= 2000:
                    yield pa.RecordBatch.from_pylist(chunk, schema=_INPUT)
                    chunk = []
            if chunk:
                yield pa.RecordBatch.from_pylist(chunk, schema=_INPUT)

        for out in batches(chunks()):
            cols = out.to_pydict()
            yield from zip(*(cols[n] for n in names), strict=True)
    return run


_INPUT = pa.schema([("sample_id", pa.string()), ("messages", pa.string()),
                    ("tools", pa.string()), ("tags", pa.map_(pa.string(), pa.string()))])


def curate_spark(spark: Any, samples: Any, config: CurationConfig, tokenizer_dir: str, *,
                 judge: Judge | None = None) -> CurationResult[Any]:
    """Curate ``samples`` (a Spark DataFrame with the ``samples`` columns) on Spark; the
    result's ``train`` and ``eval`` are DataFrames (dataset columns without ``experiment``)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = [F.col(c).asc_nulls_first() for c in ROW_ORDER[1:] if c in samples.columns]
    rows = samples.withColumn("row_rank", F.row_number().over(
        Window.partitionBy("sample_id").orderBy(*order)) - 1).cache()
    num_selected = rows.count()
    distinct = rows.where("row_rank = 0").select("sample_id", "messages", "tools", "tags")
    features = _features(spark, distinct, config, tokenizer_dir).cache()

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
    pairs = pairs.select("x", "y", F.size(F.array_intersect("sx", "sy")).alias("inter"),
                         F.size("sx").alias("nx"), F.size("sy").alias("ny"))
    edges = []
    for r in pairs.collect():
        jac = r["inter"] / (r["nx"] + r["ny"] - r["inter"])
        if jac >= config.near_dup_threshold:
            edges.append((r["x"], r["y"], round(jac, 6)))
    edges.sort()

    facts_table = features.select(*_FACT_COLUMNS).toArrow().sort_by("sample_id")
    row_table = rows.select("sample_id", "raw_trace_id", "row_rank").toArrow()
    facts, row_facts = facts_from(facts_table, row_table)
    groups = split_groups(facts, edges)

    # the split hash in Spark (same integer compare as decide.split_side)
    related = [(s, g) for s, g in groups.items() if s != g]
    group_df = spark.createDataFrame(related or [("", "")], "sample_id string, split_group string")
    sides = features.select("sample_id", "prompt_key", "prompt_ngrams", "shingles") \
        .join(group_df, "sample_id", "left") \
        .withColumn("split_group", F.coalesce("split_group", "sample_id")) \
        .withColumn("h", F.conv(F.substring(F.sha2(F.concat(F.lit(f"{config.seed}:"),
                                                             F.col("split_group")), 256), 1, 15),
                                16, 10).cast("long")) \
        .withColumn("split", F.when(F.col("h") < F.lit(eval_cutoff(config)), "eval")
                    .otherwise("train")).cache()
    ev, tr = sides.where("split = 'eval'"), sides.where("split = 'train'")
    overlaps: dict[str, list[tuple[str, str, float]]] = defaultdict(list)
    hits = tr.where("prompt_key != ''").select("sample_id", "prompt_key").join(
        ev.select(F.col("sample_id").alias("other"), "prompt_key"), "prompt_key")
    for r in hits.select("sample_id", "other").collect():
        overlaps[r["sample_id"]].append(("eval_prompt_match", r["other"], 1.0))
    for kind, column in (("eval_ngram_overlap", "prompt_ngrams"),
                         ("eval_conversation_overlap", "shingles")):
        for r in _weighted_overlaps(sides, column, candidate_floor(kind, config)).collect():
            overlaps[r["t"]].append((kind, r["e"], overlap_share(r["shared"], r["total"])))
    overlaps = {k: sorted(set(v)) for k, v in overlaps.items()}

    judge_scores = None
    if judge is not None:
        def judge_scores(ids: list[str]) -> dict[str, float]:
            wanted = spark.createDataFrame([(i,) for i in ids] or [("",)], "sample_id string")
            got = distinct.join(wanted, "sample_id").select("sample_id", "messages", "tools")
            return {r["sample_id"]: float(judge.score(_judge_input(r)))
                    for r in got.toArrow().to_pylist()}

    decisions = decide(facts=facts, rows=row_facts, near_edges=edges, overlaps=overlaps,
                       config=config, judge_scores=judge_scores, groups=groups)
    kept_ids = sorted(k.rsplit(":", 1)[0] for k in decisions.kept_rows)
    kept_df = spark.createDataFrame([(s,) for s in kept_ids] or [("",)], "sample_id string")
    stats = sides.select("sample_id", "split_group", "split").join(
        features.select("sample_id", "num_tokens", "num_prompt_tokens", "language",
                        "size_bytes"), "sample_id")
    kept = rows.where("row_rank = 0").join(kept_df, "sample_id").join(stats, "sample_id") \
        .withColumn("num_completion_tokens",
                    (F.col("num_tokens") - F.col("num_prompt_tokens")).cast("int")) \
        .withColumn("origin", F.lit(TRAFFIC)) \
        .drop("row_rank")
    train_df = kept.where("split = 'train'").orderBy("sample_id")
    eval_df = kept.where(f"split = '{EVAL}'").orderBy("sample_id")
    prof_cols = ["sample_id", "num_tokens", "num_prompt_tokens", "num_turns", "has_images",
                 "has_tool_calls", "language", "size_bytes"]
    profile = build_profile(train_df.select(*prof_cols).toArrow(),
                            eval_df.select(*prof_cols).toArrow(), decisions.drops,
                            num_selected=num_selected)
    report = pattern_report(facts_table, decisions, config, num_selected=num_selected)
    return CurationResult(train=train_df.drop("size_bytes"), eval=eval_df.drop("size_bytes"),
                          drops=decisions.drops, report=report, profile=profile,
                          num_selected=num_selected, num_clean=decisions.num_clean,
                          clean_lost=dict(decisions.clean_lost))


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


def commit(session: Any, experiment: str, result: CurationResult[Any], staging: str
           ) -> dict[str, Any]:
    """Write the datasets as Parquet with Spark and commit them to the lake with ``add_files``.

    The experiment's previous rows are deleted first (``where experiment = '<name>'``), then the
    new files are added: a version is the pair of snapshots. Drops go through the lake as rows.

    Executors write the files and this process commits them by path, so ``staging`` must be
    the same folder for both (the shared filesystem past ``local``): a ``FactoryError`` when
    the files found there do not hold the rows written.
    """
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from factory.curation.store import experiment_filter
    from factory.tables import TABLES

    flt = experiment_filter(experiment)
    snaps: dict[str, Any] = {}
    for name, df in (("dataset_train", result.train), ("dataset_eval", result.eval)):
        cols = [f.name for f in TABLES[name]]
        out = df.withColumn("experiment", F.lit(experiment)).select(*cols)
        path = f"{staging.rstrip('/')}/{name}/{experiment}-{uuid.uuid4().hex[:12]}"
        out.coalesce(1).write.mode("error").parquet(path)
        spark_files = sorted(str(p) for p in Path(path).glob("*.parquet"))
        found = sum(pq.ParquetFile(f).metadata.num_rows for f in spark_files)
        expected = result.profile["num_train" if name == "dataset_train" else "num_eval"]
        if found != expected:
            raise FactoryError(
                f"Spark wrote {expected} {name} rows under {path} but this process finds "
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
    drops = [{"experiment": experiment, **d} for d in result.drops]
    snaps["dataset_drops"] = session.overwrite("dataset_drops", drops, where=flt)
    return snaps
