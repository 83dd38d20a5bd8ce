"""Intervals of eval samples in phrasing clusters: the eval split holds out whole clusters, and a
cluster's samples pass or fail together, so the interval is taken on the effective sample count
of the cluster-robust variance (``selection.cluster_design``). One sample per cluster gives
today's interval exactly; whole clusters passing or failing give the interval of the clusters;
simulated correlated clusters are covered near 95% where the independent interval is not; and
``best_checkpoint`` on a real lake chooses by the clustered interval."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.evals.rubric import Criterion, Rubric
from factory.evals.selection import (
    StepScore,
    cluster_design,
    clusters_needed,
    format_score,
    rank,
    select_best,
    summarize,
    wilson_interval,
)
from factory.lake import Lake
from factory.planner.plan import eval_samples_needed
from tests.evals.conftest import canonical_rows, write_experiment

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")


def _singletons(scores: Sequence[float | None]) -> list[str]:
    return [f"c{i}" for i in range(len(scores))]


@pytest.mark.parametrize("scores", [
    [1.0] * 20, [0.0] * 20, [1.0] * 15 + [0.0] * 5 + [None], [1.0] * 193 + [0.0] * 192,
    [0.2, 0.4, 0.6, 0.8, None], [0.9] * 12])
def test_one_sample_per_cluster_is_today_s_interval_exactly(scores: list[float | None]) -> None:
    alone = summarize(3, scores)
    assert summarize(3, scores, clusters=_singletons(scores)) == alone
    assert alone.num_clusters is None and alone.method in ("wilson", "wilson_graded")
    # A sample whose judge failed does not count toward its cluster: the other one is alone.
    pair = summarize(3, [1.0, None, 0.0, 1.0], clusters=["a", "a", "b", "c"])
    assert pair == summarize(3, [1.0, None, 0.0, 1.0])


def test_known_counts_keep_their_wilson_interval_with_singleton_clusters() -> None:
    for passed, total, low, high in ((20, 20, 0.839, 1.000), (0, 20, 0.000, 0.161),
                                     (15, 20, 0.531, 0.888)):
        scores = [1.0] * passed + [0.0] * (total - passed)
        s = summarize(1, scores, clusters=_singletons(scores))
        assert (round(s.ci_low, 3), round(s.ci_high, 3)) == (low, high)
        assert (s.ci_low, s.ci_high) == wilson_interval(passed, total)
        assert format_score(s).endswith(f"n={total} (Wilson)")


def test_whole_clusters_passing_or_failing_give_the_interval_of_the_clusters() -> None:
    """12 clusters of 5 samples, 9 clusters right throughout and 3 wrong throughout: 60
    samples that tell no more than 12 (Wilson of 9 of 12: [0.468, 0.911], where the 60 taken
    as independent claim [0.628, 0.842])."""
    scores = [1.0] * 45 + [0.0] * 15
    clusters = [f"k{i // 5}" for i in range(60)]
    s = summarize(1, scores, clusters=clusters)
    assert (s.ci_low, s.ci_high) == pytest.approx(wilson_interval(9, 12), abs=1e-12)
    assert (s.num_samples, s.num_clusters, s.method) == (60, 12, "wilson_clustered")
    assert format_score(s) == "0.750 [0.468, 0.911] n=60 in 12 clusters (Wilson, clustered)"
    independent = summarize(1, scores)
    assert (round(independent.ci_low, 3), round(independent.ci_high, 3)) == (0.628, 0.842)
    design = cluster_design(scores, clusters)
    assert (design.design_effect, design.num_clusters, design.cluster_size) == \
        (pytest.approx(5.0), 12, 5.0)
    # Graded: clusters of equal scores give the graded interval of one score per cluster.
    per = [0.2, 0.5, 0.9, 0.7, 1.0, 0.4]
    g = summarize(1, [x for x in per for _ in range(4)],
                  clusters=[f"k{i}" for i in range(6) for _ in range(4)])
    one = summarize(1, per)
    assert (g.ci_low, g.ci_high) == pytest.approx((one.ci_low, one.ci_high), abs=1e-12)
    assert g.method == "wilson_graded_clustered" and g.num_clusters == 6
    # Failures spread one to a cluster: no correlation to correct for, the interval is the
    # independent one (a design effect below 1 is not used to narrow it).
    spread = [0.0 if i % 5 == 0 else 1.0 for i in range(60)]
    t = summarize(1, spread, clusters=clusters)
    assert (t.ci_low, t.ci_high) == pytest.approx(wilson_interval(48, 60), abs=1e-12)
    assert format_score(t).endswith("n=60 in 12 clusters (Wilson, clustered)")


def test_bad_cluster_ids_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="2 cluster ids for 3 scores; pass one cluster id per"):
        summarize(1, [1.0, 0.0, None], clusters=["a", "b"])


def _clustered_draw(rng: random.Random, *, mean: float, icc: float, num_clusters: int,
                    size: int) -> tuple[list[float | None], list[str]]:
    """0/1 scores of ``num_clusters`` clusters of ``size``: each cluster's pass rate is drawn
    from a Beta of mean ``mean`` whose intraclass correlation is ``icc`` (1 / (a + b + 1))."""
    a, b = mean * (1 - icc) / icc, (1 - mean) * (1 - icc) / icc
    scores: list[float | None] = []
    clusters = []
    for c in range(num_clusters):
        rate = rng.betavariate(a, b)
        scores += [float(rng.random() < rate) for _ in range(size)]
        clusters += [f"k{c}"] * size
    return scores, clusters


def test_the_clustered_interval_keeps_near_95_percent_where_the_independent_one_does_not(
        ) -> None:
    """What ``cluster_design``'s docstring reports, on a few of its cells (300 seeded draws
    each): clusters correlated at ICC 0.3 hold the true mean 0.90-0.97 of the time in the
    clustered interval (0.93 on average), 0.67-0.87 in the independent one (0.76)."""
    covered: dict[tuple[int, int, float], tuple[float, float]] = {}
    for num_clusters, size in ((20, 5), (30, 10)):
        for mean in (0.5, 0.8):
            rng = random.Random(7)
            hits_independent = hits_clustered = 0
            for _ in range(300):
                scores, clusters = _clustered_draw(rng, mean=mean, icc=0.3,
                                                   num_clusters=num_clusters, size=size)
                a, b = summarize(1, scores), summarize(1, scores, clusters=clusters)
                hits_independent += a.ci_low <= mean <= a.ci_high
                hits_clustered += b.ci_low <= mean <= b.ci_high
            covered[(num_clusters, size, mean)] = (hits_independent / 300, hits_clustered / 300)
    print(covered)
    for independent, clustered in covered.values():
        assert clustered >= 0.89 and independent <= 0.88
        assert clustered - independent >= 0.1
    assert sum(c for _, c in covered.values()) / len(covered) >= 0.92
    assert sum(i for i, _ in covered.values()) / len(covered) <= 0.8


def test_clusters_needed_for_the_precision_of_the_planned_samples() -> None:
    n = eval_samples_needed()
    assert n == 385
    assert clusters_needed(n, cluster_size=1, icc=0.5) == 385  # singletons: samples
    assert clusters_needed(n, cluster_size=5, icc=0.0) == 77   # independent: 385 samples
    assert clusters_needed(n, cluster_size=5, icc=0.3) == 170  # 850 samples
    assert clusters_needed(n, cluster_size=10, icc=0.3) == 143
    assert clusters_needed(n, cluster_size=10, icc=1.0) == 385  # a cluster is one sample
    # The ICC read back from scores: whole clusters passing or failing is an ICC of 1.
    design = cluster_design([1.0] * 45 + [0.0] * 15, [f"k{i // 5}" for i in range(60)])
    assert design.icc == pytest.approx(1.0)
    assert cluster_design([1.0, 0.0], ["a", "b"]).icc == 0.0
    with pytest.raises(ValueError, match="icc"):
        clusters_needed(n, cluster_size=5, icc=1.5)
    with pytest.raises(ValueError, match="cluster_size"):
        clusters_needed(n, cluster_size=0.5, icc=0.1)


def _table() -> tuple[dict[int, list[float | None]], dict[int, list[str]]]:
    """100 eval samples in 20 clusters of 5. Step 10 is right on 90, its 10 failures two whole
    clusters; step 20 on 85, its failures one each in 15 clusters."""
    clusters = [f"k{i // 5:02d}" for i in range(100)]
    step10: list[float | None] = [0.0 if i < 10 else 1.0 for i in range(100)]
    step20: list[float | None] = [0.0 if i % 5 == 0 and i < 75 else 1.0 for i in range(100)]
    return {10: step10, 20: step20}, {10: clusters, 20: clusters}


def test_selection_by_the_clustered_interval_on_a_fixed_score_table() -> None:
    """Taken as independent, step 10 (90 of 100) wins on its lower bound 0.826; its failures
    are two whole clusters of 20, and its clustered interval is that of 18 of 20 clusters
    ([0.699, 0.972]), below step 20's 85 of 100 with failures spread ([0.767, 0.907])."""
    scores, clusters = _table()
    assert select_best(scores).step == 10
    best = select_best(scores, clusters=clusters)
    assert best.step == 20 and best.mean == pytest.approx(0.85)
    summaries = [summarize(s, scores[s], clusters=clusters[s]) for s in (10, 20)]
    assert (summaries[0].ci_low, summaries[0].ci_high) == pytest.approx(wilson_interval(18, 20))
    assert rank([(s, None) for s in summaries]) == (
        1, "the 95% interval's lower bound 0.767, the highest (next 0.699)")


