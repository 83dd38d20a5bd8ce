"""The embedded task's generator: deterministic, well-formed, and its references are exact."""

from __future__ import annotations

import json

import pytest

from factory.normalize.detect import detect_format
from factory.tasks import INTENTS, field_accuracy, generate_conversations, generate_records


def test_same_seed_same_data_other_seed_other_data() -> None:
    assert generate_records(20, seed=3) == generate_records(20, seed=3)
    assert generate_records(20, seed=3) != generate_records(20, seed=4)


def test_references_are_exact_extractions() -> None:
    convs = generate_conversations(200, seed=0)
    seen_intents, nulls = set(), 0
    for c in convs:
        msg = c["messages"][1]["content"]
        ref = c["messages"][2]["content"]
        answer = json.loads(ref)
        assert list(answer) == ["name", "email", "company", "intent"]
        assert ref == json.dumps(answer, separators=(",", ":"), ensure_ascii=False)
        assert answer["intent"] in INTENTS
        seen_intents.add(answer["intent"])
        for key in ("name", "email", "company"):
            if answer[key] is None:
                nulls += 1
            else:
                assert answer[key] in msg, (key, msg)
    assert seen_intents == set(INTENTS)
    assert nulls > 0  # the null case is exercised


def test_records_are_openai_calls_the_ingest_recognizes() -> None:
    for rec in generate_records(5, seed=1):
        assert detect_format(rec) == "openai"
        assert rec["response"]["choices"][0]["message"]["role"] == "assistant"
        assert rec["request"]["messages"][0]["role"] == "system"


def test_field_accuracy() -> None:
    ref = '{"name":"A","email":null,"company":"C","intent":"refund"}'
    assert field_accuracy(ref, ref) == 1.0
    assert field_accuracy('{"name":"A","email":null,"company":"X","intent":"x"}', ref) == 0.5
    assert field_accuracy("Sure! Here is the JSON", ref) == 0.0
    with pytest.raises(ValueError, match="n: must be"):
        generate_conversations(-1)
