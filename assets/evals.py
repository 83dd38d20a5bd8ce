"""``checkpoint_evals`` and ``best_checkpoint``: the model judged on its task (the rubric it is
judged by is the ``rubric`` asset, ``factory.assets.rubric``).

- ``checkpoint_evals`` (one partition per checkpoint, ``<run_id>:<step>``, requested by the
  checkpoint sensor): boots the inference server for the base model with the checkpoint's
  adapter, answers the eval set, judges every answer into ``eval_scores``; the first eval of a
  run also scores the base model (step 0) and the reference answers (step null). The server
  and the generation are sized by the eval serving size of the run's plan (``training_plans``;
  ``InferenceResource`` fields override it), shown in the metadata with each value's source. The
  train/serve equivalence check runs first, on a few samples, as a blocking asset check: a
  checkpoint that fails it is not scored, so no later ``best_checkpoint`` can pick it. An
  overfitting or plateau signal (``decide_stop``) goes to ``early_stops``. Its metadata shows
  the score as ``format_score`` prints it (mean, 95% interval, sample count, method) and the
  lowest-scored answers beside their references (``runner.worst_answers``).
- ``best_checkpoint`` (per experiment): the checkpoint whose 95% interval has the highest lower
  bound (``selection.rank``: why, measured); equal bounds go to the lower held-out loss the
  trainer measured on the eval split, else to the earlier step; a row in ``best_checkpoints``
  with the interval and its method.
"""

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg

from factory.assets.rubric import eval_rows
from factory.curation.phrasing import RECALL
from factory.curation.store import read_eval_split
from factory.evals.equivalence import check_equivalence
from factory.evals.progress import unscored_checkpoints
from factory.evals.report import plot_png, read_curves, read_eval_losses, record_early_stop
from factory.evals.reuse import borrow_scores
from factory.evals.rubric import Rubric, stored_rubric
from factory.evals.runner import (
    generate_answers,
    items_from_samples,
    score_reference,
    worst_answers,
)
from factory.evals.selection import format_score, rank, summarize
from factory.experiments import EvalSpec, load_experiment
from factory.inference.launcher import InferenceServerError
from factory.inference.sizing import plan_of_run
from factory.lake import LakeSession
from factory.partitions import CHECKPOINTS, EXPERIMENTS
from factory.planner.render import comparison_table
from factory.planner.service import sweep_comparison
from factory.resources.inference import InferenceResource
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource
from factory.settings import get_settings

_KEY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127}):(\d+)$")
NUM_EQUIVALENCE_SAMPLES = 2


def _now() -> datetime:
    return datetime.now(UTC)


def _planned_eval(plan: dict | None, experiment: str) -> EvalSpec:
    """The eval settings recorded with the run's plan; the experiment file's for a run that
    was not planned (a ready job file)."""
    recorded = (plan or {}).get("eval")
    if recorded is not None:
        return EvalSpec(**recorded)
    return load_experiment(experiment).eval


def _latest_rubric(session, experiment: str) -> Rubric:  # type: ignore[no-untyped-def]
    rubric = stored_rubric(session, experiment)
    if rubric is None:
        raise dg.Failure(f"experiment {experiment!r} has no rubric; materialize `rubric` first")
    return rubric


@dg.asset(
    partitions_def=CHECKPOINTS,
    deps=["rubric", "checkpoints"],
    group_name="evals",
    kinds={"iceberg", "python"},
    description="One checkpoint judged on the eval set: answers from the inference server "
                "(base + the checkpoint's adapter) scored against the rubric, per sample, into "
                "eval_scores; the run's first eval also scores the base model (step 0) and the "
                "reference answers. Blocking check: train/serve log-prob equivalence (a checkpoint "
                "failing it is not scored).",
    check_specs=[dg.AssetCheckSpec(
        "train_serve_equivalence", asset="checkpoint_evals", blocking=True,
        description="the server's token log-probs for the checkpoint equal the trainer's on "
                    "a few eval samples (catches chat-template and tokenizer mismatches)")],
    code_version="1",
)
def checkpoint_evals(context: dg.AssetExecutionContext,  # type: ignore[no-untyped-def]
                     lake: LakeResource, judge: JudgeResource, inference: InferenceResource):
    m = _KEY.match(context.partition_key)
    if not m:
        raise dg.Failure(f"partition {context.partition_key!r}: expected '<run_id>:<step>'")
    yield from _judge_checkpoint(context, lake.session(context), m.group(1), int(m.group(2)),
                                 judge.judge(), inference)


