"""Shadow evaluation: the judge's score of each candidate answer against the frontier's answer to
the same live request (``shadow_pairs`` -> ``shadow_scores``), and the agreement it adds up to.

A pair's reference is the frontier's answer (what the client got); its answer is the candidate's.
The experiment's rubric scores it, so labels, JSON and tool calls are checked exactly. A pair
**passes** when its score reaches the rubric's pass threshold: every exact criterion (label, JSON
or tool-call match) scores 1.0 where the rubric has one, else the combined score reaches
``FREE_TEXT_PASS`` (or the experiment's ``pass_score``). A candidate that gave no usable answer
(refused, timed out, answered garbage or an error) scores 0 with the reason.
**Agreement** is the share of scored pairs that pass, with its 95% Wilson interval. A shadow
policy promotes on the interval's lower bound, not the share: 20 of 20 pairs passing is 1.000
but only [0.839, 1.000], which does not show 0.95 agreement; at the default 200 pairs a 0.95
policy needs 197 of them passing (lower bound 0.957; 196 give 0.9497). Pairs asked the same
way (one ``phrasing_key``: ``factory.curation.phrasing``) tend to pass or fail together, so the
interval is taken on the effective count of those clusters (``selection.summarize``) and prints
``n=200 in 40 clusters``; pairs each asked their own way keep the plain Wilson interval.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from factory.evals.answers import to_openai_tools
from factory.evals.judges import EvalItem, ScoreRow, answer_from_message
from factory.evals.rubric import Rubric
from factory.evals.selection import WILSON, Interval, format_score, wilson_interval
from factory.evals.selection import summarize as summarize_scores

EXACT_CHECKS = frozenset({"tool_call_match", "json_match", "label_match", "tool_calls"})
"""Criteria that decide a pass on their own: the answer matches the reference exactly or not."""
FREE_TEXT_PASS = 0.8
"""The combined score a free-text answer needs to pass (no exact criterion to decide)."""


def pass_threshold(rubric: Rubric, pass_score: float | None = None) -> tuple[float, str]:
    """The score a pair needs, and what it is measured on (``exact`` criteria or ``score``)."""
    if pass_score is not None:
        return pass_score, "score"
    if any(c.check in EXACT_CHECKS for c in rubric.criteria):
        return 1.0, "exact"
    return FREE_TEXT_PASS, "score"


def _passes(rubric: Rubric, row: ScoreRow, pass_score: float | None) -> bool:
    threshold, on = pass_threshold(rubric, pass_score)
    if row.score is None:
        return False
    if on == "exact":
        exact = [row.criteria[c.name]["score"] for c in rubric.criteria
                 if c.check in EXACT_CHECKS and c.name in row.criteria]
        return all(s is not None and s >= threshold for s in exact)
    return row.score >= threshold


def _exists(session: Any, table: str) -> bool:
    """Whether ``table`` exists, for a ``Lake`` or a ``LakeSession``."""
    return bool(getattr(session, "lake", session).exists(table))


def _loads(text: Any) -> Any:
    return json.loads(text) if isinstance(text, str) else text


ClusterKey = Callable[[Sequence[Mapping[str, Any]]], str]
"""A request's phrasing cluster key from its messages (the ``shadow_scores`` asset passes
``factory.curation.phrasing``'s: the digest of the user turns' skeleton); "" for none."""


def score_pairs(pairs: Sequence[dict[str, Any]], rubric: Rubric, judge: Any, *,
                pass_score: float | None = None,
                cluster_key: ClusterKey | None = None) -> list[dict[str, Any]]:
    """``shadow_scores`` rows for ``pairs`` (rows of ``shadow_pairs``). Pairs whose frontier
    answer is unusable have no reference and are not scored. ``cluster_key``: each row's
    ``phrasing_key`` from its request's messages (null without it, or for an empty key), so
    the agreement's interval counts pairs asked the same way as one cluster."""
    now = datetime.now(UTC)
    out: list[dict[str, Any]] = []
    items: list[EvalItem] = []
    answers = []
    judged: list[dict[str, Any]] = []
    for pair in pairs:
        base = {"pair_id": pair["pair_id"], "experiment": pair["experiment"],
                "version": pair["version"], "rubric_version": rubric.version,
                "judge": judge.name, "scored_at": now}
        frontier = _loads(pair.get("frontier_message"))
        if not frontier:
            continue
        request = _loads(pair.get("request")) or {}
        messages = list((request.get("messages") if isinstance(request, dict) else None)
                        or [])
        base["phrasing_key"] = (cluster_key([m for m in messages if isinstance(m, dict)])
                                or None) if cluster_key else None
        candidate = _loads(pair.get("candidate_message"))
        if not candidate:
            out.append({**base, "score": 0.0, "passed": False,
                        "assessment": pair.get("candidate_error") or "candidate gave no answer"})
            continue
        items.append(EvalItem(sample_id=str(pair["pair_id"]),
                              messages=messages,
                              tools=to_openai_tools(request.get("tools")
                                                    if isinstance(request, dict) else None),
                              reference=answer_from_message(frontier)))
        answers.append(answer_from_message(candidate))
        judged.append(base)
    if items:
        for base, row in zip(judged, judge.score(rubric, items, answers), strict=True):
            if row.status != "ok" or row.score is None:
                out.append({**base, "score": 0.0, "passed": False,
                            "assessment": f"judge failed: {row.error or row.assessment}"})
                continue
            out.append({**base, "score": float(row.score),
                        "passed": _passes(rubric, row, pass_score),
                        "assessment": row.assessment})
    return out


