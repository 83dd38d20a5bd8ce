"""``rubric`` -> ``checkpoint_evals`` (two checkpoints) -> ``best_checkpoint`` in process, with the
real lake, the embedded judge and the CPU inference server on the tiny model; then read back."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.evals.selection import StepScore, format_score, summarize
from factory.lake import Lake
from factory.tables import TABLES
from tests.evals.conftest import canonical_rows, make_adapter, write_experiment

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

NUM_EVAL = 4
RUN = "support-run-1"
STEPS = (10, 20)


def _resources() -> dict[str, Any]:
    from factory.resources.inference import CPUInferenceResource
    from factory.resources.judge import EmbeddedJudgeResource
    from factory.resources.lake import LakeResource

    # 16 new tokens keep generation on the random tiny model to a few seconds.
    return {"lake": LakeResource(), "judge": EmbeddedJudgeResource(),
            "inference": CPUInferenceResource(threads=1, max_tokens=16, concurrency=4,
                                              max_num_seqs=4, max_model_len=1024,
                                              startup_timeout_s=240)}


def _checks(result: Any) -> dict[str, bool]:
    return {e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data.passed
            for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}


@pytest.mark.slow  # two inference-server boots: ~50 s on a quiet machine
@pytest.mark.timeout(600)
def test_rubric_checkpoint_evals_best_checkpoint(factory_home: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 tiny_model_dir: Path, tmp_path: Path) -> None:
    from factory.assets.evals import best_checkpoint, checkpoint_evals
    from factory.assets.rubric import rubric

    write_experiment(factory_home, monkeypatch,
                     'name: support\ndata: {where: "true"}\nrecipe: smollm2-135m-lora\n'
                     f"eval: {{rubric: auto, max_samples: {NUM_EVAL}}}\n")
    lake = Lake()
    # one more eval row than max_samples: the cap must hold
    lake.append("dataset_eval", canonical_rows(NUM_EVAL + 1, seed=3))
    paths = {}
    for i, step in enumerate(STEPS):
        paths[step] = make_adapter(tiny_model_dir, tmp_path / f"step-{step:08d}", seed=i + 1,
                                   loss_history=[[s, 3.0 - 0.1 * s] for s in range(1, step + 1)])
    assert "checkpoints" in TABLES
    lake.append("checkpoints", [
        {"run_id": RUN, "experiment": "support", "step": step, "path": str(paths[step]),
         "manifest_sha256": f"sha-{step}", "verified": True,
         "received_at": datetime.now(UTC), "event_id": f"ev-{step}"} for step in STEPS])

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", ["support"])
    keys = [f"{RUN}:{step}" for step in STEPS]
    instance.add_dynamic_partitions("checkpoints", keys)
    resources = _resources()

    assert dg.materialize([rubric], instance=instance, partition_key="support",
                          resources=resources).success
    [stored] = lake.read("rubrics").to_pylist()
    assert stored["source"] == "auto" and stored["num_examples"] == NUM_EVAL
    assert '"json_fields_match"' in stored["rubric"]

    for key in keys:
        result = dg.materialize([checkpoint_evals], instance=instance, partition_key=key,
                                resources=resources, raise_on_error=False)
        assert result.success, key
        assert _checks(result) == {"train_serve_equivalence": True}
        meta = result.asset_materializations_for_node("checkpoint_evals")[0].metadata
        assert meta["judge"].value == "embedded:all-MiniLM-L6-v2"
        # The asset page's score: mean, 95% interval, count and method, never a bare mean.
        assert meta["score"].value == format_score(StepScore.from_row(
            {k: meta[k].value for k in ("mean_score", "ci_low", "ci_high", "num_samples",
                                        "ci_method", "num_failed")}))
        assert f"n={NUM_EVAL} (Wilson" in meta["score"].value
        # Beside the score, the answers it is lowest on, each with the reference it missed.
        worst = meta["worst_answers"].value.splitlines()
        assert worst[0] == "| request | reference | answer | score | judge |"
        assert len(worst) == 2 + min(5, NUM_EVAL)
        assert Path(meta["curve"].value).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # No plan for this run: the resource's fields are overrides, the rest defaults.
        size = meta["eval_serving"].value
        assert size["batch_size"]["source"] == "override"
        assert size["tensor_parallel_size"] == {
            "value": 1, "source": "default", "reason": f"run {RUN} has no plan in training_plans"}
        argv = meta["serve_command"].value
        assert argv[argv.index("--max-num-seqs") + 1] == "4"

    rows = lake.read("eval_scores").to_pylist()
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_kind[r["kind"]].append(r)
    # the base model and the references are scored once per run, each checkpoint once
    assert {k: len(v) for k, v in by_kind.items()} == {
        "base": NUM_EVAL, "reference": NUM_EVAL, "checkpoint": NUM_EVAL * len(STEPS)}
    assert {r["step"] for r in by_kind["base"]} == {0}
    assert {r["step"] for r in by_kind["reference"]} == {None}
    assert {r["step"] for r in by_kind["checkpoint"]} == set(STEPS)
    assert len({r["sample_id"] for r in rows}) == NUM_EVAL
    assert {r["judge"] for r in rows} == {"embedded:all-MiniLM-L6-v2"}
    assert {r["status"] for r in rows} == {"ok"}
    assert {r["rubric_version"] for r in rows} == {stored["version"]}
    assert all(r["score"] == pytest.approx(1.0, abs=1e-6) for r in by_kind["reference"])
    for r in by_kind["checkpoint"]:
        assert r["checkpoint_path"] == str(paths[r["step"]])
        assert 0.0 <= r["score"] <= 1.0 and r["criteria"].startswith("{")
        assert r["response"] is not None and r["num_completion_tokens"] <= 16
        assert r["finish_reason"] in ("stop", "length")

    result = dg.materialize([best_checkpoint], instance=instance, partition_key="support",
                            resources=resources)
    assert result.success
    [best] = lake.read("best_checkpoints").to_pylist()

    def mean(kind: str, step: int | None = None) -> float:
        scores = [r["score"] for r in by_kind[kind] if step is None or r["step"] == step]
        return sum(scores) / len(scores)

    means = {step: mean("checkpoint", step) for step in STEPS}
    # The highest lower bound of the 95% interval; ties: the earlier step.
    lows = {step: summarize(step, [r["score"] for r in by_kind["checkpoint"]
                                   if r["step"] == step]).ci_low for step in STEPS}
    expected = min(s for s, low in lows.items() if low >= max(lows.values()) - 1e-12)
    assert (best["run_id"], best["step"]) == (RUN, expected)
    assert best["path"] == str(paths[expected])
    assert best["mean_score"] == pytest.approx(means[expected])
    assert best["ci_low"] == pytest.approx(lows[expected])
    assert best["ci_low"] <= best["mean_score"] <= best["ci_high"]
    assert best["num_samples"] == NUM_EVAL
    assert best["ci_method"] in ("wilson", "wilson_graded")
    best_meta = result.asset_materializations_for_node("best_checkpoint")[0].metadata
    assert best_meta["score"].value.startswith(f"{best['mean_score']:.3f} [")
    assert f"n={NUM_EVAL} (Wilson" in best_meta["score"].value
    assert best["base_score"] == pytest.approx(mean("base"))
    assert best["reference_score"] == pytest.approx(1.0, abs=1e-6)
    assert best["rubric_version"] == stored["version"]


def test_checkpoint_evals_refuses_unknown_or_unverified_checkpoints(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from factory.assets.evals import checkpoint_evals

    write_experiment(factory_home, monkeypatch,
                     'name: support\ndata: {where: "true"}\nrecipe: smollm2-135m-lora\n')
    Lake().append("checkpoints", [{"run_id": RUN, "experiment": "support", "step": 5,
                                   "path": str(tmp_path), "verified": False}])
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("checkpoints", [f"{RUN}:5", f"{RUN}:6", "no-step"])
    for key, message in ((f"{RUN}:5", "not in `checkpoints` as verified"),
                         (f"{RUN}:6", "not in `checkpoints` as verified"),
                         ("no-step", "expected '<run_id>:<step>'")):
        result = dg.materialize([checkpoint_evals], instance=instance, partition_key=key,
                                resources=_resources(), raise_on_error=False)
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert message in str(failure.event_specific_data.error), key