def _judge_checkpoint(context: dg.AssetExecutionContext,  # type: ignore[no-untyped-def]
                      session: LakeSession, run_id: str, step: int, judge: Any,
                      inference: InferenceResource):
    found = session.sql("SELECT experiment, path, verified FROM checkpoints WHERE run_id = ? "
                        "AND step = ? ORDER BY verified DESC LIMIT 1", [run_id, step]).to_pylist()
    if not found or not found[0]["verified"]:
        raise dg.Failure(f"checkpoint {run_id}:{step} is not in `checkpoints` as verified")
    ckpt = found[0]
    experiment = ckpt["experiment"]
    plan = plan_of_run(session, run_id, experiment)
    spec = _planned_eval(plan, experiment)
    rubric = _latest_rubric(session, experiment)
    rows = eval_rows(session, experiment, spec, plan=plan)
    items = items_from_samples(rows)
    base_model = json.loads((Path(ckpt["path"]) / "adapter_config.json").read_text())[
        "base_model_name_or_path"]
    done = {r["kind"] for r in session.sql(
        "SELECT DISTINCT kind FROM eval_scores WHERE run_id = ? AND rubric_version = ?",
        [run_id, rubric.version]).to_pylist()} if session.lake.exists("eval_scores") else set()

    def record(kind: str, at_step: int | None, path: str | None, answers, scored):  # type: ignore[no-untyped-def]
        out = []
        for item, gen, row in zip(items, answers, scored, strict=True):
            out.append({
                "run_id": run_id, "experiment": experiment, "step": at_step, "kind": kind,
                "checkpoint_path": path, "rubric_version": rubric.version,
                "sample_id": item.sample_id,
                "response": gen.text if hasattr(gen, "text") else None,
                "score": row.score, "status": row.status, "judge": row.judge,
                "criteria": json.dumps(row.criteria), "assessment": row.assessment,
                "error": row.error, "finish_reason": getattr(gen, "finish_reason", None),
                "num_completion_tokens": getattr(gen, "num_completion_tokens", None),
                "evaluated_at": _now()})
        session.append("eval_scores", out)
        return [r.score for r in scored]

    borrowed: dict[str, str] = {}

    def same_generation(other_run: str) -> bool:
        other = plan_of_run(session, other_run, experiment) or {}
        return (other.get("base_model"), (other.get("eval_serving") or {}).get(
            "max_new_tokens")) == ((plan or {}).get("base_model"), size.max_new_tokens)

    def borrow(kind: str) -> str | None:
        source = borrow_scores(session, kind=kind, run_id=run_id, experiment=experiment,
                               rubric_version=rubric.version,
                               sample_ids=[i.sample_id for i in items],
                               same_generation=same_generation)
        if source is not None:
            borrowed[kind] = source
        return source

    adapter = f"{run_id}-step-{step}"
    # Sized by the eval serving size the planner chose for this run; resource fields override.
    size = inference.serving_size(plan,
                                  no_plan_reason=f"run {run_id} has no plan in training_plans")
    gen = {"max_tokens": size.max_new_tokens, "concurrency": size.batch_size}
    server = inference.server(base_model, {adapter: ckpt["path"]}, size=size)
    try:
        server.start()
    except InferenceServerError as exc:
        raise dg.Failure(description=str(exc), metadata={
            "serve_command": dg.MetadataValue.json(server.command()),
            "eval_serving": dg.MetadataValue.json(size.metadata())}) from None
    serve_command = server.command()
    scores: list[float | None] | None = None
    worst = ""
    try:
        client = server.client()
        sample_rows = [{"messages": r["messages"], "tools": r["tools"]}
                       for r in rows[:NUM_EQUIVALENCE_SAMPLES]]
        # First: answers served with a template or tokenizer the model was not trained with
        # are not the model's answers, and must never reach eval_scores (best_checkpoint and
        # the curve read it in later runs, which this run's blocking check cannot stop).
        equivalence = check_equivalence(client, adapter, ckpt["path"], sample_rows,
                                        base_model=base_model,
                                        atol=1e-3 if inference.backend == "transformers"
                                        else 0.1)
        if "base" not in done and borrow("base") is None:
            answers = generate_answers(client, "base", items, **gen)
            record("base", 0, None, answers, judge.score(rubric, items,
                                                         [a.answer for a in answers]))
        if equivalence.passed:
            answers = generate_answers(client, adapter, items, **gen)
            judged = judge.score(rubric, items, [a.answer for a in answers])
            scores = record("checkpoint", step, ckpt["path"], answers, judged)
            worst = worst_answers(items, [a.answer for a in answers], judged)
    finally:
        server.stop()
    if "reference" not in done and borrow("reference") is None:
        refs = score_reference(judge, rubric, items)
        record("reference", None, None, [i.reference for i in items], refs)
    check = dg.AssetCheckResult(check_name="train_serve_equivalence", passed=equivalence.passed,
                                metadata={"max_abs_diff": equivalence.max_abs_diff,
                                          "num_tokens": equivalence.num_tokens,
                                          "problems": "\n".join(equivalence.problems)})
    if scores is None:
        context.log.error(f"checkpoint {run_id}:{step} failed the train/serve equivalence "
                          "check; its answers were not scored")
        yield dg.MaterializeResult(metadata={
            "run_id": run_id, "step": step, "scored": False,
            "not_scored_because": "train/serve equivalence failed: "
                                  + "; ".join(equivalence.problems[:3]),
            "eval_serving": dg.MetadataValue.json(size.metadata()),
            "serve_command": dg.MetadataValue.json(serve_command), **session.metadata()})
        yield check
        return
    summary = summarize(step, scores)
    split = read_eval_split(session.lake, experiment)
    curves, stop = record_early_stop(session, run_id, experiment)
    png = plot_png(curves, get_settings().home / "reports" / run_id / "curve.png")
    yield dg.MaterializeResult(metadata={
        "score": format_score(summary) + (" (recall only)" if split["eval_split"] == RECALL
                                          else ""),
        "eval_split": split["eval_split_reason"] or "",
        "worst_answers": dg.MetadataValue.md(worst),
        "run_id": run_id, "step": step, "mean_score": summary.mean,
        "ci_low": summary.ci_low, "ci_high": summary.ci_high,
        "num_samples": summary.num_samples, "ci_method": summary.method or "",
        "num_failed": summary.num_failed, "judge": judge.name,
        "rubric_version": rubric.version, "early_stop": stop.reason if stop else "",
        "scores_reused_from": dg.MetadataValue.json(borrowed),
        "early_stop_rule": stop.rule if stop else "",
        "curve": dg.MetadataValue.path(str(png)),
        "eval_serving": dg.MetadataValue.json(size.metadata()),
        "serve_command": dg.MetadataValue.json(serve_command), **session.metadata()})
    yield check


