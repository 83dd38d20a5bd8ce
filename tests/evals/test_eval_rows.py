"""The eval set a checkpoint is judged on: the experiment's cap, then the plan's count; the
final set the leading checkpoints are judged on: the same samples first, then the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.evals.judging import EvalError, eval_rows
from factory.experiments import EvalSpec
from factory.lake import Lake, LakeSession, Lineage
from tests.evals.conftest import canonical_rows


def test_a_planned_run_is_judged_on_the_plans_eval_count(factory_home: Path) -> None:
    session = LakeSession(Lake(), Lineage(run_id="r", asset_key="checkpoint_evals"))
    Lake().append("dataset_eval", canonical_rows(2, seed=1, experiment="other"))
    with pytest.raises(EvalError, match="'support' has no eval samples"):
        eval_rows(session, "support", EvalSpec())
    Lake().append("dataset_eval", canonical_rows(9, seed=1))
    every = [r["sample_id"] for r in eval_rows(session, "support", EvalSpec())]
    assert len(every) == 9
    plan = {"values": {"eval_num_samples": 4}}
    assert [r["sample_id"] for r in eval_rows(session, "support", EvalSpec(), plan=plan)] == \
        every[:4]
    assert len(eval_rows(session, "support", EvalSpec(max_samples=3), plan=plan)) == 3
    assert len(eval_rows(session, "support", EvalSpec(), plan={"values": {}})) == 9
    # The final set: the mid-training samples first, then the rest; a plan without
    # eval_final_num_samples judges its leaders on nothing more.
    final = {"values": {"eval_num_samples": 4, "eval_final_num_samples": 7}}
    assert [r["sample_id"] for r in eval_rows(session, "support", EvalSpec(), final,
                                              final=True)] == every[:7]
    assert len(eval_rows(session, "support", EvalSpec(), final)) == 4
    assert len(eval_rows(session, "support", EvalSpec(), plan, final=True)) == 4
    assert len(eval_rows(session, "support", EvalSpec(max_samples=5), final, final=True)) == 5
    assert len(eval_rows(session, "support", EvalSpec(), None, final=True)) == 9
