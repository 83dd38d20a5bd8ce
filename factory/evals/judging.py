"""Judging checkpoints on eval samples: the one path from a checkpoint to its rows in
``eval_scores``.

- ``eval_rows``: the eval samples a run is judged on: the experiment's eval set in ``sample_id``
  order, at most ``eval.max_samples``, and for a planned run at most the plan's
  ``eval_num_samples`` (every checkpoint, mid-training) or ``eval_final_num_samples`` (the
  leading checkpoints, before the choice). Every count takes the first samples of the same
  order, so a checkpoint's final samples are its mid-training ones and the rest.
- ``judge_checkpoint``: one checkpoint's answers to a list of eval items, generated on a running
  server, judged against the rubric and appended to ``eval_scores`` (kind ``checkpoint``).
  ``evaluate_checkpoint`` (every checkpoint, on the plan's samples) and
  ``final.judge_finalists`` (the leading checkpoints, on the rest of the final set) both call
  it, so a checkpoint's rows are alike whichever step wrote them. Answers are generated under
  the run's ``answer_constraint`` (``eval.constrain`` as its plan recorded it): a closed task's
  answers constrained to its labels or JSON shape, or free.
- ``evaluate_checkpoint``: what ``checkpoint_evals`` does for one checkpoint: its server sized by
  its run's plan, the train/serve equivalence check first (a checkpoint that fails it is never
  scored), the base model's and the references' scores once per run (or copied from another
  run, ``reuse.borrow_scores``), the checkpoint's scores, then the early-stop rules and the
  curve.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from factory.evals.answers import (
    Generated,
    eval_constraint,
    generate_answers,
    items_from_samples,
    score_reference,
    worst_answers,
)
from factory.evals.equivalence import EquivalenceResult, check_equivalence, trainer_view
from factory.evals.judges import EvalItem, ScoreRow
from factory.evals.report import plot_png, record_early_stop
from factory.evals.reuse import borrow_scores
from factory.evals.rubric import Rubric, stored_rubric
from factory.evals.selection import EarlyStop, StepScore, summarize
from factory.experiments import CONSTRAIN_AUTO, EvalSpec, load_experiment
from factory.inference.launcher import InferenceServer, InferenceServerError
from factory.inference.sizing import ServingSize, plan_of_run
from factory.lake import LakeSession, Lineage
from factory.settings import get_settings

NUM_EQUIVALENCE_SAMPLES = 2
"""Eval samples the train/serve equivalence check compares (the planner's time model counts
them: ``timing.EQUIVALENCE_SAMPLES``)."""


class EvalError(Exception):
    """An eval that cannot run as asked (an unknown checkpoint, no rubric, no eval samples, a
    checkpoint still to be scored); the message says why."""


class ServerStartError(EvalError):
    """The eval server did not start; carries the command and the size it was started with."""

    def __init__(self, message: str, *, serve_command: list[str],
                 eval_serving: dict[str, Any]) -> None:
        super().__init__(message)
        self.serve_command = serve_command
        self.eval_serving = eval_serving


class Servers(Protocol):
    """What the evals need of the inference resource (``InferenceResource``)."""

    @property
    def backend(self) -> str:
        """``transformers`` (the CPU server) or ``vllm``."""

    def serving_size(self, plan: Mapping[str, Any] | None, *,
                     no_plan_reason: str = ...) -> ServingSize: ...

    def server(self, model: str, adapters: Mapping[str, str] | None = None, *,
               size: ServingSize | None = None,
               served_model_name: str = ...) -> InferenceServer: ...


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A verified checkpoint of ``checkpoints``."""

    run_id: str
    """The training run."""
    step: int
    """Its optimizer step."""
    experiment: str
    """The experiment the run trains."""
    path: str
    """The adapter directory."""

    @property
    def adapter(self) -> str:
        """The name the eval server knows its adapter by."""
        return f"{self.run_id}-step-{self.step}"

    def base_model(self) -> str:
        """The base model the adapter was trained on (its ``adapter_config.json``)."""
        config = json.loads((Path(self.path) / "adapter_config.json").read_text())
        return str(config["base_model_name_or_path"])


def find_checkpoint(session: LakeSession, run_id: str, step: int) -> Checkpoint:
    """The verified checkpoint ``run_id``:``step``; ``EvalError`` when there is none."""
    found = session.sql("SELECT experiment, path, verified FROM checkpoints WHERE run_id = ? "
                        "AND step = ? ORDER BY verified DESC LIMIT 1", [run_id, step]).to_pylist()
    if not found or not found[0]["verified"]:
        raise EvalError(f"checkpoint {run_id}:{step} is not in `checkpoints` as verified")
    return Checkpoint(run_id=run_id, step=step, experiment=found[0]["experiment"],
                      path=found[0]["path"])


