"""The Spark engine's profile and trace-pattern report, from aggregates.

``profile.build_profile`` and ``report.pattern_report`` read whole columns; here the same
numbers come from Spark aggregates whose size does not grow with the data: value histograms
for the percentiles (one row per distinct token count), counts per language, reason and
detector pattern, and the first examples of each group. The dataset version hashes every
sample id in order, in one executor. The Markdown is ``pattern_report``'s, line for line (the
equivalence tests hold the two byte-equal).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from factory.curation.config import CurationConfig
from factory.curation.decide import SYNTHETIC
from factory.curation.report import _EXAMPLES, _cell, _pattern, clean_lost_lines, format_section
from factory.curation.spark_decide import map_arrow, udf

_DROP_ORDER = ("sample_id", "step", "trace_key", "row_rank")
_DETECTORS = ("refusal", "truncated", "tool_schema", "agent_loop")


def percentile_higher(histogram: list[tuple[int, int]], q: float) -> int:
    """``np.percentile(values, q, method="higher")`` of the values a sorted (value, count)
    histogram holds: the value at index ceil((n - 1) * q / 100), 0 without values."""
    n = sum(c for _, c in histogram)
    if not n:
        return 0
    k = min(math.ceil((n - 1) * (q / 100)), n - 1)
    seen = 0
    for value, count in histogram:
        seen += count
        if seen > k:
            return int(value)
    raise AssertionError("unreachable: k < n")


def profile_spark(spark: Any, train: Any, ev: Any, drops: Any, *, num_selected: int
                  ) -> dict[str, Any]:
    """``profile.build_profile`` of the train and eval DataFrames and the drops DataFrame."""
    from pyspark.sql import functions as F

    t = train.select((F.col("num_tokens")).alias("total"),
                     F.col("num_prompt_tokens").alias("prompt"),
                     (F.col("num_tokens") - F.col("num_prompt_tokens")).alias("completion"),
                     F.coalesce(F.col("num_turns"), F.lit(0)).alias("turns"),
                     "has_images", "has_tool_calls", "language", "origin", "size_bytes")
    agg = t.agg(F.count("*").alias("n"), F.sum("total").alias("tokens"),
                F.sum("turns").alias("turns"),
                F.sum(F.col("has_images").cast("long")).alias("images"),
                F.sum(F.col("has_tool_calls").cast("long")).alias("tools"),
                F.sum((F.col("origin") == SYNTHETIC).cast("long")).alias("synthetic"),
                F.sum(F.coalesce("size_bytes", F.lit(0))).alias("size")).collect()[0]
    ev_agg = ev.agg(F.count("*").alias("n"),
                    F.sum(F.coalesce("size_bytes", F.lit(0))).alias("size")).collect()[0]
    n = int(agg["n"])
    hist: dict[str, list[tuple[int, int]]] = {c: [] for c in ("total", "prompt", "completion",
                                                             "turns")}
    cols = F.explode(F.array(*[F.struct(F.lit(c).alias("c"), F.col(c).cast("long").alias("v"))
                               for c in hist]))
    for r in t.select(cols.alias("x")).groupBy("x.c", "x.v").count().orderBy("c", "v").collect():
        hist[r["c"]].append((int(r["v"]), int(r["count"])))
    langs = {r["language"]: int(r["count"])
             for r in t.groupBy("language").count().collect()}
    reasons = {r["reason"]: int(r["count"]) for r in drops.groupBy("reason").count().collect()}
    num_dropped = sum(reasons.values())

    def pct(col: str, q: float) -> int:
        return percentile_higher(hist[col], q)

    def top(col: str) -> int:
        return max([0] + [v for v, _ in hist[col]])

    def share(count: Any) -> float:
        return round(int(count or 0) / n, 6) if n else 0.0

    num_synthetic = int(agg["synthetic"] or 0)
    return {
        "dataset_version": dataset_version_spark(spark, train, ev),
        "num_selected": num_selected,
        "num_train": n,
        "num_eval": int(ev_agg["n"]),
        "num_dropped": num_dropped,
        **{f"{name}_tokens_{k}": v for name in ("prompt", "completion", "total")
           for k, v in (("p50", pct(name, 50)), ("p95", pct(name, 95)), ("p99", pct(name, 99)),
                        ("max", top(name)))},
        "num_train_tokens": int(agg["tokens"] or 0),
        "turns_mean": round(float(agg["turns"] or 0) / n, 4) if n else 0.0,
        "turns_p50": pct("turns", 50), "turns_max": top("turns"),
        "share_with_images": share(agg["images"]),
        "share_with_tool_calls": share(agg["tools"]),
        "languages": json.dumps({k: round(v / n, 6) for k, v in sorted(langs.items())}),
        "size_bytes": int(agg["size"] or 0) + int(ev_agg["size"] or 0),
        "drops_by_reason": json.dumps(dict(sorted(reasons.items()))),
        "num_synthetic": num_synthetic,
        "share_synthetic": round(num_synthetic / n, 6) if n else 0.0,
    }


def dataset_version_spark(spark: Any, train: Any, ev: Any) -> str:
    """``profile.dataset_version``: the ids of train then eval, each sorted, hashed in one
    executor (one partition, sorted within it)."""
    from pyspark.sql import functions as F

    ids = train.select(F.lit(0).alias("s"), "sample_id") \
        .unionByName(ev.select(F.lit(1).alias("s"), "sample_id")) \
        .repartition(1).sortWithinPartitions("s", "sample_id")
    schema = pa.schema([("s", pa.int32()), ("sample_id", pa.string())])
    got = map_arrow(spark, ids, _hash_ids, schema, "version string").collect()
    return str(got[0]["version"]) if got else _version_of([])


def _version_of(ids: Iterator[tuple[int, str]] | list[tuple[int, str]]) -> str:
    h = hashlib.sha256()
    h.update(b"train")
    in_eval = False
    for side, sid in ids:
        if side == 1 and not in_eval:
            h.update(b"eval")
            in_eval = True
        h.update(sid.encode())
    if not in_eval:
        h.update(b"eval")
    return h.hexdigest()[:16]


def _hash_ids(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    def ids() -> Iterator[tuple[int, str]]:
        for b in batches:
            yield from zip(b.column("s").to_pylist(), b.column("sample_id").to_pylist(),
                           strict=True)
    yield pa.RecordBatch.from_pydict({"version": [_version_of(ids())]},
                                     schema=pa.schema([("version", pa.string())]))


def report_spark(features: Any, drops: Any, decisions: Any, config: CurationConfig, *,
                 num_selected: int, num_kept: int) -> str:
    """``report.pattern_report`` for the traffic, from aggregates of the features and the
    drops DataFrames (``drops`` with ``row_rank``) and ``SparkDecisions``' counts."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    keyed = drops.withColumn("trace_key", F.coalesce("raw_trace_id", F.lit("")))
    order = [F.col(c) for c in _DROP_ORDER]
    by_group = Window.partitionBy("step", "reason")
    firsts = keyed.withColumn("n", F.row_number().over(by_group.orderBy(*order))) \
        .withColumn("rows", F.count("*").over(by_group)).where(f"n <= {_EXAMPLES}") \
        .orderBy(*order).collect()
    num_drops = sum(int(r["rows"]) for r in firsts if r["n"] == 1)
    groups: dict[tuple[str, str], list[Any]] = {}
    for r in sorted(firsts, key=lambda r: tuple(r[c] for c in _DROP_ORDER)):
        groups.setdefault((r["step"], r["reason"]), []).append(r)
    lines = ["# Trace-pattern report", "",
             f"{num_selected} rows selected, {num_drops} dropped, {num_kept} kept.", "",
             "## Drops by step", "", "| step | reason | rows | examples |", "|---|---|---|---|"]
    for (step, reason), ds in sorted(groups.items(), key=lambda kv: -int(kv[1][0]["rows"])):
        ex = "; ".join(f"`{d['sample_id'][:12]}` {d['detail'] or ''}".strip() for d in ds)
        lines.append(f"| {step} | {reason} | {ds[0]['rows']} | {_cell(ex)} |")
    lines += clean_lost_lines(decisions)
    lines += ["", "## Patterns found (distinct samples, before the drop policy)", ""]
    pattern = udf(_pattern, "string")
    hits = features.select("sample_id", F.explode(F.array(*[
        F.struct(F.lit(d).alias("detector"), F.col(d).alias("detail")) for d in _DETECTORS]))
        .alias("x")).select("sample_id", "x.detector", "x.detail") \
        .where("detail IS NOT NULL AND detail != ''")
    totals = {r["detector"]: int(r["count"]) for r in hits.groupBy("detector").count().collect()}
    pats = hits.withColumn("pattern", pattern("detail")).groupBy("detector", "pattern").agg(
        F.count("*").alias("n"), F.min("sample_id").alias("example"))
    top = pats.withColumn("k", F.row_number().over(Window.partitionBy("detector").orderBy(
        F.col("n").desc(), F.col("example")))).where("k <= 5").orderBy("detector", "k") \
        .collect()
    any_found = False
    for name in _DETECTORS:
        if not totals.get(name):
            continue
        any_found = True
        policy = "dropped" if name in config.drop else "flagged, kept"
        lines.append(f"### {name}: {totals[name]} samples ({policy})")
        for r in (r for r in top if r["detector"] == name):
            lines.append(f"- {r['n']} × {_cell(r['pattern'])} (e.g. `{r['example'][:12]}`)")
        lines.append("")
    fmt = [d for d in firsts if d["reason"] == "format"]
    if fmt:
        any_found = True
        format_section(lines, fmt[0]["rows"], fmt)
    flagged = Counter(decisions.flagged_kept)
    if flagged:
        lines.append("Flagged but kept by policy: " + ", ".join(
            f"{k} {v}" for k, v in sorted(flagged.items())))
    if not any_found:
        lines.append("No refusals, format breaks, truncations or tool failures found.")
    return "\n".join(lines).rstrip() + "\n"
