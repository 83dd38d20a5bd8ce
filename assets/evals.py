"""``checkpoint_evals``, ``final_evals`` and ``best_checkpoint``: the model judged on its task
(the rubric it is judged by is the ``rubric`` asset, ``factory.assets.rubric``). The work is
``factory.evals.judging``, ``factory.evals.final`` and ``factory.evals.choice``; these read the
partition, call it and show what it did.

- ``checkpoint_evals`` (one partition per checkpoint, ``<run_id>:<step>``, requested by the
  checkpoint sensor): boots the inference server for the base model with the checkpoint's
  adapter, answers the plan's eval samples (``eval_num_samples``: every checkpoint, so a subset
  where the eval budget needs one), judges every answer into ``eval_scores``; the first eval of
  a run also scores the base model (step 0) and the reference answers (step null). The server
  and the generation are sized by the eval serving size of the run's plan (``training_plans``;
  ``InferenceResource`` fields override it), shown in the metadata with each value's source. The
  train/serve equivalence check runs first, on a few samples, as a blocking asset check: a
  checkpoint that fails it is not scored, so no later ``best_checkpoint`` can pick it. An
  overfitting or plateau signal (``decide_stop``) goes to ``early_stops``. Its metadata shows
  the score as ``format_score`` prints it (mean, 95% interval, sample count, method) and the
  lowest-scored answers beside their references (``answers.worst_answers``).
- ``final_evals`` (per experiment, first in ``select_checkpoint_job``): the leading checkpoints
  (``selection.FINAL_CANDIDATES``, by the lower bound of their interval) judged on the rest of
  the final eval set (the plan's ``eval_final_num_samples``) into ``eval_scores``; a no-op that
  says why when the plans judge every checkpoint on the whole set.
- ``best_checkpoint`` (per experiment): among the checkpoints judged on the most samples, the
  one whose 95% interval has the highest lower bound (``selection.rank_final``: why, measured);
  equal bounds go to the lower held-out loss the trainer measured on the eval split, else to
  the earlier step; a row in ``best_checkpoints`` with the interval and its method.
"""

import re
from typing import Any

import dagster as dg

from factory.curation.phrasing import RECALL
from factory.curation.store import read_eval_split
from factory.evals.choice import finalists_table, record_best
from factory.evals.final import judge_finalists
from factory.evals.judging import EvalError, ServerStartError, evaluate_checkpoint
from factory.evals.selection import format_score
from factory.experiments import load_experiment
from factory.partitions import CHECKPOINTS, EXPERIMENTS
from factory.planner.render import comparison_table
from factory.planner.service import sweep_comparison
from factory.resources.inference import InferenceResource
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource

_KEY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127}):(\d+)$")


def _failure(exc: EvalError) -> dg.Failure:
    """An eval that cannot run, as the step's failure (with the server's command and size
    when the server did not start)."""
    if isinstance(exc, ServerStartError):
        return dg.Failure(description=str(exc), metadata={
            "serve_command": dg.MetadataValue.json(exc.serve_command),
            "eval_serving": dg.MetadataValue.json(exc.eval_serving)})
    return dg.Failure(str(exc), allow_retries=False)


def _split_label(lake: Any, experiment: str) -> tuple[str, str]:
    """(' (recall only)' or '', the split's reason) for a score of ``experiment``."""
    split = read_eval_split(lake, experiment)
    return (" (recall only)" if split["eval_split"] == RECALL else "",
            split["eval_split_reason"] or "")


@dg.asset(
    partitions_def=CHECKPOINTS,
    deps=["rubric", "checkpoints"],
    group_name="evals",
    kinds={"iceberg", "python"},
    description="One checkpoint judged on the plan's eval samples: answers from the inference "
                "server (base + the checkpoint's adapter) scored against the rubric, per "
                "sample, into eval_scores; the run's first eval also scores the base model "
                "(step 0) and the reference answers. Blocking check: train/serve log-prob "
                "equivalence (a checkpoint failing it is not scored).",
    check_specs=[dg.AssetCheckSpec(
        "train_serve_equivalence", asset="checkpoint_evals", blocking=True,
        description="the server's token log-probs for the checkpoint equal the trainer's on "
                    "a few eval samples (catches chat-template and tokenizer mismatches)")],
    code_version="2",
)
def checkpoint_evals(context: dg.AssetExecutionContext,  # type: ignore[no-untyped-def]
                     lake: LakeResource, judge: JudgeResource, inference: InferenceResource):
    m = _KEY.match(context.partition_key)
    if not m:
        raise dg.Failure(f"partition {context.partition_key!r}: expected '<run_id>:<step>'")
    session = lake.session(context)
    scorer = judge.judge()
    try:
        done = evaluate_checkpoint(session, m.group(1), int(m.group(2)), judge=scorer,
                                   inference=inference)
    except EvalError as exc:
        raise _failure(exc) from None
    run_id, step, eq = done.checkpoint.run_id, done.checkpoint.step, done.equivalence
    check = dg.AssetCheckResult(check_name="train_serve_equivalence", passed=eq.passed,
                                metadata={"max_abs_diff": eq.max_abs_diff,
                                          "num_tokens": eq.num_tokens,
                                          "problems": "\n".join(eq.problems)})
    serving = {"eval_serving": dg.MetadataValue.json(done.eval_serving),
               "serve_command": dg.MetadataValue.json(done.serve_command)}
    if done.score is None:
        context.log.error(f"checkpoint {run_id}:{step} failed the train/serve equivalence "
                          "check; its answers were not scored")
        yield dg.MaterializeResult(metadata={
            "run_id": run_id, "step": step, "scored": False,
            "not_scored_because": "train/serve equivalence failed: "
                                  + "; ".join(eq.problems[:3]),
            **serving, **session.metadata()})
        yield check
        return
    score, stop = done.score, done.early_stop
    recall, split_reason = _split_label(session.lake, done.checkpoint.experiment)
    yield dg.MaterializeResult(metadata={
        "score": format_score(score) + recall, "eval_split": split_reason,
        "worst_answers": dg.MetadataValue.md(done.worst_answers),
        "run_id": run_id, "step": step, "mean_score": score.mean,
        "ci_low": score.ci_low, "ci_high": score.ci_high,
        "num_samples": score.num_samples, "ci_method": score.method or "",
        "num_clusters": score.num_clusters or 0,
        "num_failed": score.num_failed, "judge": scorer.name,
        "rubric_version": done.rubric_version, "early_stop": stop.reason if stop else "",
        "scores_reused_from": dg.MetadataValue.json(done.borrowed),
        "early_stop_rule": stop.rule if stop else "",
        "curve": dg.MetadataValue.path(str(done.curve)),
        **serving, **session.metadata()})
    yield check