def planned_eval(plan: Mapping[str, Any] | None, experiment: str) -> EvalSpec:
    """The eval settings recorded with the run's plan; the experiment file's for a run that
    was not planned (a ready job file)."""
    recorded = (plan or {}).get("eval")
    if recorded is not None:
        return EvalSpec(**{k: v for k, v in recorded.items() if k != "constrain_auto"})
    return load_experiment(experiment).eval


def answer_constraint(rubric: Rubric, plan: Mapping[str, Any] | None,
                      experiment: str) -> dict[str, Any] | None:
    """The ``structured_outputs`` a run's eval answers are generated under: the rubric's closed
    answer set when the run's ``eval.constrain`` (``planned_eval``) turns it on, else None.
    ``auto`` means what the plan recorded it to mean (``constrain_auto``; a plan that did not
    record it was made when ``auto`` was off); without a plan, what it means now."""
    recorded = (plan or {}).get("eval")
    auto = (CONSTRAIN_AUTO if recorded is None
            else frozenset(recorded.get("constrain_auto") or ()))
    return eval_constraint(rubric, planned_eval(plan, experiment).constrain, auto=auto)


def serving_constraint(session: LakeSession, experiment: str) -> dict[str, Any] | None:
    """The ``structured_outputs`` a deployment of ``experiment`` serves under: its best
    checkpoint's run was evaluated under it (``answer_constraint``), so its route adds it to
    requests that send none. None without a rubric or a closed answer set, or with
    ``eval.constrain`` off. Its reads are settings of the deployment, not its data: they are
    not recorded in the session's lineage (the deployment's lineage is its checkpoint's)."""
    if not session.lake.exists("rubrics"):
        return None
    quiet = LakeSession(session.lake, Lineage(run_id="", asset_key=""))
    rubric = stored_rubric(quiet, experiment)
    if rubric is None:
        return None
    run_id = None
    if session.lake.exists("best_checkpoints"):
        rows = quiet.sql("SELECT run_id FROM best_checkpoints WHERE experiment = ? "
                         "ORDER BY selected_at DESC LIMIT 1", [experiment]).to_pylist()
        run_id = rows[0]["run_id"] if rows else None
    plan = plan_of_run(quiet, run_id, experiment) if run_id else None
    return answer_constraint(rubric, plan, experiment)


def latest_rubric(session: LakeSession, experiment: str) -> Rubric:
    """The experiment's newest rubric; ``EvalError`` when it has none."""
    rubric = stored_rubric(session, experiment)
    if rubric is None:
        raise EvalError(f"experiment {experiment!r} has no rubric; materialize `rubric` first")
    return rubric


def eval_rows(session: LakeSession, experiment: str, spec: EvalSpec,
              plan: Mapping[str, Any] | None = None, *,
              final: bool = False) -> list[dict[str, Any]]:
    """The experiment's eval samples (``dataset_eval``, by ``sample_id``), at most
    ``spec.max_samples`` and, for a planned run, at most the plan's ``eval_num_samples``
    (sized for its time budget) or with ``final`` its ``eval_final_num_samples`` (a plan
    without that value: ``eval_num_samples``, no final evals). Each row: ``sample_id``,
    ``messages``, ``tools`` and ``split_group`` (its phrasing cluster: ``selection.summarize``
    treats a cluster's samples as correlated)."""
    rows = session.sql("SELECT sample_id, messages, tools, split_group FROM dataset_eval "
                       "WHERE experiment = ? ORDER BY sample_id", [experiment]).to_pylist()
    if spec.max_samples:
        rows = rows[:spec.max_samples]
    values = (plan or {}).get("values") or {}
    planned = (values.get("eval_final_num_samples") if final else None) \
        or values.get("eval_num_samples")
    if planned:
        rows = rows[:int(planned)]
    if not rows:
        raise EvalError(f"experiment {experiment!r} has no eval samples; materialize "
                        "its dataset first")
    return rows


