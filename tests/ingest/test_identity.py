"""The same conversation in every format yields byte-identical canonical JSON and one sample_id."""

from __future__ import annotations

import json

import pytest

from factory.ingest import normalize_record
from factory.normalize import canonical_json, detect_format
from factory.normalize.canon import sample_id
from factory.normalize.otlp import split_otlp
from tests.ingest import conversations as conv

EXPECTED_FORMAT = {"openai": "openai", "openai_stream": "openai", "openai_finetune": "openai",
                   "anthropic": "anthropic", "anthropic_stream": "anthropic",
                   "gemini_camel": "gemini", "gemini_snake": "gemini", "gemini_stream": "gemini",
                   "otlp": "otlp"}


@pytest.mark.parametrize("form", sorted(conv.ALL_FORMS))
def test_every_form_normalizes_to_the_canonical_conversation(form: str) -> None:
    record = conv.ALL_FORMS[form]()
    assert detect_format(record) == EXPECTED_FORMAT[form]
    [sample] = normalize_record(record)
    assert canonical_json(sample["messages"]) == canonical_json(conv.CANONICAL_MESSAGES)
    assert canonical_json(sample["tools"]) == canonical_json(conv.CANONICAL_TOOLS)
    assert sample["sample_id"] == sample_id(conv.CANONICAL_MESSAGES, conv.CANONICAL_TOOLS)
    assert sample["blobs"] == {conv.PNG_SHA: conv.PNG}


def test_one_sample_id_across_providers() -> None:
    ids = {normalize_record(make())[0]["sample_id"] for make in conv.ALL_FORMS.values()}
    assert len(ids) == 1


def test_sample_id_is_sha256_of_the_documented_serialization() -> None:
    import hashlib

    [sample] = normalize_record(conv.openai_call())
    text = json.dumps({"messages": conv.CANONICAL_MESSAGES, "tools": conv.CANONICAL_TOOLS},
                      separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    assert sample["sample_id"] == hashlib.sha256(text.encode()).hexdigest()
    assert "°" in text  # non-ASCII kept as is, not escaped


def test_metadata_columns_stay_beside_the_identity() -> None:
    samples = {form: normalize_record(make())[0] for form, make in conv.ALL_FORMS.items()}
    assert samples["openai"]["model"] == "gpt-4o-mini-2024-07-18"
    assert samples["anthropic"]["model"] == "claude-sonnet-4-5-20250929"
    assert samples["gemini_camel"]["model"] == "gemini-2.5-flash"
    assert samples["gemini_stream"]["provider"] == "gemini"
    assert samples["otlp"]["provider"] == "openai"
    assert samples["otlp"]["model"] == "gpt-4o-mini"


def test_otlp_json_body_splits_per_trace_and_keeps_the_identity() -> None:
    body = conv.otlp_export()
    other = conv.otlp_export(trace_id="0af7651916cd43dd8448eb211c80319c")
    body["resourceSpans"] += other["resourceSpans"]
    records = split_otlp(json.dumps(body).encode(), "application/json; charset=utf-8")
    assert [r["otlp_trace"]["trace_id"] for r in records] == [
        "5b8efff798038103d269b633813fc60c", "0af7651916cd43dd8448eb211c80319c"]
    for record in records:
        assert len(record["otlp_trace"]["spans"]) == 4
        [sample] = normalize_record(record, "otlp")
        assert sample["sample_id"] == sample_id(conv.CANONICAL_MESSAGES, conv.CANONICAL_TOOLS)
    json.dumps(records)  # plain JSON, storable as raw_traces.payload
