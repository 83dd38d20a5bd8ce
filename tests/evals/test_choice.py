"""What a choice of checkpoint writes and shows (``factory.evals.choice``): the
``best_checkpoints`` row, the score curve beside the held-out loss, the finalists before and
after the final evals. The choice itself is tested through ``best_checkpoint``
(test_best_checkpoint.py, test_final_evals.py)."""

from __future__ import annotations

from factory.evals.choice import best_row, finalists_table, score_curve_table
from factory.evals.final import Choice, FinalEvals, Finalist
from factory.evals.report import RunCurves
from factory.evals.selection import format_score, summarize


def test_the_best_row_holds_the_score_its_interval_and_the_baselines() -> None:
    best = summarize(40, [1.0, 1.0, 1.0, 0.0])
    choice = Choice(run_id="r1", path="/ckpt/r1/40", score=best, decided_by="the lower bound",
                    rubric_version="v1", base=summarize(0, [0.0, 1.0]), reference=None,
                    eval_losses={})
    row = best_row("support", choice)
    assert {k: row[k] for k in ("experiment", "run_id", "step", "path", "rubric_version",
                                "mean_score", "num_samples", "base_score",
                                "reference_score")} == {
        "experiment": "support", "run_id": "r1", "step": 40, "path": "/ckpt/r1/40",
        "rubric_version": "v1", "mean_score": 0.75, "num_samples": 4, "base_score": 0.5,
        "reference_score": None}
    assert (row["ci_low"], row["ci_high"], row["ci_method"]) == (best.ci_low, best.ci_high,
                                                                 best.method)
    assert row["ci_low"] < 0.75 < row["ci_high"] and row["selected_at"].tzinfo is not None


def test_the_score_curve_shows_each_step_with_its_held_out_loss_where_measured() -> None:
    samples = {0: [0.0, 0.0, 1.0], 20: [1.0, 1.0, 0.0], 40: [1.0, 1.0, 1.0]}
    curves = RunCurves(run_id="r1", samples=samples,
                       scores=[(s, sum(v) / len(v)) for s, v in samples.items()])
    lines = score_curve_table(curves, {20: 0.41234, 40: 0.3}).splitlines()
    assert lines[:2] == ["| step | score | eval loss |", "|---|---|---|"]
    assert lines[2:] == [
        f"| 0 | {format_score(summarize(0, samples[0]))} | - |",
        f"| 20 | {format_score(summarize(20, samples[20]))} | 0.412 |",
        f"| 40 | {format_score(summarize(40, samples[40]))} | 0.3 |"]


def test_the_finalists_table_shows_each_leader_before_and_after() -> None:
    before, after = summarize(20, [1.0, 0.0]), summarize(20, [1.0, 0.0, 1.0, 1.0])
    done = FinalEvals(reason="judged", num_final_samples=4, num_checkpoints=3, finalists=[
        Finalist(run_id="r1", step=20, before=before, after=after, num_added=2),
        Finalist(run_id="r2", step=10, before=before, after=before, num_added=0)])
    assert finalists_table(done).splitlines()[2:] == [
        f"| r1 | 20 | {format_score(before)} | {format_score(after)} | 2 |",
        f"| r2 | 10 | {format_score(before)} | {format_score(before)} | 0 |"]