def _append_scores(session: LakeSession, *, run_id: str, experiment: str, kind: str,
                   step: int | None, path: str | None, rubric_version: str,
                   items: Sequence[EvalItem], answers: Sequence[Any],
                   judged: Sequence[ScoreRow]) -> None:
    """``eval_scores`` rows of judged answers (``answers``: ``Generated`` from a server, or
    the references' ``Answer``)."""
    now = datetime.now(UTC)
    session.append("eval_scores", [{
        "run_id": run_id, "experiment": experiment, "step": step, "kind": kind,
        "checkpoint_path": path, "rubric_version": rubric_version,
        "sample_id": item.sample_id, "response": getattr(answer, "text", None),
        "score": row.score, "status": row.status, "judge": row.judge,
        "criteria": json.dumps(row.criteria), "assessment": row.assessment,
        "error": row.error, "finish_reason": getattr(answer, "finish_reason", None),
        "num_completion_tokens": getattr(answer, "num_completion_tokens", None),
        "evaluated_at": now} for item, answer, row in zip(items, answers, judged, strict=True)])


@dataclass(frozen=True, kw_only=True)
class Judged:
    """A model's judged answers to eval items."""

    answers: list[Generated]
    """The answers, in the items' order."""
    rows: list[ScoreRow]
    """The judge's verdict on each."""

    @property
    def scores(self) -> list[float | None]:
        return [r.score for r in self.rows]


def _answer_and_judge(session: LakeSession, client: Any, model: str,
                      items: Sequence[EvalItem], *, run_id: str, experiment: str, kind: str,
                      step: int | None, path: str | None, rubric: Rubric, judge: Any,
                      generation: Mapping[str, int],
                      constraint: dict[str, Any] | None) -> Judged:
    answers = generate_answers(client, model, items, constraint=constraint, **generation)
    rows = list(judge.score(rubric, items, [a.answer for a in answers]))
    _append_scores(session, run_id=run_id, experiment=experiment, kind=kind, step=step,
                   path=path, rubric_version=rubric.version, items=items, answers=answers,
                   judged=rows)
    return Judged(answers=answers, rows=rows)


def judge_checkpoint(session: LakeSession, client: Any, checkpoint: Checkpoint,
                     items: Sequence[EvalItem], *, rubric: Rubric, judge: Any,
                     generation: Mapping[str, int]) -> Judged:
    """``checkpoint``'s answers to ``items`` from the server behind ``client`` (which serves
    its adapter), judged by ``judge`` against ``rubric`` and appended to ``eval_scores`` as
    kind ``checkpoint`` rows; ``generation``: ``max_tokens`` and ``concurrency``
    (``generation_of``). Answers are constrained as the run's plan says
    (``answer_constraint``), so its checkpoints' answers are alike whichever step asks."""
    plan = plan_of_run(session, checkpoint.run_id, checkpoint.experiment)
    return _answer_and_judge(session, client, checkpoint.adapter, items,
                             run_id=checkpoint.run_id, experiment=checkpoint.experiment,
                             kind="checkpoint", step=checkpoint.step, path=checkpoint.path,
                             rubric=rubric, judge=judge, generation=generation,
                             constraint=answer_constraint(rubric, plan,
                                                          checkpoint.experiment))


def generation_of(size: ServingSize) -> dict[str, int]:
    """How answers are generated on a server of ``size``."""
    return {"max_tokens": size.max_new_tokens, "concurrency": size.batch_size}


def start_server(inference: Servers, checkpoints: Sequence[Checkpoint],
                 plan: Mapping[str, Any] | None) -> tuple[InferenceServer, ServingSize]:
    """A started eval server for ``checkpoints`` (one run's: one base model and plan), sized by
    the eval serving size of the run's ``plan`` (the resource's fields override it);
    ``ServerStartError`` when it does not start."""
    first = checkpoints[0]
    size = inference.serving_size(
        plan, no_plan_reason=f"run {first.run_id} has no plan in training_plans")
    server = inference.server(first.base_model(), {c.adapter: c.path for c in checkpoints},
                              size=size)
    try:
        server.start()
    except InferenceServerError as exc:
        raise ServerStartError(str(exc), serve_command=server.command(),
                               eval_serving=size.metadata()) from None
    return server, size


@dataclass(frozen=True, kw_only=True)
class CheckpointEval:
    """What ``evaluate_checkpoint`` did."""

    checkpoint: Checkpoint
    """The checkpoint."""
    equivalence: EquivalenceResult
    """The train/serve equivalence check's outcome."""
    score: StepScore | None
    """Its score on the plan's samples; None when the check failed and nothing was scored."""
    worst_answers: str
    """Its lowest-scored answers beside their references (``answers.worst_answers``)."""
    borrowed: dict[str, str]
    """Kind (``base``, ``reference``) -> the run its scores were copied from."""
    rubric_version: str
    """The rubric judged by."""
    eval_serving: dict[str, Any]
    """The server's size, each value with its source (``ServingSize.metadata``)."""
    serve_command: list[str]
    """The server's command line."""
    early_stop: EarlyStop | None
    """The stop the run's scores call for, recorded in ``early_stops``."""
    curve: Path | None
    """The run's score and loss curve (PNG); None when nothing was scored."""


