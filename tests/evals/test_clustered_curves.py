"""Clustered intervals past the choice of a checkpoint: the early stop reads each curve's samples
with their phrasing clusters (``dataset_eval.split_group``) and stops by the clustered interval,
and shadow pairs asked the same way count as one cluster in the agreement that promotes a
candidate."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from factory.assets.shadow import phrasing_of
from factory.evals.judges import EmbeddedJudge
from factory.evals.report import read_curves, record_early_stop
from factory.evals.rubric import Criterion, Rubric
from factory.evals.selection import StepScore, decide_stop, format_score, wilson_interval
from factory.evals.shadow import ShadowSummary, score_pairs, summarize
from factory.lake import Lake
from tests.evals.conftest import canonical_rows

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

T0 = datetime(2026, 12, 1, tzinfo=UTC)
CLUSTERS = [f"k{i // 5:02d}" for i in range(100)]
"""100 eval samples in 20 phrasing clusters of 5."""


def _curve() -> dict[int, list[float | None]]:
    """Step 10 is right on 80 of 100, its 20 failures four whole clusters; steps 20, 30 and 40
    on 88, their failures one each in 12 clusters. Taken as independent, 0.88 is above step
    10's interval ([0.711, 0.867]) and training goes on; in clusters step 10 is 16 of 20
    ([0.584, 0.919]): the rise is within its noise, and the run has plateaued."""
    later: list[float | None] = [0.0 if i % 5 == 0 and i < 60 else 1.0 for i in range(100)]
    return {10: [0.0 if i < 20 else 1.0 for i in range(100)], 20: later, 30: list(later),
            40: list(later)}


def test_the_plateau_rule_reads_the_clustered_interval_on_a_fixed_table() -> None:
    scores = _curve()
    assert decide_stop(scores) is None
    stop = decide_stop(scores, clusters={s: CLUSTERS for s in scores})
    assert stop is not None and stop.rule == "plateau"
    assert (stop.peak_step, stop.last_step) == (20, 40)
    assert "(steps 20, 30, 40)" in stop.reason
    assert stop.reason.endswith("n=100 in 20 clusters (Wilson, clustered))")


def _scores(run_id: str, sample_ids: list[str]) -> list[dict[str, Any]]:
    return [{"run_id": run_id, "experiment": "support", "step": step, "kind": "checkpoint",
             "checkpoint_path": f"/ckpt/{run_id}/{step}", "rubric_version": "r1",
             "sample_id": sid, "response": "x", "score": score, "status": "ok",
             "judge": "code", "evaluated_at": T0}
            for step, values in _curve().items()
            for sid, score in zip(sample_ids, values, strict=True)]


def test_record_early_stop_reads_the_eval_set_s_clusters(factory_home: Path) -> None:
    """``record_early_stop`` (what ``checkpoint_evals`` calls after each score) stops run r1,
    whose samples are in the eval set with their phrasing clusters; run r2 has the same scores
    on samples the eval set no longer holds (each its own cluster) and trains on."""
    rows = canonical_rows(100, seed=5)
    for row, cluster in zip(rows, CLUSTERS, strict=True):
        row["split_group"] = cluster
    lake = Lake()
    lake.append("dataset_eval", rows)
    lake.append("eval_scores", _scores("r1", [r["sample_id"] for r in rows])
                + _scores("r2", [f"gone-{i:03d}" for i in range(100)]))

    curves = read_curves(lake, "r1")
    assert curves.clusters[10] == CLUSTERS and curves.samples[10] == _curve()[10]
    assert format_score(curves.summary(10)) == \
        "0.800 [0.584, 0.919] n=100 in 20 clusters (Wilson, clustered)"
    _, stop = record_early_stop(lake, "r1", "support")
    assert stop is not None and stop.rule == "plateau"
    _, none = record_early_stop(lake, "r2", "support")
    assert none is None
    assert format_score(read_curves(lake, "r2").summary(10)) == \
        "0.800 [0.711, 0.867] n=100 (Wilson)"
    [row] = lake.read("early_stops").to_pylist()
    assert (row["run_id"], row["peak_step"], row["last_step"]) == ("r1", 20, 40)
    assert "plateaued" in row["reason"]


def test_a_stored_score_with_no_clusters_prints_none() -> None:
    """``checkpoint_evals`` writes ``num_clusters`` 0 where every sample counts alone."""
    row = {"mean_score": 0.75, "ci_low": 0.531, "ci_high": 0.888, "num_samples": 20,
           "ci_method": "wilson", "num_clusters": 0}
    assert StepScore.from_row(row).num_clusters is None
    assert format_score(StepScore.from_row(row)) == "0.750 [0.531, 0.888] n=20 (Wilson)"


LABELS = Rubric(criteria=(Criterion(name="label", description="the same label",
                                    check="label_match",
                                    params={"labels": ["billing", "bug", "other"]}),))
PHRASINGS = ("my card was charged twice for order", "please refund the duplicate payment on",
             "why did you bill me again for invoice", "i see two charges for subscription",
             "the app crashes when i open ticket", "cancel my plan and refund account",
             "what is the status of my claim", "how do i update the card on file for")
"""Eight ways of asking; each pair fills one with its own number, which the skeleton masks."""


def _message(text: str) -> str:
    return json.dumps({"role": "assistant", "content": [{"type": "text", "text": text}]})


def _pairs() -> list[dict[str, Any]]:
    """40 pairs, 5 asked each way; the candidate gets every pair of the first way wrong."""
    return [{"pair_id": f"p{i:02d}", "experiment": "triage", "version": "v1", "route": "gpt",
             "request": json.dumps({"model": "gpt", "messages": [
                 {"role": "system", "content": "You triage tickets."},
                 {"role": "user", "content": f"{PHRASINGS[i // 5]} {4000 + 17 * i}"}]}),
             "frontier_message": _message("billing"),
             "candidate_message": _message("bug" if i < 5 else "billing"),
             "created_at": T0} for i in range(40)]


def test_shadow_pairs_asked_the_same_way_count_as_one_cluster(factory_home: Path) -> None:
    """35 of 40 pairs agree; the 5 that do not are one way of asking. Taken as independent the
    agreement is [0.739, 0.945] and a 0.7 policy would promote; it is 7 of 8 ways
    ([0.529, 0.978]), and the policy waits for more."""
    pairs = _pairs()
    rows = score_pairs(pairs, LABELS, EmbeddedJudge(), cluster_key=phrasing_of)
    keys = [r["phrasing_key"] for r in rows]
    assert len(set(keys)) == 8 and all(keys[i] == keys[i // 5 * 5] for i in range(40))
    assert [r["passed"] for r in rows] == [i >= 5 for i in range(40)]
    assert all(r["phrasing_key"] is None for r in score_pairs(pairs[:2], LABELS,
                                                              EmbeddedJudge()))
    lake = Lake()
    lake.append("shadow_pairs", pairs)
    lake.append("shadow_scores", rows)

    summary = summarize(lake, "triage", "v1")
    assert (summary.num_scored, summary.num_passed, summary.agreement) == (40, 35, 0.875)
    interval = summary.agreement_interval
    assert interval is not None and interval.num_clusters == 8
    assert (interval.ci_low, interval.ci_high) == pytest.approx(wilson_interval(7, 8))
    assert summary.describe() == "0.875 [0.529, 0.978] n=40 in 8 clusters (Wilson, clustered)"
    assert not summary.meets(0.7, 40)
    independent = ShadowSummary(experiment="triage", version="v1", num_pairs=40,
                                num_scored=40, num_passed=35, num_failed_calls=0,
                                agreement=0.875, mean_score=None)
    assert independent.describe() == "0.875 [0.739, 0.945] n=40 (Wilson)"
    assert independent.meets(0.7, 40)