class BestCheckpointConfig(dg.Config):
    runs: list[str] = []
    """Trainer run ids to choose among (``chain_sensor`` passes its chain's runs: a sweep
    tick's winner among its own points); empty: every run of the experiment."""


@dg.asset(
    partitions_def=EXPERIMENTS,
    # Training and evals are partitioned per run and per checkpoint; Dagster cannot map those
    # onto experiments, so the edges span all partitions: lineage and staleness in the UI, and
    # a step order when they are materialized in one run. chain_sensor requests this asset only
    # once every checkpoint of the experiment's finished runs is scored.
    deps=[dg.AssetDep("checkpoint_evals", partition_mapping=dg.AllPartitionMapping()),
          dg.AssetDep("training_run", partition_mapping=dg.AllPartitionMapping())],
    group_name="evals",
    kinds={"iceberg", "python"},
    description="The checkpoint to deploy: over the experiment's runs, the one whose 95% "
                "Wilson interval of the mean rubric score has the highest lower bound; equal "
                "bounds to the lower held-out loss, else the earlier step; once every "
                "checkpoint of its finished runs is scored. Table best_checkpoints.",
    code_version="4",
)
def best_checkpoint(context: dg.AssetExecutionContext,  # type: ignore[no-untyped-def]
                    config: BestCheckpointConfig, lake: LakeResource):
    experiment = load_experiment(context.partition_key)
    session = lake.session(context)
    finished = list(config.runs) or ([r["run_id"] for r in session.sql(
        "SELECT run_id FROM training_runs WHERE experiment = ? AND status = 'finished'",
        [experiment.name]).to_pylist()] if session.lake.exists("training_runs") else [])
    pending, _ = unscored_checkpoints(context.instance, session.lake, sorted(set(finished)))
    if pending:
        raise dg.Failure(f"{len(pending)} checkpoint(s) of finished runs are not scored yet "
                         f"({', '.join(pending[:5])}): their checkpoint_evals come from "
                         "checkpoint_sensor; chain_sensor selects once they are scored",
                         allow_retries=False)
    rubric_version = _latest_rubric(session, experiment.name).version
    rows = session.sql(
        "SELECT run_id, step, kind, checkpoint_path, score FROM eval_scores "
        "WHERE experiment = ? AND rubric_version = ?",
        [experiment.name, rubric_version]).to_pylist()
    by_run: dict[str, dict[int, list[float | None]]] = {}
    paths: dict[tuple[str, int], str] = {}
    base: list[float | None] = []
    ref: list[float | None] = []
    for r in rows:
        if config.runs and r["run_id"] not in config.runs:
            continue
        if r["kind"] == "checkpoint":
            by_run.setdefault(r["run_id"], {}).setdefault(r["step"], []).append(r["score"])
            paths[(r["run_id"], r["step"])] = r["checkpoint_path"]
        elif r["kind"] == "base":
            base.append(r["score"])
        else:
            ref.append(r["score"])
    if not by_run:
        raise dg.Failure(f"experiment {experiment.name!r} has no evaluated checkpoints")
    # Every checkpoint of every run at once, by the lower bound of its interval; equal bounds
    # (an eval split the checkpoints have saturated) go to the lowest held-out loss the trainer
    # measured on the same split, else to the earlier step (selection.rank).
    losses = {run_id: read_eval_losses(session, run_id) for run_id in by_run}
    keys = sorted((run_id, step) for run_id, steps in by_run.items() for step in steps)
    cands = [summarize(step, by_run[run_id][step]) for run_id, step in keys]
    pick, decided_by = rank([(c, losses[run_id].get(step))
                             for c, (run_id, step) in zip(cands, keys, strict=True)])
    best_run, best = keys[pick][0], cands[pick]
    base_score = summarize(0, base) if any(s is not None for s in base) else None
    ref_score = summarize(0, ref) if any(s is not None for s in ref) else None
    base_mean = base_score.mean if base_score else None
    ref_mean = ref_score.mean if ref_score else None
    session.append("best_checkpoints", [{
        "experiment": experiment.name, "run_id": best_run, "step": best.step,
        "path": paths[(best_run, best.step)], "rubric_version": rubric_version,
        "mean_score": best.mean, "ci_low": best.ci_low, "ci_high": best.ci_high,
        "ci_method": best.method, "num_samples": best.num_samples, "base_score": base_mean,
        "reference_score": ref_mean, "selected_at": _now()}])
    curves = read_curves(session, best_run)
    run_losses = losses[best_run]
    curve = "| step | score | eval loss |\n|---|---|---|\n" + "\n".join(
        f"| {s} | {format_score(summarize(s, curves.samples[s]))} | "
        + (f"{run_losses[s]:.3g} |" if s in run_losses else "- |") for s, _ in curves.scores)
    extra: dict = {}
    if experiment.sweep:
        # By task score: sweep_comparison reads each point's best checkpoint mean from
        # eval_scores (the same rows `factory sweep --compare` prints).
        extra["sweep_comparison"] = dg.MetadataValue.md(
            comparison_table(sweep_comparison(session.lake, experiment)))
    png = plot_png(curves, get_settings().home / "reports" / best_run / "curve.png")
    split = read_eval_split(session.lake, experiment.name)
    return dg.MaterializeResult(metadata={
        "score": format_score(best) + (" (recall only)" if split["eval_split"] == RECALL
                                       else ""),
        "eval_split": split["eval_split_reason"] or "",
        "run_id": best_run, "step": best.step, "mean_score": best.mean,
        "decided_by": decided_by,
        "ci": f"[{best.ci_low:.3f}, {best.ci_high:.3f}]",
        "ci_method": best.method or "", "num_samples": best.num_samples,
        "base": format_score(base_score) if base_score else "",
        "reference": format_score(ref_score) if ref_score else "",
        "base_score": base_mean, "reference_score": ref_mean,
        "score_curve": dg.MetadataValue.md(curve), "curve": dg.MetadataValue.path(str(png)),
        **extra, **session.metadata()})
