"""``best_checkpoint``: the highest lower bound of the score's 95% interval wins; on
checkpoints the judge cannot tell apart the trainer's held-out loss on the eval split
(``eval_loss`` in its ``progress`` events) decides, else the earlier step. Real lake and
Dagster, scores and events as the evals and the control plane write them."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.control.plane import event_row
from factory.evals.rubric import Criterion, Rubric
from factory.evals.selection import StepScore, format_score
from factory.lake import Lake
from tests.evals.conftest import write_experiment

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

RUBRIC = Rubric(criteria=(Criterion(name="label", description="the right label",
                                    check="label_match"),))
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _scores(run_id: str, means: dict[int, float]) -> list[dict[str, Any]]:
    """Four samples per step, ``mean`` of them right (quarters)."""
    rows = []
    for step, mean in means.items():
        right = round(mean * 4)
        for i in range(4):
            rows.append({"run_id": run_id, "experiment": "support", "step": step,
                         "kind": "checkpoint", "checkpoint_path": f"/ckpt/{run_id}/{step}",
                         "rubric_version": RUBRIC.version, "sample_id": f"s{i}",
                         "response": "x", "score": 1.0 if i < right else 0.0, "status": "ok",
                         "judge": "code", "evaluated_at": T0})
    return rows


def _losses(run_id: str, losses: dict[int, float], *, start: int = 0) -> list[dict[str, Any]]:
    """``progress`` events with ``eval_loss`` as the control plane stores them."""
    return [event_row({"type": "progress", "run_id": run_id, "step": step, "seq": start + k,
                       "time": (T0 + timedelta(seconds=start + k)).timestamp(),
                       "loss": 0.1, "eval_loss": loss},
                      segment_id=f"{run_id}-s0", source="events_file", received_at=T0)
            for k, (step, loss) in enumerate(losses.items())]


def _best(factory_home: Path, monkeypatch: pytest.MonkeyPatch,
          scores: list[dict[str, Any]], events: list[dict[str, Any]]) -> tuple[str, int, str]:
    """(run, step) of the row ``best_checkpoint`` writes, and its ``decided_by``."""
    from factory.assets.evals import best_checkpoint
    from factory.resources.lake import LakeResource

    write_experiment(factory_home, monkeypatch,
                     'name: support\ndata: {where: "true"}\nrecipe: smollm2-135m-lora\n')
    lake = Lake()
    lake.append("rubrics", [{"experiment": "support", "version": RUBRIC.version,
                             "source": "inline", "num_examples": 4,
                             "rubric": json.dumps(RUBRIC.to_dict()), "created_at": T0}])
    lake.append("eval_scores", scores)
    if events:
        lake.append("training_events", events)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", ["support"])
    result = dg.materialize([best_checkpoint], instance=instance, partition_key="support",
                            resources={"lake": LakeResource()})
    assert result.success
    [row] = lake.read("best_checkpoints").to_pylist()
    assert row["path"] == f"/ckpt/{row['run_id']}/{row['step']}"
    meta = result.asset_materializations_for_node("best_checkpoint")[0].metadata
    assert (meta["run_id"].value, meta["step"].value) == (row["run_id"], row["step"])
    # The asset page shows the score as every other place prints it: never a bare mean.
    assert meta["score"].value == format_score(StepScore.from_row(row))
    assert f"n={row['num_samples']} (Wilson)" in meta["score"].value
    return row["run_id"], row["step"], meta["decided_by"].value


def test_equal_scores_go_to_the_lowest_held_out_loss(factory_home: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # r1's steps 20 and 30 and r2's step 10 all score 1.0; r1's step 30 has the lowest loss
    # (step 20's event is repeated by a resumed segment: the newer value counts).
    scores = _scores("r1", {10: 0.75, 20: 1.0, 30: 1.0}) + _scores("r2", {10: 1.0})
    events = (_losses("r1", {10: 0.9, 20: 0.05, 30: 0.2}) + _losses("r1", {20: 0.4}, start=10)
              + _losses("r2", {10: 0.3}))
    assert _best(factory_home, monkeypatch, scores, events) == (
        "r1", 30, "eval loss (3 checkpoints tie on the 95% interval's lower bound 0.510)")


def test_a_higher_score_wins_whatever_its_loss(factory_home: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    scores = _scores("r1", {10: 0.75, 20: 1.0})
    events = _losses("r1", {10: 0.01, 20: 0.9})
    assert _best(factory_home, monkeypatch, scores, events) == (
        "r1", 20, "the 95% interval's lower bound 0.510, the highest (next 0.301)")


def test_without_a_loss_for_every_tied_checkpoint_the_earlier_step_wins(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scores = _scores("r1", {10: 1.0, 20: 1.0, 30: 1.0})
    events = _losses("r1", {20: 0.1, 30: 0.05})  # step 10 has none
    assert _best(factory_home, monkeypatch, scores, events) == (
        "r1", 10, "earliest step (3 checkpoints tie on the 95% interval's lower bound 0.510, "
                  "not all with an eval loss)")


def test_a_high_mean_on_few_judged_samples_loses_to_a_tighter_interval(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """r2's step 10 answered all 4 judged samples right (16 judge failures): 1.000 but
    [0.510, 1.000]; r1's step 20 answered 18 of 20 right, [0.699, 0.972]: r1's step 20 is
    chosen, and the row and the asset page carry its interval, count and method."""
    rows = [{**row, "sample_id": f"s{i}", "score": score,
             "status": "ok" if score is not None else "failed"}
            for i, score in enumerate([1.0] * 18 + [0.0] * 2)
            for row in _scores("r1", {20: 1.0})[:1]]
    rows += [{**row, "sample_id": f"s{i}", "score": score,
              "status": "ok" if score is not None else "failed"}
             for i, score in enumerate([1.0] * 4 + [None] * 16)
             for row in _scores("r2", {10: 1.0})[:1]]
    assert _best(factory_home, monkeypatch, rows, []) == (
        "r1", 20, "the 95% interval's lower bound 0.699, the highest (next 0.510)")
    [row] = Lake().read("best_checkpoints").to_pylist()
    assert (row["num_samples"], row["ci_method"]) == (20, "wilson")
    assert (round(row["ci_low"], 3), round(row["ci_high"], 3)) == (0.699, 0.972)
