"""The sweep comparison table shows each run's best mean rubric score from ``eval_scores``."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.experiments import parse_experiment, run_id, run_key, sweep_points
from factory.lake import Lake
from factory.planner.service import sweep_comparison

TEXT = """
name: sw
data: {where: "true"}
recipe: smollm2-135m-lora
sweep: {learning_rate: [1.0e-4, 2.0e-4]}
"""


def test_best_eval_is_best_checkpoint_mean(factory_home: Path) -> None:
    from datetime import UTC, datetime

    from factory.control.jobs import planned_run_id

    exp = parse_experiment(TEXT, factory_home / "sw.yaml")
    [p1, p2] = sweep_points(exp)
    planned = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    Lake().append("training_plans", [{"run_key": run_key("sw", p1), "experiment": "sw",
                                      "plan": "{}", "created_at": planned}])
    rid = planned_run_id(run_key("sw", p1), planned)
    # a run of the key's name without its plan stamp is another run: never counted
    Lake().append("eval_scores", [{"run_id": run_id(run_key("sw", p1)), "experiment": "sw",
                                   "step": 10, "kind": "checkpoint", "score": 1.0,
                                   "status": "ok", "judge": "embedded"}])
    rows = []
    for step, scores in ((10, [0.2, 0.4]), (20, [0.6, 0.8]), (30, [0.5, 0.5])):
        rows += [{"run_id": rid, "experiment": "sw", "step": step, "kind": "checkpoint",
                  "score": s, "status": "ok", "judge": "embedded"} for s in scores]
    # a failed score and the base model's score never count
    rows.append({"run_id": rid, "experiment": "sw", "step": 30, "kind": "checkpoint",
                 "score": None, "status": "failed", "judge": "embedded"})
    rows.append({"run_id": rid, "experiment": "sw", "step": 0, "kind": "base", "score": 0.99,
                 "status": "ok", "judge": "embedded"})
    Lake().append("eval_scores", rows)
    table = {r["run_key"]: r for r in sweep_comparison(Lake(), exp)}
    assert table[run_key("sw", p1)]["best_eval_score"] == pytest.approx(0.7)
    assert table[run_key("sw", p2)]["best_eval_score"] is None
