"""One round of shadow scoring for the ``shadow_scores`` asset: the shadowed calls not yet scored
under the experiment's newest rubric are judged (``factory.evals.shadow``) and appended to
``shadow_scores``; then, with ``deploy: {shadow: {agreement: A, min_pairs: N}}`` in the
experiment, its candidate is promoted behind ``factory/<experiment>`` once at least N pairs are
scored and the lower bound of their agreement's 95% Wilson interval reaches A
(``ShadowSummary.meets``). A promotion the deployer refuses (a ``FactoryError``: the
candidate is not running, say) is logged, not raised: the scores are kept, and the next round
tries again. The deployer comes in as ``Deployments`` (``factory.deploy.Deployer`` is one): evals
and deploy sit side by side in the factory's layers and import neither each other. The judge and
the deployer are made only once the experiment's rubric is found.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from factory.errors import FactoryError
from factory.evals.judging import EvalError
from factory.evals.rubric import Rubric, stored_rubric
from factory.evals.shadow import (
    ClusterKey,
    ShadowSummary,
    pass_threshold,
    score_pairs,
    summarize,
    unscored_pairs,
)
from factory.experiments import ExperimentError, ShadowPolicy, load_experiment
from factory.lake import LakeSession


class Deployed(Protocol):
    """A version of a deployment (``factory.deploy.Deployment``)."""

    @property
    def version(self) -> str: ...


class Deployments(Protocol):
    """The experiment's versions (``factory.deploy.Deployer``)."""

    def candidate(self, name: str) -> Deployed | None: ...

    def promote(self, name: str, version: str | None = None) -> Deployed: ...


class Log(Protocol):
    """Where a round says what it decided (a ``logging.Logger``, Dagster's ``context.log``)."""

    def info(self, msg: str) -> Any: ...

    def warning(self, msg: str) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class ShadowRound:
    """What one round scored and decided."""

    rubric: Rubric
    """The rubric the pairs were scored under (the experiment's newest)."""
    policy: ShadowPolicy | None
    """The experiment's shadow policy; None without one (or without an experiment file)."""
    num_scored_now: int
    """Pairs this round scored."""
    candidate: str
    """The candidate version the summary is of; empty when none serves."""
    summary: ShadowSummary
    """The agreement over every scored pair of the candidate."""
    promoted: str
    """The version this round promoted; empty when none."""
    pass_threshold: str
    """What a pair needs to agree: ``0.8 on the score``, ``1 on every exact criterion``."""


def shadow_round(session: LakeSession, experiment: str, *, judge: Callable[[], Any],
                 deployments: Callable[[], Deployments],
                 log: Log = logging.getLogger("factory.evals"),
                 cluster_key: ClusterKey | None = None) -> ShadowRound:
    """Score ``experiment``'s unscored shadow pairs with the judge ``judge()`` makes and promote
    its candidate among ``deployments()`` when the policy is met (both made once the rubric is
    found). ``cluster_key``: each pair's phrasing cluster key from its request's messages
    (``shadow.score_pairs``), which the agreement's interval is clustered by. Raises
    ``EvalError`` when the experiment has no rubric yet."""
    rubric = stored_rubric(session, experiment) if session.lake.exists("rubrics") else None
    if rubric is None:
        raise EvalError(f"experiment {experiment!r} has no rubric; materialize rubric first")
    try:
        policy = load_experiment(experiment).shadow
    except ExperimentError:
        policy = None
    pass_score = policy.pass_score if policy else None
    pairs = unscored_pairs(session, experiment, rubric.version)
    if session.lake.exists("shadow_pairs"):
        session.lineage.record_read("shadow_pairs", session.lake.snapshot_id("shadow_pairs"))
    scored = score_pairs(pairs, rubric, judge(), pass_score=pass_score,
                         cluster_key=cluster_key)
    session.append("shadow_scores", scored)
    deployer = deployments()
    candidate = deployer.candidate(experiment)
    summary = summarize(session, experiment, candidate.version if candidate else None)
    promoted = ""
    if candidate is not None and policy is not None and policy.agreement is not None:
        asked = (f"a lower bound of at least {policy.agreement} over at least "
                 f"{policy.min_pairs} pairs")
        if not summary.meets(policy.agreement, policy.min_pairs):
            log.info(f"{experiment} {candidate.version} not promoted: agreement "
                     f"{summary.describe()}; the policy asks for {asked}")
        else:
            try:
                live = deployer.promote(experiment, candidate.version)
            except FactoryError as exc:
                log.warning(f"the shadow policy is met but the promotion failed: {exc}")
            else:
                promoted = live.version
                log.info(f"promoted {experiment} {live.version}: agreement "
                         f"{summary.describe()} meets {asked}")
    threshold, on = pass_threshold(rubric, pass_score)
    return ShadowRound(rubric=rubric, policy=policy, num_scored_now=len(scored),
                       candidate=candidate.version if candidate else "", summary=summary,
                       promoted=promoted, pass_threshold=f"{threshold:g} on " + (
                           "every exact criterion" if on == "exact" else "the score"))
