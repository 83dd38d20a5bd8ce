"""The final choice among a chain's checkpoints, made on the whole eval set.

Mid-training evals judge every checkpoint on the plan's ``eval_num_samples`` (a subset sized
for the eval budget); the choice is made on ``eval_final_num_samples`` (the whole eval set, up
to what a ±0.05 interval needs). Both are the first samples of one order (``judging.eval_rows``).

- ``read_scores``: every checkpoint's judged samples under one rubric, with the base model's and
  the references'.
- ``judge_finalists`` (``final_evals``): the ``selection.FINAL_CANDIDATES`` leading checkpoints
  (``selection.leaders``: ``rank``'s order on what they were judged on) are judged on the final
  set's samples they were not judged on yet (``judging.judge_checkpoint``, one server per run
  with its leaders' adapters). The final set is the largest the runs' plans ask for: a sweep's
  leaders all end on the same samples. Nothing to judge (the plans judge every checkpoint on
  the whole set, or the leaders already are) is a no-op that says so.
- ``choose_best`` (``best_checkpoint``): ``selection.rank_final`` over the checkpoints: among
  those judged on the most samples, the highest lower bound of the 95% interval.

Both refuse to run while a checkpoint of the runs is still to be scored (``progress``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from factory.evals.answers import items_from_samples
from factory.evals.judging import (
    EvalError,
    Servers,
    eval_rows,
    find_checkpoint,
    generation_of,
    judge_checkpoint,
    latest_rubric,
    planned_eval,
    start_server,
)
from factory.evals.progress import runs_to_wait_for, unscored_checkpoints
from factory.evals.report import read_eval_losses
from factory.evals.selection import FINAL_CANDIDATES, StepScore, leaders, rank_final, summarize
from factory.inference.sizing import plan_of_run
from factory.lake import LakeSession

Key = tuple[str, int]
"""(trainer run id, step) of a checkpoint."""


class NotScoredYet(EvalError):
    """A checkpoint of the runs still waits for its ``checkpoint_evals``."""


@dataclass(kw_only=True)
class ScoredCheckpoint:
    """One checkpoint's rows in ``eval_scores``."""

    path: str
    """Its adapter directory."""
    scores: list[float | None] = field(default_factory=list)
    """One per judged sample (None: the judge failed)."""
    sample_ids: set[str] = field(default_factory=set)
    """The samples it was judged on."""
    clusters: list[str] = field(default_factory=list)
    """Each score's phrasing cluster (``summarize``'s ``clusters``)."""


@dataclass(kw_only=True)
class ScoreTable:
    """An experiment's scores under one rubric version."""

    checkpoints: dict[Key, ScoredCheckpoint] = field(default_factory=dict)
    """Each scored checkpoint."""
    base: list[float | None] = field(default_factory=list)
    """The base model's scores."""
    reference: list[float | None] = field(default_factory=list)
    """The reference answers' scores."""
    base_clusters: list[str] = field(default_factory=list)
    """Each base score's phrasing cluster."""
    reference_clusters: list[str] = field(default_factory=list)
    """Each reference score's phrasing cluster."""


def read_scores(session: LakeSession, experiment: str, rubric_version: str,
                runs: Sequence[str]) -> ScoreTable:
    """``experiment``'s scores under ``rubric_version``, of ``runs`` (empty: every run), each
    with its sample's phrasing cluster (``dataset_eval.split_group``; a sample no longer in the
    eval set is its own cluster)."""
    table = ScoreTable()
    if not session.lake.exists("eval_scores"):
        return table
    rows = session.sql(
        "SELECT run_id, step, kind, checkpoint_path, sample_id, score FROM eval_scores "
        "WHERE experiment = ? AND rubric_version = ? ORDER BY run_id, step, sample_id",
        [experiment, rubric_version]).to_pylist()
    cluster_of = {r["sample_id"]: r["split_group"] for r in session.sql(
        "SELECT sample_id, split_group FROM dataset_eval WHERE experiment = ?",
        [experiment]).to_pylist()} if session.lake.exists("dataset_eval") else {}
    wanted = set(runs)
    for r in rows:
        if wanted and r["run_id"] not in wanted:
            continue
        cluster = cluster_of.get(r["sample_id"]) or r["sample_id"]
        if r["kind"] == "checkpoint":
            ckpt = table.checkpoints.setdefault((r["run_id"], int(r["step"])),
                                                ScoredCheckpoint(path=r["checkpoint_path"]))
            ckpt.scores.append(r["score"])
            ckpt.sample_ids.add(r["sample_id"])
            ckpt.clusters.append(cluster)
        elif r["kind"] == "base":
            table.base.append(r["score"])
            table.base_clusters.append(cluster)
        elif r["kind"] == "reference":
            table.reference.append(r["score"])
            table.reference_clusters.append(cluster)
    return table


