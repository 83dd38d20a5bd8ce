"""``final_evals`` -> ``best_checkpoint`` in process, with the real lake and Dagster: four
checkpoints judged mid-training on the plan's first 3 eval samples (rows as
``checkpoint_evals`` writes them), the three leaders judged on the other 3 of the final set by
the CPU inference server on the tiny model and the embedded judge
(``judging.judge_checkpoint``), then the choice among those three alone. Without final evals
in the plan it is a no-op that says why and writes nothing; with a checkpoint still to be
scored it refuses."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.control.jobs import planned_run_id
from factory.evals.answers import build_rubric, items_from_samples
from factory.experiments import load_experiment
from factory.lake import Lake
from tests.evals.conftest import canonical_rows, make_adapter, write_experiment
from tests.evals.test_assets import _resources

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

NUM_EVAL = 6
SUBSET = 3
STEPS = (10, 20, 30, 40)
PASSED = {10: 0, 20: 1, 30: 2, 40: 3}
"""Mid-training samples each step answered right, of ``SUBSET``: the leaders are 40, 30, 20."""
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _setup(factory_home: Path, monkeypatch: pytest.MonkeyPatch, *, final: int,
           paths: dict[int, Path] | None = None) -> tuple[str, str, list[str]]:
    """The experiment, its eval set, rubric and a run planned with ``SUBSET`` mid-training
    samples and ``final`` final ones, its checkpoints scored on the subset; (run id, rubric
    version, eval sample ids)."""
    write_experiment(factory_home, monkeypatch,
                     'name: support\ndata: {where: "true"}\nrecipe: smollm2-135m-lora\n')
    lake = Lake()
    rows = canonical_rows(NUM_EVAL, seed=3)
    lake.append("dataset_eval", rows)
    rubric = build_rubric(items_from_samples(rows))
    lake.append("rubrics", [{"experiment": "support", "version": rubric.version,
                             "source": rubric.source, "num_examples": NUM_EVAL,
                             "rubric": rubric.to_json(), "created_at": T0}])
    run_id = planned_run_id("support", T0)
    plan = {"values": {"eval_num_samples": SUBSET, "eval_final_num_samples": final},
            "eval": dataclasses.asdict(load_experiment("support").eval)}
    lake.append("training_plans", [{"run_key": "support", "experiment": "support",
                                    "created_at": T0, "plan": json.dumps(plan)}])
    lake.append("checkpoints", [
        {"run_id": run_id, "experiment": "support", "step": step,
         "path": str(paths[step]) if paths else f"/ckpt/{step}", "manifest_sha256": "x",
         "verified": True, "received_at": T0, "event_id": f"ev-{step}"} for step in STEPS])
    ids = sorted(r["sample_id"] for r in rows)
    lake.append("eval_scores", [
        {"run_id": run_id, "experiment": "support", "step": step, "kind": "checkpoint",
         "checkpoint_path": str(paths[step]) if paths else f"/ckpt/{step}",
         "rubric_version": rubric.version, "sample_id": sid, "response": "x",
         "score": 1.0 if i < PASSED[step] else 0.0, "status": "ok", "judge": "code",
         "evaluated_at": T0}
        for step in STEPS for i, sid in enumerate(ids[:SUBSET])])
    return run_id, rubric.version, ids


def _materialize(run_id: str, *, raise_on_error: bool = True) -> Any:
    from factory.assets.evals import best_checkpoint, final_evals

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", ["support"])
    runs = {"config": {"runs": [run_id]}}
    return dg.materialize([final_evals, best_checkpoint], instance=instance,
                          partition_key="support", resources=_resources(),
                          run_config={"ops": {"final_evals": runs, "best_checkpoint": runs}},
                          raise_on_error=raise_on_error)


@pytest.mark.slow  # one inference-server boot with three adapters: ~20 s on a quiet machine
@pytest.mark.timeout(600)
def test_the_leaders_are_judged_on_the_rest_of_the_final_set_and_chosen_among(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    paths = {step: make_adapter(tiny_model_dir, tmp_path / f"step-{step:08d}", seed=i + 1)
             for i, step in enumerate(STEPS)}
    run_id, version, ids = _setup(factory_home, monkeypatch, final=NUM_EVAL, paths=paths)
    result = _materialize(run_id)
    assert result.success

    rows = Lake().read("eval_scores").to_pylist()
    judged = {step: sorted(r["sample_id"] for r in rows if r["step"] == step) for step in STEPS}
    assert judged == {10: ids[:SUBSET], 20: ids, 30: ids, 40: ids}
    added = [r for r in rows if r["judge"] != "code"]
    assert len(added) == 3 * (NUM_EVAL - SUBSET)
    for r in added:  # rows as checkpoint_evals writes them
        assert (r["run_id"], r["kind"], r["rubric_version"]) == (run_id, "checkpoint", version)
        assert r["checkpoint_path"] == str(paths[r["step"]])
        assert r["judge"] == "embedded:all-MiniLM-L6-v2" and r["status"] == "ok"
        assert r["response"] is not None and r["num_completion_tokens"] <= 16
        assert 0.0 <= r["score"] <= 1.0 and r["criteria"].startswith("{")

    meta = {k: v.value for k, v in
            result.asset_materializations_for_node("final_evals")[0].metadata.items()}
    assert meta["final_evals"] == (
        f"the 3 leading of 4 scored checkpoints (by the lower bound of their 95% interval on "
        f"{SUBSET} mid-training samples) judged on the final eval set's {NUM_EVAL}: 9 answers "
        "added")
    assert (meta["num_final_samples"], meta["num_checkpoints"], meta["num_added"]) == (6, 4, 9)
    table = meta["finalists"].splitlines()
    assert [line.split(" | ")[1] for line in table[2:]] == ["40", "30", "20"]
    assert all(" n=6 " in line and line.endswith(" | 3 |") for line in table[2:])
    # One server for the run, serving the three leaders' adapters.
    argv = meta["serve_command"][run_id]
    assert {f"{run_id}-step-{s}={paths[s]}" for s in (20, 30, 40)} <= set(argv)
    assert f"{run_id}-step-10={paths[10]}" not in argv
    assert meta["eval_serving"][run_id]["batch_size"]["source"] == "override"

    [best] = Lake().read("best_checkpoints").to_pylist()
    assert best["step"] in (20, 30, 40) and best["num_samples"] == NUM_EVAL
    decided = result.asset_materializations_for_node("best_checkpoint")[0].metadata[
        "decided_by"].value
    assert decided.endswith("; among the 3 of 4 checkpoints judged on the final eval set "
                            "(6 samples), the others on fewer")


def test_without_final_evals_in_the_plan_nothing_is_judged_or_written(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id, _, _ = _setup(factory_home, monkeypatch, final=SUBSET)
    lake = Lake()
    before = lake.table("eval_scores").current_snapshot().snapshot_id
    result = _materialize(run_id)
    assert result.success
    meta = result.asset_materializations_for_node("final_evals")[0].metadata
    assert meta["final_evals"].value == ("no final evals: the plans judge every checkpoint on "
                                         f"the final eval set ({SUBSET} samples)")
    assert meta["num_added"].value == 0
    assert lake.table("eval_scores").current_snapshot().snapshot_id == before
    # The choice is on the subset: every checkpoint is judged on the same samples.
    [best] = lake.read("best_checkpoints").to_pylist()
    assert (best["step"], best["num_samples"]) == (40, SUBSET)
    decided = result.asset_materializations_for_node("best_checkpoint")[0].metadata[
        "decided_by"].value
    assert "final eval set" not in decided


def test_a_checkpoint_still_to_be_scored_holds_the_final_evals_back(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id, _, _ = _setup(factory_home, monkeypatch, final=NUM_EVAL)
    Lake().append("checkpoints", [{"run_id": run_id, "experiment": "support", "step": 50,
                                   "path": "/ckpt/50", "manifest_sha256": "x", "verified": True,
                                   "received_at": T0, "event_id": "ev-50"}])
    result = _materialize(run_id, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert failure.step_key == "final_evals"
    assert f"1 checkpoint(s) of finished runs are not scored yet ({run_id}:50)" in str(
        failure.event_specific_data.error)
