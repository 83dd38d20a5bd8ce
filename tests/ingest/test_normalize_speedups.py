"""The normalizers' fast paths give what their general paths give, errors included.

Each fast path (content-only OpenAI stream chunks, Anthropic and Gemini stream text joined
once instead of added delta by delta, paths formatted only for an error, orjson bytes hashed
directly, the digit pre-check before the float regex) is checked against the slower code it
stands in for (a list subclass forces the general loop; small references re-add text one piece
at a time), or against the exact reason that code gives.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.normalize import NormalizeError, canonical_json, normalize_record
from factory.normalize.anthropic import reassemble_stream as reassemble_anthropic
from factory.normalize.canon import (
    _MAYBE_FLOAT,
    _maybe_float,
    canon_json_text,
    finish,
    lower_schema_types,
)
from factory.normalize.gemini import reassemble_stream as reassemble_gemini
from factory.normalize.openai import reassemble_stream

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "ok"}


class _Choices(list[Any]):
    """A list that is not exactly ``list``: its chunk skips the fast path."""


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except NormalizeError as exc:
        return ("NormalizeError", exc.reason)


def _chunk(delta: Any, index: Any = 0, **extra: Any) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta}],
            **extra}


_pieces = st.text(max_size=4) | st.sampled_from([None, 7, "", "[DONE]"])
_indexes = st.sampled_from([0, 0, 0, 1, True, False, 0.0, [0], "0", None])
_chunks = st.one_of(
    st.builds(lambda p, i: _chunk({"content": p}, i), _pieces, _indexes),
    st.builds(lambda p, i: _chunk({"role": "assistant", "content": p}, i), _pieces, _indexes),
    st.builds(lambda p: _chunk({"content": p}, model="m", created=1767225600), _pieces),
    st.builds(lambda p: _chunk({"reasoning_content": p}), _pieces),
    st.builds(lambda p: _chunk({"refusal": p}), _pieces),
    st.builds(lambda a: _chunk({"tool_calls": [{"index": 0, "id": "c", "function": {
        "name": "f", "arguments": a}}]}), _pieces),
    st.just(_chunk({}, finish_reason="stop")),
    st.just({"object": "chat.completion.chunk", "choices": [], "usage": {"total_tokens": 3}}),
    st.builds(lambda p: {"choices": [{"delta": {"content": p}}], "error": {"message": "x"}},
              _pieces),
    st.just({"error": {"message": "boom"}}),
    st.builds(lambda p: {"choices": [{"index": 0, "delta": {"content": p}},
                                     {"index": 1, "delta": {"content": p}}]}, _pieces),
    st.just("[DONE]"),
    st.just({"choices": [{"delta": "x"}]}),
    st.just(["not", "a", "chunk"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_chunks, max_size=8))
def test_stream_fast_path_matches_the_general_loop(stream: list[Any]) -> None:
    # The same chunks with their choices in a list subclass all take the general loop.
    general = [{**c, "choices": _Choices(c["choices"])}
               if isinstance(c, dict) and isinstance(c.get("choices"), list) else c
               for c in stream]
    assert _outcome(reassemble_stream, stream) == _outcome(reassemble_stream, general)


def test_stream_of_content_tokens_reassembles() -> None:
    stream: list[Any] = [_chunk({"role": "assistant", "content": ""}, model="m",
                                created=1767225600)]
    stream += [_chunk({"content": w}) for w in ("It ", "is ", "sunny.")]
    stream += [_chunk({"content": "B"}, index=1), _chunk({"content": "!"}, index=True),
               _chunk({}, finish_reason="stop"), "[DONE]"]
    response = reassemble_stream(stream)
    assert response["model"] == "m" and response["created"] == 1767225600
    assert [c["message"]["content"] for c in response["choices"]] == ["It is sunny.", "B!"]


def _anthropic_reference(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each block's text as every delta added to it in turn (a restart starts over)."""
    blocks: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif event["type"] == "content_block_delta":
            key = "text" if event["delta"]["type"] == "text_delta" else "thinking"
            block = blocks[event["index"]]
            block[key] = block.get(key, "") + event["delta"][key]
    return [blocks[k] for k in sorted(blocks)]


_block_starts = st.builds(
    lambda i, b: {"type": "content_block_start", "index": i, "content_block": b},
    st.integers(0, 2), st.sampled_from([{"type": "text", "text": ""}, {"type": "text"},
                                        {"type": "text", "text": "Pre"},
                                        {"type": "thinking", "thinking": ""}, {"type": "x"}]))