RUBRIC = Rubric(criteria=(Criterion(name="label", description="the right label",
                                    check="label_match"),))
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def test_best_checkpoint_chooses_by_the_clustered_interval(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eval set's rows carry their phrasing cluster (``split_group``); ``best_checkpoint``
    reads them with the scores and chooses step 20 of ``_table``, where the same scores taken
    as independent would choose step 10; the asset page shows the clusters."""
    from factory.assets.evals import best_checkpoint
    from factory.resources.lake import LakeResource

    write_experiment(factory_home, monkeypatch,
                     'name: support\ndata: {where: "true"}\nrecipe: smollm2-135m-lora\n')
    scores, clusters = _table()
    rows = canonical_rows(100, seed=5)
    for row, cluster in zip(rows, clusters[10], strict=True):
        row["split_group"] = cluster
    lake = Lake()
    lake.append("dataset_eval", rows)
    lake.append("rubrics", [{"experiment": "support", "version": RUBRIC.version,
                             "source": "inline", "num_examples": 4,
                             "rubric": json.dumps(RUBRIC.to_dict()), "created_at": T0}])
    score_rows: list[dict[str, Any]] = [
        {"run_id": "r1", "experiment": "support", "step": step, "kind": "checkpoint",
         "checkpoint_path": f"/ckpt/r1/{step}", "rubric_version": RUBRIC.version,
         "sample_id": row["sample_id"], "response": "x", "score": score, "status": "ok",
         "judge": "code", "evaluated_at": T0}
        for step, values in scores.items() for row, score in zip(rows, values, strict=True)]
    lake.append("eval_scores", score_rows)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", ["support"])
    result = dg.materialize([best_checkpoint], instance=instance, partition_key="support",
                            resources={"lake": LakeResource()})
    assert result.success
    [row] = lake.read("best_checkpoints").to_pylist()
    assert (row["step"], row["num_samples"], row["ci_method"]) == (20, 100, "wilson_clustered")
    meta = result.asset_materializations_for_node("best_checkpoint")[0].metadata
    assert meta["decided_by"].value == \
        "the 95% interval's lower bound 0.767, the highest (next 0.699)"
    assert str(meta["score"].value).startswith(
        "0.850 [0.767, 0.907] n=100 in 20 clusters (Wilson, clustered)")
    # The row keeps the clusters, so `factory run` and the app print them back from it; the
    # score curve beside it is clustered too.
    assert row["num_clusters"] == 20 and meta["num_clusters"].value == 20
    assert format_score(StepScore.from_row(row)) == \
        "0.850 [0.767, 0.907] n=100 in 20 clusters (Wilson, clustered)"
    curve = str(meta["score_curve"].value)
    assert "| 10 | 0.900 [0.699, 0.972] n=100 in 20 clusters (Wilson, clustered) |" in curve
