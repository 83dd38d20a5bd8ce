"""The choice of the checkpoint to deploy, recorded and shown (the ``best_checkpoint`` and
``final_evals`` assets).

- ``record_best``: ``final.choose_best``'s choice appended to ``best_checkpoints`` (the score
  with its interval, method and phrasing clusters, the base model's and the references'
  means), with what the step shows beside it: the chosen run's score per step beside the
  trainer's held-out loss, and the run's score curve plotted to
  ``$FACTORY_HOME/reports/<run_id>/curve.png``.
- ``finalists_table``: the leaders ``final.judge_finalists`` judged on the final eval set,
  before and after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from factory.evals.final import Choice, FinalEvals, choose_best
from factory.evals.report import RunCurves, plot_png, read_curves
from factory.evals.selection import format_score
from factory.experiments import Experiment
from factory.lake import LakeSession
from factory.settings import get_settings


@dataclass(frozen=True, kw_only=True)
class Recorded:
    """A choice as ``record_best`` wrote it."""

    choice: Choice
    """The checkpoint and why."""
    score_curve: str
    """Markdown: the chosen run's score per step (mean, interval) and its held-out loss."""
    plot: Path
    """The run's score curve (PNG)."""


def best_row(experiment: str, choice: Choice) -> dict[str, Any]:
    """The ``best_checkpoints`` row of ``choice``."""
    best, base, ref = choice.score, choice.base, choice.reference
    return {"experiment": experiment, "run_id": choice.run_id, "step": best.step,
            "path": choice.path, "rubric_version": choice.rubric_version,
            "mean_score": best.mean, "ci_low": best.ci_low, "ci_high": best.ci_high,
            "ci_method": best.method, "num_samples": best.num_samples,
            "num_clusters": best.num_clusters,
            "base_score": base.mean if base else None,
            "reference_score": ref.mean if ref else None, "selected_at": datetime.now(UTC)}


def score_curve_table(curves: RunCurves, eval_losses: dict[int, float]) -> str:
    """Markdown: each judged step's score (``format_score``) beside the held-out loss the
    trainer measured there (``-`` where it did not)."""
    return "| step | score | eval loss |\n|---|---|---|\n" + "\n".join(
        f"| {s} | {format_score(curves.summary(s))} | "
        + (f"{eval_losses[s]:.3g} |" if s in eval_losses else "- |") for s, _ in curves.scores)


def record_best(instance: Any, session: LakeSession, experiment: Experiment,
                runs: Sequence[str]) -> Recorded:
    """Choose the best checkpoint of ``experiment``'s ``runs`` (empty: every run) with
    ``final.choose_best`` (``instance``: the Dagster instance its progress check reads), append
    it to ``best_checkpoints`` and render what shows the choice."""
    choice = choose_best(instance, session, experiment.name, runs)
    session.append("best_checkpoints", [best_row(experiment.name, choice)])
    curves = read_curves(session, choice.run_id)
    png = plot_png(curves, get_settings().home / "reports" / choice.run_id / "curve.png")
    return Recorded(choice=choice, score_curve=score_curve_table(curves, choice.eval_losses),
                    plot=png)


def finalists_table(done: FinalEvals) -> str:
    """Markdown: each leader's score before and on the final eval set, and the answers
    added."""
    return "| run | step | before | on the final set | added |\n|---|---|---|---|---|\n" + \
        "\n".join(f"| {f.run_id} | {f.step} | {format_score(f.before)} | "
                  f"{format_score(f.after)} | {f.num_added} |" for f in done.finalists)

