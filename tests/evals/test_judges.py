"""Rubric inference, the embedded judge, and the LLM judge against a judge server on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from factory.evals import (
    Answer,
    EmbeddedJudge,
    LLMJudge,
    Rubric,
    build_rubric,
    infer_rubric,
    items_from_samples,
    score_reference,
)
from factory.tasks import generate_conversations
from tests.evals.conftest import JudgeHandler


def _rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return [{"sample_id": f"s{i}", "tools": "[]",
             "messages": json.dumps([{"role": m["role"],
                                      "content": [{"type": "text", "text": m["content"]}]}
                                     for m in c["messages"]])}
            for i, c in enumerate(generate_conversations(n, seed))]


def test_rubric_inferred_from_references() -> None:
    items = items_from_samples(_rows(30))
    rubric = build_rubric(items)
    assert rubric.kind == "json"
    assert [(c.name, c.check) for c in rubric.criteria] == [("json_fields_match", "json_match")]
    schema = rubric.criteria[0].params
    assert schema["required"] == ["name", "email", "company", "intent"]  # as the answers write them
    assert schema["properties"]["email"] == ["null", "string"]
    assert Rubric.from_dict(json.loads(rubric.to_json())).version == rubric.version
    with pytest.raises(ValueError, match="check must be one of"):
        Rubric.from_dict({"criteria": [{"name": "x", "check": "vibes"}]})


def test_tool_call_rubric() -> None:
    tools = [[{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]]
    ref = Answer(text="", tool_calls=(("get_weather", '{"city":"Paris"}'),))
    rubric = infer_rubric([ref], tools=tools)
    [crit] = rubric.criteria
    from factory.evals.rubric import check_answer

    assert crit.check == "tool_call_match" and rubric.kind == "tool_calls"
    assert check_answer(crit, ref, ref)[0] == 1.0
    same = Answer(text="", tool_calls=(("get_weather", '{ "city": "Paris" }'),))
    assert check_answer(crit, same, ref) == (1.0, "the reference's calls")
    other_city = Answer(text="", tool_calls=(("get_weather", '{"city":"Rome"}'),))
    score, why = check_answer(crit, other_city, ref)
    assert score == 0.0 and "arguments differ" in why
    # without a reference (rejection sampling) the declared schema is what is checked
    bad = Answer(text="", tool_calls=(("get_weather", '{"town":1}'),))
    score, why = check_answer(crit, bad, None)
    assert score == 0.0 and "city" in why
    assert check_answer(crit, other_city, None)[0] == 1.0


def test_embedded_judge_scores_the_exact_check() -> None:
    items = items_from_samples(_rows(6, seed=2))
    rubric = build_rubric(items)
    judge = EmbeddedJudge()
    ref_rows = score_reference(judge, rubric, items)
    assert all(r.score == pytest.approx(1.0, abs=1e-6) for r in ref_rows)
    assert {r.judge for r in ref_rows} == {"embedded:all-MiniLM-L6-v2"}
    chatty = [Answer(text="Sure! The sender seems to want help with their account.")] * 6
    rows = judge.score(rubric, items, chatty)
    assert all(r.status == "ok" and r.score == 0.0 for r in rows)
    assert "not a JSON object" in rows[0].assessment
    assert judge._model is None  # no similarity criterion: the embedder is never loaded


def _similarity_rubric() -> Rubric:
    return Rubric.from_dict({"criteria": [
        {"name": "json_match", "check": "json_match"},
        {"name": "reference_similarity", "check": "reference_similarity"}]})


def test_llm_judge_scores_retries_and_fails_loudly(judge_server: str) -> None:
    items = items_from_samples(_rows(3, seed=4))
    rubric = _similarity_rubric()
    judge = LLMJudge(base_url=judge_server, model="judge-1", max_retries=2, retry_backoff_s=0)
    answers = [Answer(text='{"name":null,"email":null,"company":null,"intent":"refund"}'),
               Answer(text="no idea"),
               Answer(text="BROKEN output that makes the stub misbehave")]
    rows = judge.score(rubric, items, answers)
    assert [r.status for r in rows] == ["ok", "ok", "failed"]
    assert all(r.judge == "llm:judge-1" for r in rows)
    sim = rows[0].criteria["reference_similarity"]
    assert sim == {"score": pytest.approx(8 / 9), "assessment": "judged by the stub"}
    assert rows[1].criteria["reference_similarity"]["score"] == pytest.approx(1 / 9)
    assert rows[0].score is not None and rows[1].score is not None
    assert rows[0].score > rows[1].score
    failed = rows[2]
    assert failed.score is None  # never a silent zero
    assert failed.error is not None and "malformed judge output" in failed.error
    assert failed.num_attempts == 3
    broken_calls = [c for c in JudgeHandler.calls if "BROKEN" in c["messages"][1]["content"]]
    assert len(broken_calls) == 3  # first try + 2 retries
    assert "invalid" in broken_calls[-1]["messages"][-1]["content"]


def test_an_llm_judge_travels_to_another_process_without_its_client(judge_server: str) -> None:
    """A Spark executor gets the judge pickled: its settings, key and headers (a factory key)
    go, its HTTP client does not (the copy opens its own), and the copy judges as the original
    does."""
    import pickle

    items = items_from_samples(_rows(2, seed=4))
    rubric = _similarity_rubric()
    judge = LLMJudge(base_url=judge_server, model="judge-1", api_key="sk-team", max_retries=0,
                     headers={"X-Factory-Key": "fk-team"})
    answers = [Answer(text='{"intent":"refund"}'), Answer(text="no idea")]
    copy = pickle.loads(pickle.dumps(judge))
    assert copy.http is not judge.http and not copy.http.is_closed
    assert copy.http.headers["Authorization"] == "Bearer sk-team"
    assert copy.http.headers["X-Factory-Key"] == "fk-team"
    assert [r.score for r in copy.score(rubric, items, answers)] == \
        [r.score for r in judge.score(rubric, items, answers)]
    assert len(JudgeHandler.calls) == 4


def test_llm_judge_unreachable_is_a_failed_row() -> None:
    items = items_from_samples(_rows(1))
    rubric = _similarity_rubric()
    judge = LLMJudge(base_url="http://127.0.0.1:9/v1", model="m", max_retries=1,
                     retry_backoff_s=0, timeout_s=2)
    [row] = judge.score(rubric, items, [items[0].reference])
    assert row.status == "failed" and row.score is None and "judge call failed" in str(row.error)


def test_an_llm_judge_adds_its_criteria_to_free_text_only() -> None:
    class Proposing(LLMJudge):
        def propose_criteria(self, items):  # type: ignore[no-untyped-def]
            return [{"name": "tone", "description": "Polite.", "weight": 1.0}]

    judge = Proposing(base_url="http://127.0.0.1:9", model="judge-1")
    exact = build_rubric(items_from_samples(_rows(6, seed=2)), judge=judge)  # JSON answers
    assert exact.kind != "free_text" and all(c.check != "llm" for c in exact.criteria)
    prose = [dict(r, messages=r["messages"].replace('{\\"name\\"', 'Dear customer, {\\"name\\"'))
             for r in _rows(6, seed=2)]
    free = build_rubric(items_from_samples(prose), judge=judge)
    assert free.kind == "free_text" and [c.name for c in free.criteria if c.check == "llm"] == \
        ["tone"]


def test_the_embedded_judge_embeds_each_reference_once(tmp_path: Path) -> None:
    items = items_from_samples(_rows(4, seed=3))
    rubric = _similarity_rubric()
    answers = [Answer(text="a short answer"), Answer(text="another one"),
               Answer(text="a third"), Answer(text="and a fourth")]
    first = EmbeddedJudge(cache_dir=tmp_path / "emb")
    encoded: list[list[str]] = []
    real = first._embedder().encode

    def spy(texts, **kw):  # type: ignore[no-untyped-def]
        encoded.append(list(texts))
        return real(texts, **kw)

    first._model.encode = spy
    want = first.score(rubric, items, answers)
    refs = {i.reference.text for i in items}
    assert sum(t in refs for batch in encoded for t in batch) == len(refs)
    encoded.clear()
    assert first.score(rubric, items, answers) == want       # the same scores from memory
    assert not any(t in refs for batch in encoded for t in batch)
    # Another run's judge (another process) reads the vectors from disk.
    second = EmbeddedJudge(cache_dir=tmp_path / "emb")
    second._embedder().encode = spy
    encoded.clear()
    assert second.score(rubric, items, answers) == want
    assert not any(t in refs for batch in encoded for t in batch)
    assert len(list((tmp_path / "emb").glob("*.npy"))) == len(refs)
