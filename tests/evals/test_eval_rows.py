"""The eval set a checkpoint is judged on: the experiment's cap, then the plan's count."""

from __future__ import annotations

from pathlib import Path

from factory.assets.rubric import eval_rows
from factory.experiments import EvalSpec
from factory.lake import Lake, LakeSession, Lineage
from tests.evals.conftest import canonical_rows


def test_a_planned_run_is_judged_on_the_plans_eval_count(factory_home: Path) -> None:
    Lake().append("dataset_eval", canonical_rows(9, seed=1))
    session = LakeSession(Lake(), Lineage(run_id="r", asset_key="checkpoint_evals"))
    every = [r["sample_id"] for r in eval_rows(session, "support", EvalSpec())]
    assert len(every) == 9
    plan = {"values": {"eval_num_samples": 4}}
    assert [r["sample_id"] for r in eval_rows(session, "support", EvalSpec(), plan=plan)] == \
        every[:4]
    assert len(eval_rows(session, "support", EvalSpec(max_samples=3), plan=plan)) == 3
    assert len(eval_rows(session, "support", EvalSpec(), plan={"values": {}})) == 9