def _require_scored(session: LakeSession, instance: Any, experiment: str,
                    runs: Sequence[str]) -> None:
    pending, _ = unscored_checkpoints(instance, session.lake,
                                      runs_to_wait_for(session.lake, experiment, runs))
    if pending:
        raise NotScoredYet(f"{len(pending)} checkpoint(s) of finished runs are not scored yet "
                           f"({', '.join(pending[:5])}): their checkpoint_evals come from "
                           "checkpoint_sensor; chain_sensor selects once they are scored")


def _candidates(session: LakeSession, table: ScoreTable
                ) -> tuple[list[Key], list[tuple[StepScore, float | None]]]:
    """The checkpoints in a fixed order, each with its score and held-out loss, for ``rank``."""
    keys = sorted(table.checkpoints)
    losses = {run: read_eval_losses(session, run) for run in {k[0] for k in keys}}
    return keys, [(summarize(step, table.checkpoints[(run, step)].scores,
                             clusters=table.checkpoints[(run, step)].clusters),
                   losses[run].get(step)) for run, step in keys]


@dataclass(frozen=True, kw_only=True)
class Finalist:
    """A leading checkpoint and what the final evals added to it."""

    run_id: str
    """Its training run."""
    step: int
    """Its step."""
    before: StepScore
    """Its score on the samples it was judged on mid-training."""
    after: StepScore
    """Its score on the final set (``before`` when nothing was added)."""
    num_added: int
    """Samples the final evals judged."""


@dataclass(frozen=True, kw_only=True)
class FinalEvals:
    """What ``judge_finalists`` did, or why it had nothing to do."""

    reason: str
    """In words, with the numbers."""
    num_final_samples: int
    """The final eval set's size (0: no scored checkpoint to read it for)."""
    num_checkpoints: int
    """Scored checkpoints the leaders were chosen from."""
    finalists: list[Finalist] = field(default_factory=list)
    """The leaders, in ``rank``'s order."""
    eval_serving: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Run -> its server's size (``ServingSize.metadata``), for the runs served."""
    serve_commands: dict[str, list[str]] = field(default_factory=dict)
    """Run -> its server's command line."""

    @property
    def num_added(self) -> int:
        return sum(f.num_added for f in self.finalists)