@dataclass(frozen=True, kw_only=True)
class ShadowSummary:
    """Where a candidate stands against the frontier model on live traffic."""

    experiment: str
    version: str | None
    """The candidate version summarized (None: every version)."""
    num_pairs: int
    num_scored: int
    num_passed: int
    num_failed_calls: int
    """Pairs whose candidate gave no usable answer (scored 0)."""
    agreement: float | None
    """Share of scored pairs that pass (None before any is scored)."""
    mean_score: float | None
    outcomes: tuple[tuple[bool, str], ...] = ()
    """Each scored pair's pass and phrasing cluster (its ``phrasing_key``, else its own id);
    empty where not read, and every pair counts as independent."""

    @property
    def agreement_interval(self) -> Interval | None:
        """The agreement with its 95% Wilson interval (None before any pair is scored), taken
        on the effective count of the pairs' phrasing clusters where pairs share one
        (``selection.summarize``): 200 pairs asked in 10 ways tell less than 200 asked in 200."""
        if not self.num_scored:
            return None
        if len(self.outcomes) == self.num_scored:
            s = summarize_scores(0, [1.0 if passed else 0.0 for passed, _ in self.outcomes],
                                 clusters=[cluster for _, cluster in self.outcomes])
            return Interval(mean=s.mean, ci_low=s.ci_low, ci_high=s.ci_high,
                            num_samples=s.num_samples, method=s.method,
                            num_clusters=s.num_clusters)
        low, high = wilson_interval(self.num_passed, self.num_scored)
        return Interval(mean=self.num_passed / self.num_scored, ci_low=low, ci_high=high,
                        num_samples=self.num_scored, method=WILSON)

    def meets(self, agreement: float, min_pairs: int) -> bool:
        """Whether a policy of ``agreement`` over at least ``min_pairs`` scored pairs promotes:
        the lower bound of the agreement's 95% interval reaches ``agreement``, so a high share
        of few pairs (4 of 4: [0.510, 1.000]) does not pass for a high agreement."""
        interval = self.agreement_interval
        return (self.num_scored >= min_pairs and interval is not None
                and interval.ci_low >= agreement)

    def describe(self) -> str:
        """The agreement as people read it: ``0.985 [0.957, 0.995] n=200 (Wilson)``."""
        interval = self.agreement_interval
        return "no scored pairs" if interval is None else format_score(interval)


LATEST_SCORES = ("(SELECT * FROM shadow_scores WHERE experiment = ? QUALIFY row_number() OVER "
                 "(PARTITION BY pair_id ORDER BY scored_at DESC) = 1)")
"""Each pair's newest score of one experiment (a pair is scored again under a new rubric
version), as a subquery taking the experiment as its one parameter."""


def summarize(session: Any, experiment: str, version: str | None = None) -> ShadowSummary:
    """Agreement and mean score of ``experiment``'s scored pairs (of one candidate version)."""
    if not _exists(session, "shadow_pairs"):
        return ShadowSummary(experiment=experiment, version=version, num_pairs=0, num_scored=0,
                             num_passed=0, num_failed_calls=0, agreement=None, mean_score=None)
    where, params = "experiment = ?", [experiment]
    if version is not None:
        where, params = where + " AND version = ?", params + [version]
    pairs = session.sql(f"SELECT count(*) AS n, count(*) FILTER (WHERE candidate_message IS "
                        f"NULL) AS failed FROM shadow_pairs WHERE {where}", params).to_pylist()[0]
    rows = session.sql(
        f"SELECT pair_id, passed, score, phrasing_key FROM {LATEST_SCORES} s WHERE {where} "
        "ORDER BY pair_id", [experiment, *params]).to_pylist() \
        if _exists(session, "shadow_scores") else []
    # A pair without a phrasing key (none given to score_pairs, no user text) is its own cluster.
    outcomes = tuple((bool(r["passed"]), r["phrasing_key"] or f"pair:{r['pair_id']}")
                     for r in rows)
    n, passed = len(rows), sum(p for p, _ in outcomes)
    graded = [float(r["score"]) for r in rows if r["score"] is not None]
    return ShadowSummary(experiment=experiment, version=version, num_pairs=int(pairs["n"]),
                         num_scored=n, num_passed=passed,
                         num_failed_calls=int(pairs["failed"] or 0),
                         agreement=passed / n if n else None,
                         mean_score=sum(graded) / len(graded) if graded else None,
                         outcomes=outcomes)


def unscored_pairs(session: Any, experiment: str, rubric_version: str,
                   limit: int = 2000) -> list[dict[str, Any]]:
    """``experiment``'s pairs without a score under ``rubric_version``, oldest first."""
    if not _exists(session, "shadow_pairs"):
        return []
    params: list[Any] = [experiment]
    seen = ""
    if _exists(session, "shadow_scores"):
        seen = ("AND pair_id NOT IN (SELECT pair_id FROM shadow_scores WHERE experiment = ? "
                "AND rubric_version = ?)")
        params += [experiment, rubric_version]
    rows: list[dict[str, Any]] = session.sql(
        f"SELECT * FROM shadow_pairs WHERE experiment = ? {seen} ORDER BY created_at "
        f"LIMIT {int(limit)}", params).to_pylist()
    return rows
