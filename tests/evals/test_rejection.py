"""Rejection sampling: the ``dataset`` asset drops samples the judge scores below
``data.judge_threshold``; the judge sees each sample's own answer, never a reference."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.evals import LLMJudge, Rubric
from factory.evals.judges import JudgeOutputError
from factory.evals.rejection import RejectionJudge, reference_free, rejection_judge
from factory.lake import Lake
from factory.tasks import generate_conversations
from tests.evals.conftest import JudgeHandler, write_experiment

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

# Valid JSON, so the curation format detector lets it through; only the judge's schema and
# length criteria catch it.
WRONG_SCHEMA = '{"answer":"refund"}'


def _samples(n: int, *, seed: int, corrupt: set[int]) -> list[dict[str, Any]]:
    rows = []
    for i, conv in enumerate(generate_conversations(n, seed)):
        messages = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                    for m in conv["messages"]]
        if i in corrupt:
            messages[-1]["content"] = [{"type": "text", "text": WRONG_SCHEMA}]
        rows.append({"sample_id": f"s{i:03d}", "raw_trace_id": f"t{i:03d}", "source": "upload",
                     "provider": "openai", "model": "gpt-4o", "messages": json.dumps(messages),
                     "tools": "[]", "num_turns": 1, "has_images": False,
                     "has_tool_calls": False, "created_at": datetime(2026, 1, 1, tzinfo=UTC),
                     "project": "support", "tags": [("project", "support")]})
    return rows


def test_dataset_drops_samples_the_judge_scores_below_threshold(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path) -> None:
    from factory.assets.curation import dataset
    from factory.resources.judge import EmbeddedJudgeResource
    from factory.resources.lake import LakeResource

    corrupt = {3, 11, 17, 26, 33}
    samples = _samples(40, seed=8, corrupt=corrupt)
    Lake().append("samples", samples)
    write_experiment(factory_home, monkeypatch,
                     'name: support\ndata: {where: "true", max_tokens: 512, '
                     "judge_threshold: 0.8}\nrecipe: smollm2-135m-lora\n")
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", ["support"])
    result = dg.materialize([dataset], instance=instance, partition_key="support",
                            resources={"lake": LakeResource(), "judge": EmbeddedJudgeResource()})
    assert result.success
    meta = result.asset_materializations_for_node("dataset")[0].metadata
    assert meta["judge"].value == "embedded:all-MiniLM-L6-v2"

    lake = Lake()
    drops = lake.read("dataset_drops").to_pylist()
    judged = {d["sample_id"]: d for d in drops if d["reason"] == "judge_below_threshold"}
    dropped_before = {d["sample_id"] for d in drops} - set(judged)
    bad = {f"s{i:03d}" for i in corrupt}
    # every corrupted sample that reached the judge step was rejected there, and only those
    assert set(judged) == bad - dropped_before and judged
    assert all(d["step"] == "judge" and "< 0.8" in d["detail"] for d in judged.values())
    kept = [r for t in ("dataset_train", "dataset_eval") for r in lake.read(t).to_pylist()]
    assert kept and not {r["sample_id"] for r in kept} & bad
    assert all(WRONG_SCHEMA not in r["messages"] for r in kept)


def test_rejection_judge_scores_own_answers_without_a_reference(judge_server: str) -> None:
    rows = _samples(6, seed=2, corrupt={4})
    rubric = Rubric.from_dict({"criteria": [
        {"name": "json_valid", "check": "json_valid"},
        {"name": "json_fields_match", "check": "json_fields_match"},
        {"name": "reference_similarity", "check": "reference_similarity"},
        {"name": "names_intent", "check": "llm", "description": "Names the intent."}]})
    llm = LLMJudge(base_url=judge_server, model="judge-1", max_retries=1, retry_backoff_s=0)
    judge = rejection_judge(llm, rows, rubric=rubric.to_dict())
    assert [c.name for c in judge.rubric.criteria] == ["json_valid", "names_intent"]
    scores = judge.score_many(rows)
    assert len(JudgeHandler.calls) == len(rows)
    for call in JudgeHandler.calls:
        assert "## Reference answer" not in call["messages"][1]["content"]
        assert "reference" not in call["messages"][0]["content"]
    for row, score in zip(rows, scores, strict=True):
        answer = json.loads(row["messages"])[-1]["content"][0]["text"]
        stub = 8 / 9 if "refund" in answer else 1 / 9  # the stub's 9 or 2 out of 10
        assert score == pytest.approx((1.0 + stub) / 2)
    broken = dict(rows[0], messages=rows[0]["messages"].replace("Extract", "BROKEN Extract"))
    with pytest.raises(JudgeOutputError, match="failed on 1 of 1 samples"):
        judge.score(broken)


def test_an_ordered_stream_is_read_only_as_far_as_the_rubric_needs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark engine streams the selection in sample_id order: the rubric is the one the
    whole, sorted selection gives, and the rows past its examples are never read."""
    from factory.evals import EmbeddedJudge
    from factory.evals import rejection as rejection_module

    monkeypatch.setattr(rejection_module, "MAX_RUBRIC_EXAMPLES", 5)
    rows = _samples(20, seed=5, corrupt=set())
    read = []

    def stream() -> Any:
        for r in rows:
            read.append(r["sample_id"])
            yield r

    whole = rejection_judge(EmbeddedJudge(), list(reversed(rows)))
    streamed = rejection_judge(EmbeddedJudge(), stream(), ordered=True)
    assert streamed.rubric.to_dict() == whole.rubric.to_dict()
    assert read == [r["sample_id"] for r in rows[:5]]


def test_reference_free_rubric() -> None:
    rows = _samples(20, seed=5, corrupt=set())
    from factory.evals import EmbeddedJudge

    judge = rejection_judge(EmbeddedJudge(), rows)
    names = [c.name for c in judge.rubric.criteria]
    assert names == ["json_fields_match"]  # without a reference: the keys and types it declares
    assert judge.score_many(rows) == [1.0] * 20
    only_ref = Rubric.from_dict({"criteria": [{"name": "sim", "check": "reference_similarity"}]})
    with pytest.raises(ValueError, match="without a reference answer"):
        RejectionJudge(EmbeddedJudge(), only_ref)
    llm_only = Rubric.from_dict({"criteria": [{"name": "tone", "check": "llm"}]})
    with pytest.raises(ValueError, match="without a reference answer"):
        reference_free(llm_only, llm=False)
    with pytest.raises(ValueError, match="named rubrics are not supported"):
        rejection_judge(EmbeddedJudge(), rows, rubric="strict")