def evaluate_checkpoint(session: LakeSession, run_id: str, step: int, *, judge: Any,
                        inference: Servers) -> CheckpointEval:
    """Judge checkpoint ``run_id``:``step`` on its run's eval samples (``eval_rows`` under the
    run's plan) into ``eval_scores``; the run's first eval also judges the base model (step 0)
    and the reference answers (step null), unless another run's can be copied."""
    ckpt = find_checkpoint(session, run_id, step)
    experiment = ckpt.experiment
    plan = plan_of_run(session, run_id, experiment)
    rubric = latest_rubric(session, experiment)
    rows = eval_rows(session, experiment, planned_eval(plan, experiment), plan)
    items = items_from_samples(rows)
    done = {r["kind"] for r in session.sql(
        "SELECT DISTINCT kind FROM eval_scores WHERE run_id = ? AND rubric_version = ?",
        [run_id, rubric.version]).to_pylist()} if session.lake.exists("eval_scores") else set()
    checked = [{"messages": r["messages"], "tools": r["tools"]}
               for r in rows[:NUM_EQUIVALENCE_SAMPLES]]
    base_model = ckpt.base_model()
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The trainer's side of the equivalence check needs no server: it loads the model and
        # scores while the server boots (a subprocess), each on a core (~5 s each, SmolLM2).
        view = pool.submit(trainer_view, ckpt.path, checked, base_model=base_model)
        server, size = start_server(inference, [ckpt], plan)
        try:
            views = view.result()
        except BaseException:
            server.stop()
            raise
    serve_command = server.command()
    generation = generation_of(size)
    constraint = answer_constraint(rubric, plan, experiment)
    borrowed: dict[str, str] = {}

    def same_generation(other_run: str) -> bool:
        other = plan_of_run(session, other_run, experiment) or {}
        return (other.get("base_model"), (other.get("eval_serving") or {}).get(
            "max_new_tokens"), answer_constraint(rubric, other, experiment)) == (
            (plan or {}).get("base_model"), size.max_new_tokens, constraint)

    def borrow(kind: str) -> bool:
        source = borrow_scores(session, kind=kind, run_id=run_id, experiment=experiment,
                               rubric_version=rubric.version,
                               sample_ids=[i.sample_id for i in items],
                               same_generation=same_generation)
        if source is not None:
            borrowed[kind] = source
        return source is not None

    judged: Judged | None = None
    try:
        client = server.client()
        # First: answers served with a template or tokenizer the model was not trained with
        # are not the model's answers, and must never reach eval_scores (best_checkpoint and
        # the curve read it in later runs, which this run's blocking check cannot stop).
        equivalence = check_equivalence(
            client, ckpt.adapter, ckpt.path, checked, base_model=base_model,
            # fp32 on both sides differs by summation order only; a bf16 server by ~0.1 nats.
            atol=1e-3 if inference.backend == "transformers" else 0.1, views=views)
        if "base" not in done and not borrow("base"):
            _answer_and_judge(session, client, "base", items, run_id=run_id,
                              experiment=experiment, kind="base", step=0, path=None,
                              rubric=rubric, judge=judge, generation=generation,
                              constraint=constraint)
        if equivalence.passed:
            judged = judge_checkpoint(session, client, ckpt, items, rubric=rubric, judge=judge,
                                      generation=generation)
    finally:
        server.stop()
    if "reference" not in done and not borrow("reference"):
        _append_scores(session, run_id=run_id, experiment=experiment, kind="reference",
                       step=None, path=None, rubric_version=rubric.version, items=items,
                       answers=[i.reference for i in items],
                       judged=score_reference(judge, rubric, items))
    clusters = [r["split_group"] or r["sample_id"] for r in rows]  # one per item
    score = summarize(step, judged.scores, clusters=clusters) if judged is not None else None
    stop, png = None, None
    if judged is not None:
        curves, stop = record_early_stop(session, run_id, experiment)
        png = plot_png(curves, get_settings().home / "reports" / run_id / "curve.png")
    return CheckpointEval(
        checkpoint=ckpt, equivalence=equivalence, score=score,
        worst_answers=worst_answers(items, [a.answer for a in judged.answers], judged.rows)
        if judged is not None else "",
        borrowed=borrowed, rubric_version=rubric.version, eval_serving=size.metadata(),
        serve_command=serve_command, early_stop=stop, curve=png)
