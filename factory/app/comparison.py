"""The figures of the comparison page (``factory compare``), read from the lake: per experiment
and candidate version, agreement and mean judge score over time, latency p50/p95 and estimated
cost per 1,000 requests of both sides, and the worst-scored pairs (``shadow_pairs``,
``shadow_scores``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from factory.app.charts import Bucket, buckets
from factory.app.costs import Costs, Prices, costs
from factory.deploy import Deployer
from factory.deploy.deployer import CANDIDATE
from factory.evals.shadow import LATEST_SCORES, ShadowSummary, summarize
from factory.gateway.shadow import load_shadows
from factory.lake import Lake

NUM_WORST = 10


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Everything the experiment page shows about one candidate version."""

    experiment: str
    version: str | None
    versions: list[tuple[str, int]]
    """Every candidate version with pairs, newest first, and its number of pairs."""
    summary: ShadowSummary
    routes: list[str]
    buckets: list[Bucket]
    bucket_label: str
    latency: dict[str, tuple[float | None, float | None]]
    """``frontier`` / ``candidate`` -> (p50 ms, p95 ms)."""
    num_latency: dict[str, int]
    costs: Costs
    worst: list[dict[str, Any]]


def _aware(t: datetime) -> datetime:
    """``t`` with UTC as its zone when it has none."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def pair_versions(lake: Lake, experiment: str) -> list[tuple[str, int]]:
    if not lake.exists("shadow_pairs"):
        return []
    rows = lake.sql("SELECT version, count(*) AS n, max(created_at) AS newest FROM shadow_pairs "
                    "WHERE experiment = ? GROUP BY version ORDER BY newest DESC",
                    [experiment]).to_pylist()
    return [(r["version"], int(r["n"])) for r in rows]


def compare(lake: Lake, experiment: str, version: str | None, prices: Prices) -> Comparison:
    """The figures of ``experiment``'s pairs of candidate ``version`` (None: every version)."""
    versions = pair_versions(lake, experiment)
    summary = summarize(lake, experiment, version)
    rows: list[dict[str, Any]] = []
    worst: list[dict[str, Any]] = []
    if versions:
        where, params = "p.experiment = ?", [experiment]
        if version is not None:
            where, params = where + " AND p.version = ?", params + [version]
        columns = ("p.pair_id, p.route, p.created_at, p.frontier_latency_ms, "
                   "p.candidate_latency_ms, p.frontier_prompt_tokens, "
                   "p.frontier_completion_tokens, p.candidate_message IS NOT NULL AS answered")
        if lake.exists("shadow_scores"):
            rows = lake.sql(f"SELECT {columns}, s.score, s.passed FROM shadow_pairs p LEFT JOIN "
                            f"{LATEST_SCORES} s USING (pair_id) WHERE {where}",
                            [experiment, *params]).to_pylist()
            worst = lake.sql(
                f"SELECT p.*, s.score, s.passed, s.assessment, s.judge FROM shadow_pairs p JOIN "
                f"{LATEST_SCORES} s USING (pair_id) WHERE {where} "
                f"ORDER BY s.score ASC, p.created_at DESC LIMIT {NUM_WORST}",
                [experiment, *params]).to_pylist()
        else:
            rows = lake.sql(f"SELECT {columns}, NULL AS score, NULL AS passed "
                            f"FROM shadow_pairs p WHERE {where}", params).to_pylist()
    scored = [(_aware(r["created_at"]), float(r["score"]), bool(r["passed"]))
              for r in rows if r["score"] is not None]
    chart, label = buckets(scored)
    frontier_ms = [r["frontier_latency_ms"] for r in rows if r["frontier_latency_ms"] is not None]
    candidate_ms = [r["candidate_latency_ms"] for r in rows
                    if r["answered"] and r["candidate_latency_ms"] is not None]
    return Comparison(
        experiment=experiment, version=version, versions=versions, summary=summary,
        routes=sorted({r["route"] for r in rows if r["route"]}), buckets=chart, bucket_label=label,
        latency={"frontier": (percentile(frontier_ms, 0.5), percentile(frontier_ms, 0.95)),
                 "candidate": (percentile(candidate_ms, 0.5), percentile(candidate_ms, 0.95))},
        num_latency={"frontier": len(frontier_ms), "candidate": len(candidate_ms)},
        costs=costs(rows, prices), worst=worst)


def experiments(lake: Lake) -> list[dict[str, Any]]:
    """Experiments with shadow pairs, a shadow rule or a candidate: name, pairs, summary."""
    names: set[str] = set()
    pairs: dict[str, int] = {}
    if lake.exists("shadow_pairs"):
        for r in lake.sql("SELECT experiment, count(*) AS n FROM shadow_pairs "
                          "GROUP BY experiment").to_pylist():
            pairs[r["experiment"]] = int(r["n"])
    names |= set(pairs)
    names |= {rule.experiment for rule in load_shadows(lake).values()}
    names |= {d.name for d in Deployer(lake).versions() if d.status == CANDIDATE}
    out = []
    for name in sorted(names):
        versions = pair_versions(lake, name)
        newest = versions[0][0] if versions else None
        out.append({"experiment": name, "num_pairs": pairs.get(name, 0), "version": newest,
                    "summary": summarize(lake, name, newest)})
    return out


def known(lake: Lake, experiment: str) -> bool:
    if pair_versions(lake, experiment):
        return True
    if any(rule.experiment == experiment for rule in load_shadows(lake).values()):
        return True
    return bool(Deployer(lake).versions(experiment))