def judge_finalists(instance: Any, session: LakeSession, experiment: str, runs: Sequence[str],
                    *, judge: Any, inference: Servers) -> FinalEvals:
    """Judge the leading checkpoints of ``runs`` (empty: every run of ``experiment``) on the
    final eval set's samples they were not judged on, into ``eval_scores``."""
    _require_scored(session, instance, experiment, runs)
    rubric = latest_rubric(session, experiment)
    table = read_scores(session, experiment, rubric.version, runs)
    if not table.checkpoints:
        return FinalEvals(reason="no final evals: no checkpoint of the runs is scored",
                          num_final_samples=0, num_checkpoints=0)
    plans = {run: plan_of_run(session, run, experiment)
             for run in sorted({k[0] for k in table.checkpoints})}
    final_rows = max((eval_rows(session, experiment, planned_eval(plan, experiment), plan,
                                final=True) for plan in plans.values()), key=len)
    subset = max(len(eval_rows(session, experiment, planned_eval(plan, experiment), plan))
                 for plan in plans.values())
    keys, cands = _candidates(session, table)
    order = leaders(cands, FINAL_CANDIDATES)
    missing = {keys[i]: [r for r in final_rows
                         if r["sample_id"] not in table.checkpoints[keys[i]].sample_ids]
               for i in order}
    before = {keys[i]: cands[i][0] for i in order}
    if not any(missing.values()):
        why = (f"the plans judge every checkpoint on the final eval set ({len(final_rows)} "
               "samples)" if subset >= len(final_rows) else
               f"the {len(order)} leading checkpoints are already judged on the final eval "
               f"set ({len(final_rows)} samples)")
        return FinalEvals(
            reason=f"no final evals: {why}", num_final_samples=len(final_rows),
            num_checkpoints=len(keys),
            finalists=[Finalist(run_id=k[0], step=k[1], before=before[k], after=before[k],
                                num_added=0) for k in before])
    serving: dict[str, dict[str, Any]] = {}
    commands: dict[str, list[str]] = {}
    added: dict[Key, list[float | None]] = {}
    added_clusters: dict[Key, list[str]] = {}
    for run in sorted({k[0] for k, rows in missing.items() if rows}):
        ckpts = [find_checkpoint(session, r, step) for (r, step), rows in missing.items()
                 if r == run and rows]
        server, size = start_server(inference, ckpts, plans.get(run))
        serving[run], commands[run] = size.metadata(), server.command()
        try:
            client = server.client()
            for ckpt in ckpts:
                key = (ckpt.run_id, ckpt.step)
                added[key] = judge_checkpoint(
                    session, client, ckpt, items_from_samples(missing[key]), rubric=rubric,
                    judge=judge, generation=generation_of(size)).scores
                added_clusters[key] = [r["split_group"] or r["sample_id"]
                                       for r in missing[key]]
        finally:
            server.stop()
    finalists = [Finalist(run_id=k[0], step=k[1], before=before[k],
                          after=summarize(k[1], table.checkpoints[k].scores + added[k],
                                          clusters=table.checkpoints[k].clusters
                                          + added_clusters[k])
                          if k in added else before[k], num_added=len(added.get(k, [])))
                 for k in before]
    return FinalEvals(
        reason=f"the {len(finalists)} leading of {len(keys)} scored checkpoints (by the lower "
               f"bound of their 95% interval on {subset} mid-training samples) judged on the "
               f"final eval set's {len(final_rows)}: {sum(map(len, added.values()))} answers "
               "added",
        num_final_samples=len(final_rows), num_checkpoints=len(keys), finalists=finalists,
        eval_serving=serving, serve_commands=commands)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The checkpoint to deploy and why."""

    run_id: str
    """Its training run."""
    path: str
    """Its adapter directory."""
    score: StepScore
    """Its score (step, mean, interval, samples)."""
    decided_by: str
    """What decided (``selection.rank_final``)."""
    rubric_version: str
    """The rubric its scores are under."""
    base: StepScore | None
    """The base model's score; None when it was not judged."""
    reference: StepScore | None
    """The reference answers' score; None when they were not judged."""
    eval_losses: dict[int, float]
    """Step -> the trainer's held-out loss, of its run."""


def choose_best(instance: Any, session: LakeSession, experiment: str,
                runs: Sequence[str]) -> Choice:
    """The checkpoint of ``runs`` (empty: every run of ``experiment``) to deploy:
    ``selection.rank_final`` over their scored checkpoints."""
    _require_scored(session, instance, experiment, runs)
    rubric_version = latest_rubric(session, experiment).version
    table = read_scores(session, experiment, rubric_version, runs)
    if not table.checkpoints:
        raise EvalError(f"experiment {experiment!r} has no evaluated checkpoints")
    keys, cands = _candidates(session, table)
    pick, decided_by = rank_final(cands, [len(table.checkpoints[k].sample_ids) for k in keys])
    run_id = keys[pick][0]

    def overall(scores: list[float | None], clusters: list[str]) -> StepScore | None:
        return summarize(0, scores, clusters=clusters) if any(s is not None for s in scores) \
            else None

    return Choice(run_id=run_id, path=table.checkpoints[keys[pick]].path,
                  score=cands[pick][0], decided_by=decided_by, rubric_version=rubric_version,
                  base=overall(table.base, table.base_clusters),
                  reference=overall(table.reference, table.reference_clusters),
                  eval_losses=read_eval_losses(session, run_id))