_block_deltas = st.builds(
    lambda i, key, t: {"type": "content_block_delta", "index": i,
                       "delta": {"type": f"{key}_delta", key: t}},
    st.integers(0, 2), st.sampled_from(["text", "thinking"]), st.text(max_size=3))


@settings(max_examples=200, deadline=None)
@given(st.lists(_block_starts | _block_deltas, max_size=12))
def test_anthropic_stream_text_is_every_delta_in_turn(events: list[dict[str, Any]]) -> None:
    started: set[int] = set()
    valid = []
    for event in events:  # deltas only for started blocks
        if event["type"] == "content_block_start":
            started.add(event["index"])
        if event["type"] == "content_block_start" or event["index"] in started:
            valid.append(event)
    stream = [{"type": "message_start", "message": {"role": "assistant", "content": []}},
              *valid, {"type": "message_stop"}]
    assert reassemble_anthropic(stream)["content"] == _anthropic_reference(valid)


def test_anthropic_stream_errors_as_the_first_bad_event() -> None:
    start = {"type": "message_start", "message": {"role": "assistant", "content": []}}
    block = {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": None}}

    def delta(text: Any) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": text}}

    assert _outcome(reassemble_anthropic, [start, block, delta(5)]) == (
        "NormalizeError", "stream[2].delta.text: expected a string, got a number")
    # a block whose own text is null cannot be extended: a rejection naming it, not a crash
    assert _outcome(reassemble_anthropic, [start, block, delta("a")]) == (
        "NormalizeError", "stream[2]: block 0 started with a text that is null, not a string, "
        "so its text_delta cannot extend it")
    assert _outcome(reassemble_anthropic, [start, delta("a")]) == (
        "NormalizeError", "stream[1].index: delta for block 0 that never started")
    assert _outcome(reassemble_anthropic, [start, {**block, "index": True}]) == (
        "NormalizeError", "stream[1].index: expected an integer")
    assert _outcome(reassemble_anthropic, [start, "x"]) == (
        "NormalizeError", "stream[1]: expected an object, got a string")


def _gemini_reference(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent text parts with the same ``thought`` merged one by one into the first."""
    out: list[dict[str, Any]] = []
    for part in parts:
        prev = out[-1] if out else None
        if ("text" in part and isinstance(part["text"], str) and prev is not None
                and isinstance(prev.get("text"), str)
                and bool(prev.get("thought")) == bool(part.get("thought"))):
            out[-1] = {**prev, "text": prev["text"] + part["text"]}
        else:
            out.append(part)
    return out


_gemini_parts = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=3)),
    st.builds(lambda t: {"thought": True, "text": t}, st.text(max_size=3)),
    st.builds(lambda t: {"text": t, "thoughtSignature": "s"}, st.text(max_size=3)),
    st.just({"text": 5}),
    st.just({"functionCall": {"name": "f", "args": {}}}))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1]), st.lists(_gemini_parts, max_size=3)),
                max_size=8))
def test_gemini_stream_merges_text_as_one_by_one(chunks: list[tuple[int, Any]]) -> None:
    stream = [{"candidates": [{"index": c, "content": {"role": "model", "parts": parts}}]}
              for c, parts in chunks]
    merged = {c["index"]: c["content"]["parts"]
              for c in reassemble_gemini(stream)["candidates"]}
    for c in merged:
        assert merged[c] == _gemini_reference([p for i, ps in chunks if i == c for p in ps])


@pytest.mark.parametrize(("record", "fmt", "reason"), [
    ({"messages": [U, {"role": "assistant", "content": None, "tool_calls": {"id": "x"}}]},
     "auto", "messages[1].tool_calls: expected an array, got an object"),
    ({"messages": [U, {"role": "assistant", "content": None, "tool_calls": ["x"]}]},
     "auto", "messages[1].tool_calls[0]: expected an object, got a string"),
    ({"messages": [U, {"role": "assistant", "content": None,
                       "tool_calls": [{"type": "web", "function": {}}]}]},
     "auto", "messages[1].tool_calls[0].type: 'web' calls are not supported"),
    ({"messages": [U, {"role": "assistant", "content": None, "tool_calls": [{"function": "f"}]}]},
     "auto", "messages[1].tool_calls[0].function: expected an object, got a string"),
    ({"messages": [U, {"role": "assistant", "content": None,
                       "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     "auto", "messages[1].tool_calls[0].function.arguments: expected a JSON string, got a number"),
    ({"messages": [U, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": 1.5, "function": {"name": "f"}}]}]},
     "auto", "messages[1].tool_calls[0].function.id: expected a string, got a number"),
    ({"messages": [U, {"role": "tool", "content": "r"}]},
     "auto", "messages[1].tool_call_id: missing on a tool message"),
    ({"messages": [U, {"role": "tool", "content": [{"type": "text", "text": 5}]}]},
     "auto", "messages[1].content[0].text: expected a string, got a number"),
    ({"request": {"messages": [U]}, "response": {"choices": "x"}},
     "auto", "response.choices: expected an array, got a string"),
    ({"request": {"messages": [U]}, "response": {"choices": ["x"]}},
     "auto", "response.choices[0]: expected an object, got a string"),
    ({"request": {"messages": [U]}, "response": {"choices": [{"message": "x"}]}},
     "auto", "response.choices[0].message: expected an object, got a string"),
    ({"request": {"messages": [U]}, "response": {"choices": [{"message": {"role": "user"}}]}},
     "openai", "response.choices[0].message.role: expected 'assistant', got 'user'"),
    ({"request": {"messages": [U], "tools": ["t"]}, "response": {"choices": [{"message": A}]}},
     "openai", "request.tools[0]: expected an object, got a string"),
    ({"request": {"messages": [U], "tools": [{"type": "web"}]},
      "response": {"choices": [{"message": A}]}},
     "openai", "request.tools[0].type: 'web' tools are not supported (only function tools)"),
    ({"request": {"messages": [U], "tools": [{"function": None}]},
      "response": {"choices": [{"message": A}]}},
     "openai", "request.tools[0].function: expected an object, got null"),
    ({"request": {"messages": [U], "tools": [{"function": {"name": ""}}]},
      "response": {"choices": [{"message": A}]}},
     "openai", "request.tools[0].function.name: expected a non-empty string, got an empty string"),
    ({"request": {"messages": [U]}, "stream": ["x"]},
     "openai", "stream[0]: expected an object, got a string"),
    ({"request": {"messages": [U]}, "stream": [{"error": {"message": "boom"}}]},
     "openai", "stream[0].error: the stream reported an error"),
    ({"request": {"messages": [U]}, "stream": [_chunk({"role": "assistant"}),
                                               _chunk({"content": "a"}, index=0.0)]},
     "openai", "stream[1].choices[0].index: expected an integer, got a number"),
    ({"request": {"messages": [U]}, "stream": [_chunk({"role": "assistant"}),
                                               _chunk({"content": "a"}, index=[0])]},
     "openai", "stream[1].choices[0].index: expected an integer, got an array"),
    ({"request": {"messages": [U]}, "stream": [_chunk({"role": "assistant"}),
                                               _chunk({"content": 7})]},
     "openai", "stream[1].choices[0].delta.content: expected a string, got a number"),
    ({"messages": ["x"], "system": "s"},
     "anthropic", "record.messages[0]: expected an object, got a string"),
    ({"messages": [{"role": "system", "content": "x"}]},
     "anthropic", "record.messages[0].role: unknown role 'system' (Anthropic has user and "
                  "assistant)"),
    ({"messages": [U, {"role": "assistant", "content": [{"type": "thinking", "thinking": 3}]}]},
     "anthropic", "record.messages[1].content[0].thinking: expected a string, got a number"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "t"}]}]},
     "anthropic", "record.messages[0].content[0].type: thinking blocks belong to assistant turns"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ""}]}]},
     "anthropic", "record.messages[0].content[0].tool_use_id: expected a non-empty string"),
    ({"messages": [{"role": "assistant",
                    "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
     "anthropic", "record.messages[0].content[0].type: tool_result blocks belong to user turns"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                 "content": [{"type": "doc"}]}]}]},
     "anthropic", "record.messages[0].content[0].content[0].type: unsupported tool_result block "
                  "type 'doc'"),
    ({"messages": [U], "tools": ["t"]},
     "anthropic", "record.tools[0]: expected an object, got a string"),
    ({"contents": ["x"]}, "gemini", "record.contents[0]: expected an object, got a string"),
    ({"contents": [{"role": "user", "parts": "x"}]},
     "gemini", "record.contents[0].parts: expected an array, got a string"),
    ({"contents": [{"role": "user", "parts": [{"text": "q"}]}],
      "systemInstruction": {"parts": ["x"]}},
     "gemini", "record.systemInstruction.parts[0]: expected an object, got a string"),
    ({"contents": [{"role": "user", "parts": [{"text": "q"}]}],
      "systemInstruction": {"parts": [{"text": 1}]}},
     "gemini", "record.systemInstruction.parts[0].text: expected a string, got a number"),
    ({"conversations": ["x"]}, "sharegpt", "conversations[0]: expected an object, got a string"),
    ({"conversations": [{"from": "human", "value": 1}]},
     "sharegpt", "conversations[0].value: expected a string, got a number"),
    ({"conversations": [{"from": "observation", "value": None}]},
     "sharegpt", "conversations[0].value: expected a string, got null"),
])
def test_paths_formatted_only_on_error_are_exact(record: Any, fmt: str, reason: str) -> None:
    with pytest.raises(NormalizeError) as info:
        normalize_record(record, fmt)
    assert info.value.reason == reason


_texts = st.text(max_size=6) | st.sampled_from(["", "\ud800", "é😀", '"\\'])
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | _texts,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(_texts, min_size=1, max_size=4), parameters=_json)
def test_finish_hashes_the_canonical_json(texts: list[str], parameters: Any) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": t}]} for t in texts]
    messages.append({"role": "assistant", "content": [{"type": "text", "text": texts[0]},
                                                      {"type": "text", "text": ""}]})
    tools = [{"name": "f", "description": "", "parameters": parameters}]
    try:
        expected_tools = canonical_json(tools)
    except NormalizeError:
        with pytest.raises(NormalizeError):
            finish(messages, tools, provider=None, model=None)
        return
    sample = finish(messages, tools, provider=None, model=None)
    assert sample["messages_json"] == canonical_json(sample["messages"])
    assert sample["tools_json"] == expected_tools
    whole = canonical_json({"messages": sample["messages"], "tools": tools})
    assert sample["sample_id"] == hashlib.sha256(whole.encode("utf-8", "surrogatepass")).hexdigest()
    assert all(p["text"] != "" for m in sample["messages"] for p in m["content"])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.sampled_from([b"1.5", b"x1e", b"09", b"0E", b"a.9", b""]))
def test_digit_precheck_agrees_with_the_float_regex(data: bytes) -> None:
    assert _maybe_float(data) == (_MAYBE_FLOAT.search(data) is not None)


@settings(max_examples=200, deadline=None)
@given(_json.filter(lambda v: not isinstance(v, str)))
def test_tool_values_serialize_as_the_reference_encoder(value: Any) -> None:
    # A string is kept or re-parsed (test_parallel checks that); any other value is encoded.
    assert _outcome(canon_json_text, value) == _outcome(canonical_json, value)


def test_schema_types_lowered_only_where_schema() -> None:
    schema: dict[str, Any] = {
        "type": "OBJECT",
        "properties": {"a": {"type": ["STRING", "NULL"], "enum": ["OBJECT"],
                             "description": "ARRAY"},
                       "b": {"type": "INTEGER", "default": "NUMBER"}},
        "items": [{"type": "BOOLEAN"}, "OBJECT"], "title": "STRING"}
    assert lower_schema_types(schema) == {
        "type": "object", "properties": {"a": {"type": ["string", "null"], "enum": ["OBJECT"],
                                               "description": "ARRAY"},
                                         "b": {"type": "integer", "default": "NUMBER"}},
        "items": [{"type": "boolean"}, "OBJECT"], "title": "STRING"}
    assert json.dumps(schema["properties"]["a"]["type"]) == '["STRING", "NULL"]'  # not mutated


@pytest.mark.parametrize(("text", "expected"), [
    ('{"b": 1, "a": [2]}', '{"a":[2],"b":1}'),
    ('\n\t {"b": 1, "a": [2]}', '{"a":[2],"b":1}'),
    ('\u3000{"b": 1}', '\u3000{"b": 1}'),  # whitespace to lstrip, not to JSON: kept as is
    ('x {"b": 1}', 'x {"b": 1}'),
    ("", ""),
    ("  plain text", "  plain text"),
])
def test_tool_text_is_canonical_only_when_it_opens_a_json_container(text: str,
                                                                    expected: str) -> None:
    assert canon_json_text(text) == expected
