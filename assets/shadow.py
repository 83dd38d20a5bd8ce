"""``shadow_scores`` (per experiment): the judge's score of each shadowed call's candidate answer
against the frontier's, and the promotion the experiment's shadow policy asks for.

Reads the pairs not yet scored under the experiment's newest rubric (``shadow_pairs``), scores
them with the experiment's judge and rubric (factory/evals/shadow.py) and appends the rows to
``shadow_scores``. With ``deploy: {shadow: {agreement: A, min_pairs: N}}`` in the experiment, a
candidate is promoted behind ``factory/<experiment>`` once at least N pairs are scored and the
lower bound of their agreement's 95% Wilson interval reaches A (``ShadowSummary.meets``); the
interval counts pairs asked the same way (one phrasing key, ``phrasing_of``) as one cluster.
The round is ``factory.evals.promotion.shadow_round``.
``shadow_sensor`` materializes it when new pairs arrive; a click on Materialize scores whatever
is there.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from factory.curation.phrasing import phrasing_key, skeleton, user_text
from factory.evals.judging import EvalError
from factory.evals.promotion import shadow_round
from factory.partitions import EXPERIMENTS
from factory.resources.deployer import DeployerResource
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource


def phrasing_of(messages: Sequence[Mapping[str, Any]]) -> str:
    """A shadowed request's phrasing cluster key: the digest of its user turns' skeleton, as
    the curation keys a sample's (``factory.curation.phrasing``). The request is the client's
    chat body, whose content is a string or a list of text parts."""
    return phrasing_key(skeleton(user_text([
        {**m, "content": [{"type": "text", "text": m["content"]}]}
        if isinstance(m.get("content"), str) else m for m in messages])))


@dg.asset(
    partitions_def=EXPERIMENTS,
    deps=["rubric"],
    group_name="deploy",
    kinds={"python", "iceberg"},
    description="Live-traffic agreement of the experiment's candidate with the frontier model: "
                "each shadowed call's candidate answer scored by the judge on the rubric against "
                "the frontier's answer (exact checks for labels, JSON and tool calls); the "
                "agreement with its 95% Wilson interval. Promotes the candidate when the lower "
                "bound of that interval meets the experiment's deploy: {shadow: ...} policy. "
                "Table shadow_scores.",
    code_version="2",
)
def shadow_scores(context: dg.AssetExecutionContext, lake: LakeResource, judge: JudgeResource,
                  deployer: DeployerResource) -> dg.MaterializeResult:
    session = lake.session(context)
    try:
        done = shadow_round(session, context.partition_key, judge=judge.judge,
                            deployments=lambda: deployer.deployer(session), log=context.log,
                            cluster_key=phrasing_of)
    except EvalError as exc:
        raise dg.Failure(str(exc), allow_retries=False) from None
    summary, policy = done.summary, done.policy
    interval = summary.agreement_interval
    return dg.MaterializeResult(metadata={
        "num_scored_now": done.num_scored_now,
        "candidate": done.candidate,
        "num_pairs": summary.num_pairs,
        "num_scored": summary.num_scored,
        "agreement": summary.agreement if summary.agreement is not None else -1.0,
        "agreement_interval": summary.describe(),
        "agreement_ci_low": interval.ci_low if interval is not None else -1.0,
        "agreement_ci_high": interval.ci_high if interval is not None else -1.0,
        "mean_score": summary.mean_score if summary.mean_score is not None else -1.0,
        "num_failed_calls": summary.num_failed_calls,
        "pass_threshold": done.pass_threshold,
        "policy": dg.MetadataValue.json(
            {"route": policy.route, "share": policy.share, "agreement": policy.agreement,
             "min_pairs": policy.min_pairs} if policy else {}),
        "promoted": done.promoted,
        "rubric_version": done.rubric.version,
        **session.metadata(),
    })
