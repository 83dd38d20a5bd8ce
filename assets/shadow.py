"""``shadow_scores`` (per experiment): the judge's score of each shadowed call's candidate answer
against the frontier's, and the promotion the experiment's shadow policy asks for.

Reads the pairs not yet scored under the experiment's newest rubric (``shadow_pairs``), scores
them with the experiment's judge and rubric (factory/evals/shadow.py) and appends the rows to
``shadow_scores``. With ``deploy: {shadow: {agreement: A, min_pairs: N}}`` in the experiment, a
candidate is promoted behind ``factory/<experiment>`` once at least N pairs are scored and the
lower bound of their agreement's 95% Wilson interval reaches A (``ShadowSummary.meets``).
``shadow_sensor`` materializes it when new pairs arrive; a click on Materialize scores whatever
is there.
"""

import dagster as dg

from factory.deploy import DeploymentError
from factory.evals.rubric import stored_rubric
from factory.evals.shadow import pass_threshold, score_pairs, summarize, unscored_pairs
from factory.experiments import ExperimentError, load_experiment
from factory.partitions import EXPERIMENTS
from factory.resources.deployer import DeployerResource
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource


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
    name = context.partition_key
    session = lake.session(context)
    rubric = stored_rubric(session, name) if session.lake.exists("rubrics") else None
    if rubric is None:
        raise dg.Failure(f"experiment {name!r} has no rubric; materialize rubric first",
                         allow_retries=False)
    try:
        policy = load_experiment(name).shadow
    except ExperimentError:
        policy = None
    pass_score = policy.pass_score if policy else None
    pairs = unscored_pairs(session, name, rubric.version)
    if session.lake.exists("shadow_pairs"):
        session.lineage.record_read("shadow_pairs", session.lake.snapshot_id("shadow_pairs"))
    scored = score_pairs(pairs, rubric, judge.judge(), pass_score=pass_score)
    session.append("shadow_scores", scored)
    dep = deployer.deployer(session)
    candidate = dep.candidate(name)
    summary = summarize(session, name, candidate.version if candidate else None)
    promoted = ""
    if candidate is not None and policy is not None and policy.agreement is not None:
        asked = (f"a lower bound of at least {policy.agreement} over at least "
                 f"{policy.min_pairs} pairs")
        if not summary.meets(policy.agreement, policy.min_pairs):
            context.log.info(f"{name} {candidate.version} not promoted: agreement "
                             f"{summary.describe()}; the policy asks for {asked}")
        else:
            try:
                live = dep.promote(name, candidate.version)
            except DeploymentError as exc:
                context.log.warning(f"the shadow policy is met but the promotion failed: {exc}")
            else:
                promoted = live.version
                context.log.info(f"promoted {name} {live.version}: agreement "
                                 f"{summary.describe()} meets {asked}")
    threshold, on = pass_threshold(rubric, pass_score)
    interval = summary.agreement_interval
    return dg.MaterializeResult(metadata={
        "num_scored_now": len(scored),
        "candidate": candidate.version if candidate else "",
        "num_pairs": summary.num_pairs,
        "num_scored": summary.num_scored,
        "agreement": summary.agreement if summary.agreement is not None else -1.0,
        "agreement_interval": summary.describe(),
        "agreement_ci_low": interval.ci_low if interval is not None else -1.0,
        "agreement_ci_high": interval.ci_high if interval is not None else -1.0,
        "mean_score": summary.mean_score if summary.mean_score is not None else -1.0,
        "num_failed_calls": summary.num_failed_calls,
        "pass_threshold": f"{threshold:g} on "
                          f"{'every exact criterion' if on == 'exact' else 'the score'}",
        "policy": dg.MetadataValue.json(
            {"route": policy.route, "share": policy.share, "agreement": policy.agreement,
             "min_pairs": policy.min_pairs} if policy else {}),
        "promoted": promoted,
        "rubric_version": rubric.version,
        **session.metadata(),
    })
