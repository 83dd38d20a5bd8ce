"""Each format's particular shapes, and the precise reasons for what is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from factory.ingest import normalize_record
from factory.normalize import NormalizeError
from tests.ingest import conversations as conv

U = {"role": "user", "content": "hi"}


def _one(record: Any, fmt: str = "auto") -> dict[str, Any]:
    [sample] = normalize_record(record, fmt)
    return sample


def _reason(record: Any, fmt: str = "auto") -> str:
    with pytest.raises(NormalizeError) as info:
        normalize_record(record, fmt)
    return info.value.reason


def test_openai_legacy_functions_refusal_and_http_image() -> None:
    sample = _one({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be terse"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": "https://x.test/a.png"}]},
        {"role": "assistant", "content": None,
         "function_call": {"name": "look", "arguments": '{"b": 2, "a": [1]}'}},
        {"role": "function", "name": "look", "content": "a cat"},
        {"role": "assistant", "content": None, "refusal": "I can't say more."}],
        "functions": [{"name": "look", "parameters": {"type": "object"}}]})
    m = sample["messages"]
    assert m[0]["role"] == "system"
    assert m[1]["content"] == [{"type": "image", "url": "https://x.test/a.png"}]
    assert m[2]["tool_calls"] == [{"id": "call_0", "name": "look", "arguments": '{"a":[1],"b":2}'}]
    assert m[3] == {"role": "tool", "tool_call_id": "call_0",
                    "content": [{"type": "text", "text": "a cat"}]}
    assert m[4]["content"] == [{"type": "text", "text": "I can't say more."}]
    assert sample["tools"] == [{"name": "look", "description": "", "parameters": {"type": "object"}}]


def test_openai_stream_reassembles_parallel_tool_call_deltas() -> None:
    base = {"object": "chat.completion.chunk", "model": "m"}
    deltas = [
        {"role": "assistant", "tool_calls": [{"index": 0, "id": "a", "type": "function",
                                              "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]},
        {"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": "[2"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "]"}}]},
    ]
    stream = [{**base, "choices": [{"index": 0, "delta": d}]} for d in deltas] + ["[DONE]"]
    sample = _one({"request": {"messages": [U]}, "stream": stream})
    assert sample["messages"][-1]["tool_calls"] == [
        {"id": "call_0", "name": "f", "arguments": '{"x":1}'},
        {"id": "call_1", "name": "g", "arguments": "[2]"}]


def test_openai_one_sample_per_choice() -> None:
    resp = {"choices": [{"message": {"role": "assistant", "content": c}} for c in "ab"]}
    samples = normalize_record({"request": {"messages": [U]}, "response": resp})
    assert [s["messages"][-1]["content"][0]["text"] for s in samples] == ["a", "b"]


def test_anthropic_thinking_tool_results_and_prefill() -> None:
    record = {"request": {"system": "sys", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "plan", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "t1", "name": "a", "input": {}},
            {"type": "tool_use", "id": "t2", "name": "b", "input": {"k": "v"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t2", "content": "plain text result"},
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "[1, 2]"},
                {"type": "image", "source": {"type": "url", "url": "https://x.test/i.jpg"}}]},
            {"type": "text", "text": "and now?"}]},
        {"role": "assistant", "content": "The answer"}]},
        "response": {"type": "message", "role": "assistant", "content": [
            {"type": "text", "text": " is 4."}]}}
    m = _one(record)["messages"]
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "tool", "user",
                                      "assistant"]
    assert m[2]["content"] == [{"type": "reasoning", "text": "plan"},
                               {"type": "text", "text": "calling"}]
    assert [(t["tool_call_id"], t["content"][0]["text"]) for t in m[3:5]] == [
        ("call_1", "plain text result"), ("call_0", "[1,2]")]
    assert m[4]["content"][1] == {"type": "image", "url": "https://x.test/i.jpg"}
    assert m[6]["content"] == [{"type": "text", "text": "The answer is 4."}]  # prefill continued


def test_anthropic_stream_with_thinking_and_tool_input_json() -> None:
    events = [
        {"type": "message_start", "message": {"role": "assistant", "content": [], "model": "c"}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "hm"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "s"}},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "x", "name": "f", "input": {}}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": '{"q": "wea'}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": 'ther"}'}},
        {"type": "message_stop"}]
    last = _one({"provider": "anthropic", "request": {"messages": [U]},
                 "stream": events})["messages"][-1]
    assert last["content"] == [{"type": "reasoning", "text": "hm"}]
    assert last["tool_calls"] == [{"id": "call_0", "name": "f", "arguments": '{"q":"weather"}'}]


@pytest.mark.parametrize("start", [None, 7, [], {}])
def test_anthropic_stream_block_started_with_non_text_is_a_precise_rejection(start: Any) -> None:
    record = conv.anthropic_stream_call()
    record["stream"][1]["content_block"]["text"] = start
    with pytest.raises(NormalizeError, match=r"stream\[3\]: block 0 started with a text that "
                                             r"is .*, not a string"):
        normalize_record(record, "anthropic")


def test_gemini_parallel_calls_matched_by_order_and_name() -> None:
    record = {"contents": [
        {"role": "user", "parts": [{"text": "both"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "a", "args": {"i": 1}}},
                                    {"functionCall": {"name": "b", "args": {}}},
                                    {"functionCall": {"name": "a", "args": {"i": 2}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "b", "response": {"r": "b"}}},
                                   {"functionResponse": {"name": "a", "response": {"r": 1}}},
                                   {"functionResponse": {"name": "a", "response": {"r": 2}}},
                                   {"text": "thanks"}]},
        {"role": "model", "parts": [{"text": "thinking...", "thought": True},
                                    {"fileData": {"mimeType": "image/jpeg",
                                                  "fileUri": "gs://b/x.jpg"}}]}]}
    m = _one(record)["messages"]
    assert [(x["tool_call_id"], x["content"][0]["text"]) for x in m[2:5]] == [
        ("call_1", '{"r":"b"}'), ("call_0", '{"r":1}'), ("call_2", '{"r":2}')]
    assert m[5] == {"role": "user", "content": [{"type": "text", "text": "thanks"}]}
    assert m[6]["content"] == [{"type": "reasoning", "text": "thinking..."},
                               {"type": "image", "url": "gs://b/x.jpg", "media_type": "image/jpeg"}]


def test_sharegpt_with_tools() -> None:
    sample = _one({"system": "s", "tools": json.dumps([{"name": "f", "description": "d",
                                                        "parameters": {}}]),
                   "conversations": [{"from": "human", "value": "q"},
                                     {"from": "function_call",
                                      "value": json.dumps({"name": "f", "arguments": {"z": 1}})},
                                     {"from": "observation", "value": "ok"},
                                     {"from": "gpt", "value": "done"}]})
    assert [m["role"] for m in sample["messages"]] == ["system", "user", "assistant", "tool",
                                                       "assistant"]
    assert sample["messages"][3]["tool_call_id"] == "call_0"


def test_otlp_indexed_attributes_and_events() -> None:
    attrs = {"gen_ai.system": "openai", "gen_ai.request.model": "m",
             "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "sys",
             "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": "hi",
             "gen_ai.completion.0.role": "assistant",
             "gen_ai.completion.0.tool_calls.0.id": "c1",
             "gen_ai.completion.0.tool_calls.0.name": "f",
             "gen_ai.completion.0.tool_calls.0.arguments": '{"a": 1}',
             "llm.request.functions.0.name": "f",
             "llm.request.functions.0.parameters": '{"type": "object"}'}
    span = {"span_id": "1", "start_time_unix_nano": 1, "attributes": attrs, "events": []}
    sample = _one({"otlp_trace": {"trace_id": "t", "spans": [span]}})
    assert sample["messages"][-1]["tool_calls"][0]["arguments"] == '{"a":1}'
    assert sample["tools"][0]["parameters"] == {"type": "object"}
    events = [{"name": "gen_ai.user.message", "attributes": {"content": "hi"}},
              {"name": "gen_ai.choice", "attributes": {
                  "message": json.dumps({"role": "assistant", "content": "hello"})}}]
    span = {"span_id": "2", "attributes": {"gen_ai.system": "x"}, "events": events}
    sample = _one({"otlp_trace": {"trace_id": "t", "spans": [span]}})
    assert sample["messages"][-1] == {"role": "assistant",
                                      "content": [{"type": "text", "text": "hello"}]}


def test_otlp_independent_subagents_yield_one_sample_each() -> None:
    def chat(i: int, text: str, answer: str) -> dict[str, Any]:
        return {"span_id": str(i), "start_time_unix_nano": i, "attributes": {
            "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [
                {"type": "text", "content": text}]}]),
            "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
                {"type": "text", "content": answer}]}])}}

    spans = [chat(1, "research A", "A done"), chat(2, "research B", "B done"),
             chat(3, "research A", "A done")]
    samples = normalize_record({"otlp_trace": {"trace_id": "t", "spans": spans}})
    assert len(samples) == 2


@pytest.mark.parametrize(("record", "reason"), [
    ({"request": {"messages": [U]}, "response": {"choices": []}},
     "response.choices: empty"),
    ({**conv.openai_call(), "partial": True}, "partial: the response ended early"),
    ({"request": {"messages": [U]}, "stream": []}, "stream: empty"),
    ({"messages": [U]}, "no assistant turn"),
    ({"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "application/pdf",
                                                              "data": "JVBERi0="}}]}]},
     "record.contents[0].parts[0].inlineData.mimeType: 'application/pdf' is not an image type"),
    ({"contents": [{"role": "narrator", "parts": [{"text": "x"}]}]},
     "record.contents[0].role: unknown role 'narrator'"),
    ({"conversations": [{"from": "alien", "value": "x"}]},
     "conversations[0].from: unknown speaker 'alien'"),
    ({"otlp_trace": {"trace_id": "t", "spans": [{"span_id": "1", "attributes": {}}]}},
     "no span carries GenAI messages"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name: expected a non-empty string"),
    ({"messages": [U, {"role": "assistant", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "record.tools[0].function.parameters: expected a JSON Schema object, got an array"),
])
def test_precise_reasons(record: Any, reason: str) -> None:
    assert reason in _reason(record)


def test_forced_format_that_does_not_fit_is_rejected() -> None:
    assert "contents: missing" in _reason(conv.openai_finetune_line(), "gemini")
    with pytest.raises(ValueError, match="unknown format"):
        normalize_record({}, "cohere")