class ChoiceConfig(dg.Config):
    runs: list[str] = []
    """Trainer run ids to choose among (``chain_sensor`` passes its chain's runs: a sweep
    tick's winner among its own points); empty: every run of the experiment."""


@dg.asset(
    partitions_def=EXPERIMENTS,
    # As best_checkpoint's: the checkpoints' evals span all partitions of theirs.
    deps=[dg.AssetDep("checkpoint_evals", partition_mapping=dg.AllPartitionMapping())],
    group_name="evals",
    kinds={"iceberg", "python"},
    description="The leading checkpoints (3, by the lower bound of their score's 95% interval) "
                "judged on the rest of the final eval set before best_checkpoint chooses, "
                "where mid-training evals judged a subset of it (the plan's "
                "eval_num_samples < eval_final_num_samples); otherwise nothing to do, and the "
                "metadata says why. Rows in eval_scores.",
    code_version="1",
)
def final_evals(context: dg.AssetExecutionContext, config: ChoiceConfig,
                lake: LakeResource, judge: JudgeResource,
                inference: InferenceResource) -> dg.MaterializeResult:
    session = lake.session(context)
    try:
        done = judge_finalists(context.instance, session, context.partition_key, config.runs,
                               judge=judge.judge(), inference=inference)
    except EvalError as exc:
        raise _failure(exc) from None
    return dg.MaterializeResult(metadata={
        "final_evals": done.reason, "num_final_samples": done.num_final_samples,
        "num_checkpoints": done.num_checkpoints, "num_added": done.num_added,
        "finalists": dg.MetadataValue.md(finalists_table(done)),
        "eval_serving": dg.MetadataValue.json(done.eval_serving),
        "serve_command": dg.MetadataValue.json(done.serve_commands), **session.metadata()})


@dg.asset(
    partitions_def=EXPERIMENTS,
    # Training and evals are partitioned per run and per checkpoint; Dagster cannot map those
    # onto experiments, so the edges span all partitions: lineage and staleness in the UI, and
    # a step order when they are materialized in one run. chain_sensor requests this asset
    # (after final_evals, in the same run) only once every checkpoint of the experiment's
    # finished runs is scored.
    deps=[dg.AssetDep("checkpoint_evals", partition_mapping=dg.AllPartitionMapping()),
          dg.AssetDep("training_run", partition_mapping=dg.AllPartitionMapping()),
          "final_evals"],
    group_name="evals",
    kinds={"iceberg", "python"},
    description="The checkpoint to deploy: over the experiment's runs, among the checkpoints "
                "judged on the most eval samples (the leaders final_evals judged on the whole "
                "set), the one whose 95% Wilson interval of the mean rubric score has the "
                "highest lower bound; equal bounds to the lower held-out loss, else the "
                "earlier step; once every checkpoint of its finished runs is scored. Table "
                "best_checkpoints.",
    code_version="5",
)
def best_checkpoint(context: dg.AssetExecutionContext,  # type: ignore[no-untyped-def]
                    config: ChoiceConfig, lake: LakeResource):
    experiment = load_experiment(context.partition_key)
    session = lake.session(context)
    try:
        recorded = record_best(context.instance, session, experiment, config.runs)
    except EvalError as exc:
        raise _failure(exc) from None
    choice = recorded.choice
    best, base, ref = choice.score, choice.base, choice.reference
    extra: dict = {}
    if experiment.sweep:
        # By task score: sweep_comparison reads each point's best checkpoint mean from
        # eval_scores (the same rows `factory sweep --compare` prints).
        extra["sweep_comparison"] = dg.MetadataValue.md(
            comparison_table(sweep_comparison(session.lake, experiment)))
    recall, split_reason = _split_label(session.lake, experiment.name)
    return dg.MaterializeResult(metadata={
        "score": format_score(best) + recall, "eval_split": split_reason,
        "run_id": choice.run_id, "step": best.step, "mean_score": best.mean,
        "decided_by": choice.decided_by,
        "ci": f"[{best.ci_low:.3f}, {best.ci_high:.3f}]",
        "ci_method": best.method or "", "num_samples": best.num_samples,
        "num_clusters": best.num_clusters or 0,
        "base": format_score(base) if base else "",
        "reference": format_score(ref) if ref else "",
        "base_score": base.mean if base else None,
        "reference_score": ref.mean if ref else None,
        "score_curve": dg.MetadataValue.md(recorded.score_curve),
        "curve": dg.MetadataValue.path(str(recorded.plot)),
        **extra, **session.metadata()})
