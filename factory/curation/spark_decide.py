"""``decide`` as Spark queries: split groups, the cleaning steps and the drops as DataFrames.

The Spark engine (``factory.curation.spark``) hands this module its per-sample features, the
rows with their keep rank and the verified near-duplicate edges, all DataFrames; nothing here
collects rows to the driver. The rules are ``factory.curation.decide``'s, step by step:

- split groups are the connected components of the near-duplicate, same-trace and same
  first-user-turn links (``components``: min-label propagation with pointer jumping,
  checkpointed each round), named by their smallest sample id; the side is the group's hash;
- the cleaning steps are filters in ``decide``'s order; the eval side is finished first and
  train is decontaminated against the final eval set;
- each detail string is built in the executors by ``decide``'s own helpers (Python UDFs), so
  the texts and the rounding are the embedded engine's;
- the judge scores the surviving samples in the executors (the judge object is shipped there).

The traffic is curated alone: the Spark engine does not take synthetic samples.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import reduce
from typing import Any

import pyarrow as pa

from factory.curation import detectors
from factory.curation.config import DETECTOR_NAMES, CurationConfig
from factory.curation.decide import (
    EVAL,
    OVERLAP_KINDS,
    PREFIX,
    TRACE,
    TRAFFIC,
    TRAIN,
    duplicate_detail,
    eval_cutoff,
    judge_detail,
    near_dup_detail,
    overlap_detail,
    overlap_share,
    threshold,
    too_long_detail,
)

DROP_COLUMNS = ["sample_id", "raw_trace_id", "split", "step", "reason", "detail", "origin"]
"""Columns of a drop, as ``decide`` writes them."""

_FLAG_COLUMNS = ("refusal", "truncated", "tool_schema", "agent_loop")


@dataclass(kw_only=True)
class SparkDecisions:
    """What the steps decided, as DataFrames and small aggregates."""

    sides: Any
    """DataFrame (sample_id, split_group, split) of every distinct sample."""
    kept: Any
    """DataFrame (sample_id) of the samples whose first row ends in a dataset."""
    drops: Any
    """DataFrame of ``DROP_COLUMNS`` plus ``row_rank``, one per dropped row, unordered."""
    num_clean: int
    """``Decisions.num_clean``."""
    clean_lost: dict[str, int]
    """``Decisions.clean_lost``."""
    flagged_kept: dict[str, int]
    """``Decisions.flagged_kept``."""


def components(edges: Any) -> Any:
    """(node, root) for every node of the (src, dst) edges: root is the smallest node of its
    connected component.

    Each round takes the smallest label among a node's neighbours, then the label of that
    label (pointer jumping: a chain of length d settles in about log2(d) rounds, where plain
    propagation takes d); labels only decrease and are always nodes of the same component,
    so a round that changes nothing leaves every component labelled by its minimum. Each
    round's labels are checkpointed (``localCheckpoint``) so the plan does not grow.
    """
    from pyspark.sql import functions as F

    und = edges.select("src", "dst").union(edges.select(F.col("dst").alias("src"),
                                                        F.col("src").alias("dst"))) \
        .where("src != dst").distinct().localCheckpoint()
    labels = und.select(F.col("src").alias("node")).distinct() \
        .withColumn("label", F.col("node"))
    while True:
        nb = und.join(labels.select(F.col("node").alias("dst"), F.col("label").alias("nl")),
                      "dst").groupBy(F.col("src").alias("node")).agg(F.min("nl").alias("nb"))
        step = labels.join(nb, "node").select("node", F.least("label", "nb").alias("label"))
        hop = step.alias("a").join(step.alias("b"), F.col("a.label") == F.col("b.node")) \
            .select(F.col("a.node").alias("node"),
                    F.least(F.col("a.label"), F.col("b.label")).alias("label"))
        new = hop.localCheckpoint()
        changed = new.join(labels.withColumnRenamed("label", "old"), "node") \
            .where("label != old").count()
        labels = new
        if not changed:
            return labels.withColumnRenamed("label", "root")


def split_sides(features: Any, rows: Any, edges: Any, config: CurationConfig) -> Any:
    """(sample_id, split_group, split): ``decide.split_groups`` and ``decide.split_side``.

    A trace and a first user turn are nodes of the graph (``TRACE``/``PREFIX`` + key, which
    sort after every sample id), linked to the samples holding them.
    """
    from pyspark.sql import functions as F

    links = edges.select(F.col("x").alias("src"), F.col("y").alias("dst")) \
        .union(rows.where("raw_trace_id IS NOT NULL AND raw_trace_id != ''").select(
            F.col("sample_id").alias("src"), F.concat(F.lit(TRACE), "raw_trace_id").alias("dst"))) \
        .union(features.where("prefix_key != ''").select(
            F.col("sample_id").alias("src"), F.concat(F.lit(PREFIX), "prefix_key").alias("dst")))
    roots = components(links)
    groups = features.select("sample_id").join(
        roots.select(F.col("node").alias("sample_id"), "root"), "sample_id", "left") \
        .select("sample_id", F.coalesce("root", "sample_id").alias("split_group"))
    h = F.conv(F.substring(F.sha2(F.concat(F.lit(f"{config.seed}:"), F.col("split_group")),
                                  256), 1, 15), 16, 10).cast("long")
    return groups.withColumn("split", F.when(h < F.lit(eval_cutoff(config)), EVAL)
                             .otherwise(TRAIN))


def format_flags(features: Any) -> Any:
    """(sample_id, format): ``decide.format_flags`` by a group aggregate per format key, the
    flag from ``detectors.format_flag`` (null when it does not fire)."""
    from pyspark.sql import functions as F

    groups = features.groupBy("format_key").agg(
        F.count("*").alias("size"), F.sum(F.col("is_json").cast("long")).alias("num_json"))
    flag = udf(lambda is_json, cut, share, size: detectors.format_flag(
        bool(is_json), bool(cut), share, size), "string")
    return features.join(groups, "format_key").select(
        "sample_id", flag("is_json", "json_cut", F.col("num_json") / F.col("size"),
                          "size").alias("format"))


def decide_spark(spark: Any, *, features: Any, rows: Any, edges: Any, overlaps: Any,
                 sides: Any, config: CurationConfig,
                 judge_scores: Callable[[Any], Any] | None = None) -> SparkDecisions:
    """``decide`` over DataFrames.

    ``features``: ``FEATURES_SCHEMA`` columns; ``rows``: (sample_id, raw_trace_id, row_rank)
    of every selected row; ``edges``: (x, y, jac) verified near-duplicate pairs (x < y,
    unrounded Jaccard); ``overlaps``: (t, kind, e, share) train-candidate x eval-side pairs
    (``decide``'s ``overlaps``); ``sides``: ``split_sides``; ``judge_scores``: DataFrame of
    sample ids -> DataFrame (sample_id, score), computed in the executors.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    def nonempty(c: str) -> Any:
        return F.coalesce(F.col(c), F.lit("")) != ""

    fmt = format_flags(features)
    samples = features.select("sample_id", "empty_reason", "num_tokens", *_FLAG_COLUMNS) \
        .join(fmt, "sample_id").join(sides, "sample_id").cache()
    row_side = rows.select("sample_id", "raw_trace_id", "row_rank") \
        .join(sides.select("sample_id", "split"), "sample_id").cache()
    first_row = row_side.where("row_rank = 0")

    drop_parts: list[Any] = []

    def drop(which: Any, step: str, reason: Any, detail: Any, *, all_rows: bool) -> None:
        """Drop the samples of ``which`` (with sample_id) at ``step``: every row of each
        before the exact-duplicate step, its first row after it."""
        picked = which.select("sample_id", reason.alias("reason"), detail.alias("detail"))
        on = row_side if all_rows else first_row
        drop_parts.append(on.join(picked, "sample_id").select(
            "sample_id", "raw_trace_id", "split", F.lit(step).alias("step"), "reason",
            "detail", F.lit(TRAFFIC).alias("origin"), "row_rank"))

    # 1. nothing to learn from
    empty = samples.where(nonempty("empty_reason"))
    drop(empty, "empty", F.col("empty_reason"), F.lit(None).cast("string"), all_rows=True)
    alive = samples.where(~nonempty("empty_reason"))
    # 2. too long for the base model
    too_long = alive.where(F.col("num_tokens") > config.max_tokens)
    long_detail = udf(lambda n: too_long_detail(n, config), "string")
    drop(too_long, "max_tokens", F.lit("too_long"), long_detail("num_tokens"), all_rows=True)
    alive = alive.where(F.col("num_tokens") <= config.max_tokens).cache()
    # 3. exact duplicates: the rows past the first
    dup_detail = udf(duplicate_detail, "string")
    extra = row_side.where("row_rank > 0").join(alive.select("sample_id"), "sample_id") \
        .join(first_row.select("sample_id", F.col("raw_trace_id").alias("kept_trace")),
              "sample_id")
    drop_parts.append(extra.select(
        "sample_id", "raw_trace_id", "split", F.lit("exact_dup").alias("step"),
        F.lit("duplicate").alias("reason"), dup_detail("kept_trace").alias("detail"),
        F.lit(TRAFFIC).alias("origin"), "row_rank"))
    # 4. near duplicates: one sample per cluster of live edges (edges never cross sides)
    ids = alive.select("sample_id")
    live = edges.join(ids.withColumnRenamed("sample_id", "x"), "x") \
        .join(ids.withColumnRenamed("sample_id", "y"), "y").cache()
    roots = components(live.select(F.col("x").alias("src"), F.col("y").alias("dst")))
    best = live.select(F.col("x").alias("sample_id"), "jac") \
        .union(live.select(F.col("y").alias("sample_id"), "jac")) \
        .groupBy("sample_id").agg(F.max("jac").alias("best"))
    near = roots.where("root != node").select(F.col("node").alias("sample_id"), "root") \
        .join(best, "sample_id").cache()
    nd_detail = udf(lambda root, jac: near_dup_detail(root, round(jac, 6)), "string")
    drop(near, "near_dup", F.lit("near_duplicate"), nd_detail("root", "best"), all_rows=False)
    alive = alive.join(near.select("sample_id"), "sample_id", "left_anti").cache()

    def flagged(df: Any) -> tuple[Any, Any]:
        """6. detectors by policy: (survivors, drops with reason and detail)."""
        dropping = [d for d in DETECTOR_NAMES if d in config.drop]
        first = F.coalesce(*[F.when(nonempty(d), F.lit(d)) for d in dropping]) if dropping \
            else F.lit(None).cast("string")
        detail = F.coalesce(*[F.when(nonempty(d), F.col(d)) for d in dropping]) if dropping \
            else F.lit(None).cast("string")
        marked = df.withColumn("flag", first).withColumn("flag_detail", detail)
        return marked.where("flag IS NULL").drop("flag", "flag_detail"), \
            marked.where("flag IS NOT NULL")

    def judged(df: Any) -> tuple[Any, Any]:
        """7. rejection sampling: (survivors, drops with score)."""
        if config.judge_threshold is None:
            return df, None
        if judge_scores is None:
            raise ValueError("judge_threshold is set but no judge is configured")
        scored = df.join(judge_scores(df.select("sample_id")), "sample_id").cache()
        return scored.where(F.col("score") >= config.judge_threshold).drop("score"), \
            scored.where(F.col("score") < config.judge_threshold)

    reaching: list[Any] = []  # the samples that reach the detectors step, per side

    def finish(df: Any) -> Any:
        reaching.append(df)
        kept, flag_drops = flagged(df)
        drop(flag_drops, "detectors", F.col("flag"), F.col("flag_detail"), all_rows=False)
        kept, judge_drops = judged(kept)
        if judge_drops is not None:
            at = config.judge_threshold
            assert at is not None
            jd = udf(lambda score: judge_detail(score, at), "string")
            drop(judge_drops, "judge", F.lit("judge_below_threshold"), jd("score"),
                 all_rows=False)
        return kept.select("sample_id").localCheckpoint()

    final_eval = finish(alive.where(F.col("split") == EVAL))
    # 5. decontamination of train against the final eval set
    train = alive.where(F.col("split") == TRAIN)
    order = F.create_map(*[x for i, k in enumerate(OVERLAP_KINDS) for x in (F.lit(k), F.lit(i))])
    bar = F.create_map(*[x for k in OVERLAP_KINDS for x in (F.lit(k), F.lit(threshold(k, config)))])
    hits = overlaps.where(F.col("share") >= bar[F.col("kind")]) \
        .join(final_eval.withColumnRenamed("sample_id", "e"), "e") \
        .join(train.select(F.col("sample_id").alias("t")), "t") \
        .withColumn("n", F.row_number().over(Window.partitionBy("t").orderBy(
            order[F.col("kind")], F.col("share").desc(), F.col("e")))) \
        .where("n = 1").select(F.col("t").alias("sample_id"), "kind", "e", "share") \
        .localCheckpoint()  # read by the drops and by the train side's survivors
    ov_detail = udf(lambda kind, share, e: overlap_detail(kind, share, e, config), "string")
    drop(hits, "decontamination", F.col("kind"), ov_detail("kind", "share", "e"),
         all_rows=False)
    final_train = finish(train.join(hits.select("sample_id"), "sample_id", "left_anti"))

    drops = drop_parts[0]
    for part in drop_parts[1:]:
        drops = drops.unionByName(part)
    drops = drops.localCheckpoint()
    wrong = reduce(operator.or_, [nonempty(c) for c in ("empty_reason", "format",
                                                        *_FLAG_COLUMNS)])
    clean = samples.where(~wrong)
    num_clean = clean.count()
    lost = drops.where("step != 'exact_dup'").select("sample_id", "reason").distinct() \
        .join(clean.select("sample_id"), "sample_id").groupBy("reason").count().collect()
    kept_flags = [d for d in DETECTOR_NAMES if d not in config.drop]
    flagged_kept: dict[str, int] = {}
    if kept_flags:
        counts = reaching[0].unionByName(reaching[1]).select(*[F.sum(nonempty(d).cast("long")).alias(d)
                                   for d in kept_flags]).collect()[0]
        flagged_kept = {d: int(counts[d]) for d in kept_flags if counts[d]}
    return SparkDecisions(sides=sides, kept=final_eval.unionByName(final_train),
                          drops=drops, num_clean=num_clean,
                          clean_lost={r["reason"]: int(r["count"]) for r in lost},
                          flagged_kept=flagged_kept)


def overlap_shares(pairs: Any, kind: str) -> Any:
    """(t, kind, e, share) from ``_weighted_overlaps``' (t, e, shared, total): the share by
    ``decide.overlap_share`` in the executors."""
    from pyspark.sql import functions as F

    share = udf(overlap_share, "double")
    return pairs.select("t", F.lit(kind).alias("kind"), "e",
                        share("shared", "total").alias("share"))


def udf(fn: Callable[..., Any], return_type: str) -> Any:
    """A row-at-a-time Python UDF (the Arrow-batched kind needs pandas, not a dependency)."""
    from pyspark.sql import functions as F

    return F.udf(fn, return_type, useArrow=False)


def map_arrow(spark: Any, df: Any, fn: Callable[[Iterator[pa.RecordBatch]],
                                                Iterator[pa.RecordBatch]],
              schema: pa.Schema, ddl: str, *, batch_rows: int = 2000) -> Any:
    """``fn`` over ``df``'s partitions as Arrow batches, in the executors: ``mapInArrow`` on
    Spark Connect; over the RDD on a classic session (``mapInArrow`` needs pandas there, which
    is not a dependency). Map columns arrive as lists of (key, value)."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        return df.mapInArrow(fn, ddl)
    def run(rows: Iterator[Any]) -> Iterator[tuple[Any, ...]]:
        def batches() -> Iterator[pa.RecordBatch]:
            chunk: list[dict[str, Any]] = []
            for row in rows:
                d = row.asDict()
                chunk.append({k: list(v.items()) if isinstance(v, dict) else v
                              for k, v in d.items()})
                if len(chunk) >= batch_rows:
                    yield pa.RecordBatch.from_pylist(chunk, schema=schema)
                    chunk = []
            if chunk:
                yield pa.RecordBatch.from_pylist(chunk, schema=schema)

        for out in fn(batches()):
            cols = out.to_pydict()
            yield from zip(*cols.values(), strict=True)

    return spark.createDataFrame(df.rdd.mapPartitions(run), ddl)
