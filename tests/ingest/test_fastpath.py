"""Logged OpenAI calls read in C (``factory/normalize/_fastpath.c``): the same bytes as
orjson, the same rows as the Python path, and None wherever it cannot be sure."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import factory.ingest.rows as rows
from factory import native
from tests.ingest import conversations as conv
from tests.ingest.test_fuzz import _mutate, _paths


def _not_used() -> str | None:
    """Why the ingest does not use the C module's rules here, or None."""
    if native.status() != "compiled":
        return f"normalizers {native.status()}: `make native` builds the C module"
    if rows._FAST is None or not rows._FAST_RULES:
        return f"the C fast path is {native.fastpath()}: the ingest runs the Python rules"
    return None


_WHY_NOT = _not_used()
if _WHY_NOT and os.environ.get(native.FASTPATH_ENV) == "verify":
    # ``python -m factory.native verify`` records a pass: a skip must not read as one
    raise RuntimeError(f"cannot verify the C fast path: {_WHY_NOT}")
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")

ROOT = Path(__file__).resolve().parents[2]


def _module() -> Any:
    from factory.normalize import _fastpath

    return _fastpath


def _reference(text: bytes) -> bytes | None:
    try:
        return orjson.dumps(orjson.loads(text), option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        return None


# -- canonical bytes -----------------------------------------------------------------------------
_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12) \
    | st.sampled_from(["\x00\x1f\b\f\n\r\t\"\\/", "é", "😀 \U0010ffff", "\u2028\x7f", ""])
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.sampled_from([0, -0.0, 1.0, 1e16, 1e-7, 123456789012345678, 10**19]) | _text,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(_text, children, max_size=5), max_leaves=25)
_SETTINGS = settings(max_examples=300, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(value=_values, ascii_=st.booleans(), indent=st.sampled_from([None, 0, 2]),
       compact=st.booleans())
def test_canonical_bytes_are_orjson_s(value: Any, ascii_: bool, indent: int | None,
                                      compact: bool) -> None:
    # every spelling json writes: escaped or not, indented or not, any key order
    text = json.dumps(value, ensure_ascii=ascii_, indent=indent,
                      separators=(",", ":") if compact else None).encode()
    expected = _reference(text)
    got = _module().canonical_bytes(text)
    if expected is None:  # (infinities: json writes what orjson refuses)
        assert got is None
    else:
        assert got == expected


@_SETTINGS
@given(data=st.data(), form=st.sampled_from(sorted(conv.ALL_FORMS)))
def test_mutated_bytes_are_orjson_s_or_none(data: st.DataObject, form: str) -> None:
    text = bytearray(json.dumps(conv.ALL_FORMS[form](), ensure_ascii=data.draw(st.booleans()))
                     .encode())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text) - 1))
        action = data.draw(st.sampled_from(["delete", "insert", "replace"]))
        byte = data.draw(st.sampled_from([b'"', b"\\", b"{", b"]", b",", b":", b"\x00", b"\xff",
                                          b"\xc3", b"u", b"0", b"-", b"e", b" ", b"\n"]))
        if action == "delete":
            del text[at]
        elif action == "insert":
            text[at:at] = byte
        else:
            text[at:at + 1] = byte
    got = _module().canonical_bytes(bytes(text))
    assert got is None or got == _reference(bytes(text))


@pytest.mark.parametrize("text", [
    b'{"a":1,"a":2}',  # a dict keeps the last value
    b'{"a":1,"\\u0061":2}',  # the same key, escaped
    b'"\\ud800"', b'"\\udc00\\ud800"', b'"\\ud83d x"',  # lone surrogates
    b'"\xed\xa0\x80"', b'"\xc0\xaf"', b'"\xff"',  # not UTF-8
    b"NaN", b"[Infinity]", b"1e999", b"[1,]", b"{}x", b"01", b"[1 2]", b'"a\tb"', b"",
    b"[" * 600 + b"]" * 600, b"[" * 255 + b"]" * 255,  # deeper than orjson writes
])
def test_canonical_bytes_refuse_what_they_cannot_be_sure_of(text: bytes) -> None:
    assert _module().canonical_bytes(text) is None


def test_canonical_bytes_as_deep_as_orjson_writes() -> None:
    text = b'{"a":' * 127 + b"[" * 127 + b"[1e-7]" + b"]" * 127 + b"}" * 127  # 255 deep
    assert _module().canonical_bytes(text) is None and _reference(text) is None
    text = b'{"a":' * 127 + b"[" * 126 + b"[1e-7]" + b"]" * 126 + b"}" * 127  # 254 deep
    assert _module().canonical_bytes(text) == _reference(text) is not None


def test_canonical_bytes_of_escapes_numbers_and_keys() -> None:
    text = (b'{ "b" : [1, -0, 0.5, 1E2, 18446744073709551615, 123456789012345678901],'
            b' "a\\u00e9": "\\ud83d\\ude00\\u0001\\/\\"", "a": true, "": null }')
    assert _module().canonical_bytes(text) == _reference(text)


# -- collapsed streams ---------------------------------------------------------------------------
def _chunk(content: str | None = None, *, index: int = 0, **extra: Any) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {"id": "c1", "object": "chat.completion.chunk", **extra,
            "choices": [{"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": None}]}


def _stream(chunks: list[Any], **top: Any) -> dict[str, Any]:
    return {"provider": "openai", "endpoint": "/v1/chat/completions",
            "request": {**conv.openai_request(), "stream": True}, "stream": chunks, **top}


def _variants() -> list[dict[str, Any]]:
    """Streams that exercise every rule: what is merged, what is kept, model and created."""
    role = {"id": "c1", "object": "chat.completion.chunk", "created": 1767225600,
            "model": "gpt-4o", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""}}]}
    words = [_chunk(w, created=1767225600, model="gpt-4o")
             for w in ["It ", "is ", "sunny ", "é😀\n\"q\" ", "\\ ", "done."]]
    finish = {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    usage = {"id": "c1", "choices": [], "usage": {"total_tokens": 9}}
    call = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\""}}]}}]}
    call_more = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": ": \"Paris\"}"}}]}}]}
    return [
        _stream([role, *words, finish, usage]),
        _stream([role, *words, finish, usage, "[DONE]"]),
        # no model or created time until the third chunk, then a model that is empty first
        _stream([_chunk("a"), _chunk("b"), _chunk("c", model="", created=0),
                 _chunk("d", model="m1"), _chunk("e", model="m2", created=5), _chunk("f")]),
        # two choices interleaved, and an index given as -0 and left out
        _stream([role, *[_chunk(w, index=i % 2) for i, w in enumerate("abcdefgh")],
                 {"choices": [{"delta": {"content": "x"}}]},
                 {"choices": [{"delta": {"content": "y"}}]}]),
        # text, then a tool call, then text again; a refusal and reasoning are kept
        _stream([role, *words[:3], call, call_more, *words[3:],
                 {"choices": [{"index": 0, "delta": {"refusal": "no"}}]},
                 {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
                 _chunk("z")]),
        # what is not a text-only chunk: an error key, extra delta keys, two choices, a bool
        # index, a float model, a non-string content
        _stream([role, _chunk("a"), {**_chunk("b"), "error": None}, _chunk("c"),
                 {"choices": [{"index": 0, "delta": {"content": "d", "role": "assistant"}}]},
                 _chunk("e"), {"choices": [_chunk("f")["choices"][0]] * 2}, _chunk("g"),
                 {"choices": [{"index": True, "delta": {"content": "h"}}]}, _chunk("i"),
                 {"choices": [{"index": 0, "delta": {"content": 7}}]}, _chunk("j"),
                 _chunk("k")]),
        _stream([_chunk("a", model=1.5), _chunk("b", model="m"), _chunk("c")]),
        _stream([role, _chunk("a"), _chunk("b"), _chunk("c")], status=500),
        _stream([role, _chunk("a"), _chunk("b"), _chunk("c")], partial=True),
        _stream([{"type": "message_start"}, _chunk("a"), _chunk("b")]),  # Anthropic's events
        {**_stream([role, _chunk("a"), _chunk("b")]), "provider": "anthropic"},
        _stream([role, _chunk("a"), {"error": {"message": "overloaded"}}, _chunk("b"),
                 _chunk("c")]),
        conv.openai_stream_call(),
    ]


def _bench_lines(tmp_path: Path, count: int, seed: int) -> list[bytes]:
    """The lines of a ``bench/ingest.py`` file of ``count`` records."""
    spec = importlib.util.spec_from_file_location("bench_ingest", ROOT / "bench" / "ingest.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = tmp_path / f"bench-{seed}.jsonl"
    bench.generate(path, count, seed=seed)
    return path.read_bytes().split(b"\n")


def _bench_fastpath(tmp_path: Path, count: int) -> list[bytes]:
    return [line for line in _bench_lines(tmp_path, count, 11) if b'"stream"' in line]


def _both(lines: list[bytes], fmt: str = "auto") -> tuple[list[Any], list[Any]]:
    """process_lines of ``lines`` with the C module and without it."""
    fast_record = rows._FAST
    assert fast_record is not None
    fast = rows.process_lines(lines, name="t", first_lineno=1, format_hint=fmt,
                              line_errors=[])
    try:
        rows._FAST = None
        slow = rows.process_lines(lines, name="t", first_lineno=1, format_hint=fmt,
                                  line_errors=[])
    finally:
        rows._FAST = fast_record
    return fast, slow


def test_collapsed_streams_give_the_python_path_s_rows(tmp_path: Path) -> None:
    records = _variants()
    lines = [json.dumps(r, ensure_ascii=ascii_).encode() for r in records
             for ascii_ in (False, True)]
    lines += _bench_fastpath(tmp_path, 400)
    collapsed = [_module().fast_record(line) for line in lines]
    assert sum(c is not None for c in collapsed) > len(lines) * 0.8  # the C path is taken
    for line, found in zip(lines, collapsed, strict=True):
        if found is not None:
            assert found[0] == "stream" and found[1] == _reference(line)
            assert len(found[2]) < len(line)
    for fmt in ("auto", "openai"):
        fast, slow = _both(lines, fmt)
        assert fast == slow
    fast, _ = _both(lines)
    assert sum(1 for r in fast if r[4] is None) > len(lines) * 0.6  # most are accepted


def test_merging_streams_alone_gives_the_python_path_s_rows(tmp_path: Path) -> None:
    # FACTORY_FASTPATH=streams: C parses and merges streams, every rule runs in Python
    lines = _bench_lines(tmp_path, 300, 5)
    assert sum(1 for line in lines if _module().merge_stream(line)) > 20
    assert all(_module().merge_stream(line) is None for line in lines if b'"stream"' not in line)
    saved = rows._FAST, rows._FAST_RULES
    try:
        rows._FAST, rows._FAST_RULES = _module().merge_stream, False
        merged = rows.process_lines(lines, name="t", first_lineno=1, format_hint="auto",
                                    line_errors=[])
        rows._FAST = None
        slow = rows.process_lines(lines, name="t", first_lineno=1, format_hint="auto",
                                  line_errors=[])
    finally:
        rows._FAST, rows._FAST_RULES = saved
    assert merged == slow and sum(1 for r in slow if r[5]) > 200


def test_a_collapsed_stream_keeps_every_chunk_but_text_only_ones() -> None:
    record = conv.openai_stream_call()  # role, three words, finish, usage
    found = _module().fast_record(json.dumps(record).encode())
    assert found is not None and found[0] == "stream"
    stream = orjson.loads(found[2])["stream"]
    assert stream[0] == record["stream"][0] and stream[2:] == record["stream"][4:]
    assert stream[1] == {"choices": [{"index": 0, "delta": {
        "content": "It is sunny and 21 °C in Paris."}}]}
    assert {k: v for k, v in orjson.loads(found[2]).items() if k != "stream"} == \
        {k: v for k, v in record.items() if k != "stream"}


def _mutated(records: list[dict[str, Any]], seed: int, per_record: int,
             news: tuple[tuple[str, Any], ...] = ()) -> list[bytes]:
    """Each record mutated at up to ``per_record`` of its paths, every way (as JSON lines)."""
    rng = random.Random(seed)
    lines = []
    for record in records:
        paths = _paths(record)
        for path in rng.sample(paths, min(per_record, len(paths))):
            for action, new in (("delete", None), ("replace", None), ("replace", 7),
                                ("replace", ""), ("replace", []), ("replace", {}), *news,
                                ("stringify", None), ("truncate", None)):
                try:
                    mutated = _mutate(copy.deepcopy(record), path, action, new)
                except (KeyError, IndexError, TypeError):
                    continue
                lines.append(json.dumps(mutated, ensure_ascii=False).encode())
    return lines


def test_mutated_streams_give_the_python_path_s_rows_and_reasons() -> None:
    lines = _mutated(_variants()[:6], 3, 40)
    fast, slow = _both(lines)
    assert fast == slow
    assert sum(1 for r in slow if r[4]) > 50  # rejections, with the same reasons


# -- logged calls normalized in C ----------------------------------------------------------------
def _call(messages: list[Any], reply: dict[str, Any], *, tools: Any = None,
          **top: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"model": "gpt-4o", "messages": messages}
    if tools is not None:
        request["tools"] = tools
    return {"provider": "openai", "endpoint": "/v1/chat/completions", "request": request,
            "response": {"id": "r", "object": "chat.completion", "created": 1767225600,
                         "model": "gpt-4o-2024", "choices": [
                             {"index": 0, "message": reply, "finish_reason": "stop"}]},
            "status": 200, **top}


def _tool(name: str, parameters: Any = None, **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "d " + name,
                                             "parameters": parameters, **extra}}


_SCHEMA = {"type": "OBJECT", "properties": {
    "q": {"type": "STRING", "description": "the query", "enum": ["STRING", "B"]},
    "n": {"type": ["INTEGER", "NULL", {"type": "STRING"}], "default": {"type": "OBJECT"}},
    "any": {"anyOf": [{"type": "NUMBER"}, {"type": "string"}], "examples": [{"type": "ARRAY"}]},
    "t": {"type": {"type": "BOOLEAN"}}}, "required": ["q"]}


def _call_variants() -> list[dict[str, Any]]:
    """Calls in the shape the C module reads, and next to each rule of that shape one that
    breaks it (the Python path must then read it, and give the same)."""
    system = {"role": "system", "content": "Be brief.\n\"quoted\" é😀"}
    user = {"role": "user", "content": "Weather in Paris?"}
    call: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"n\": 2}"}}]}
    result = {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp\": 21, \"ok\": true}"}
    answer = {"role": "assistant", "content": "Sunny, 21."}
    weather = [_tool("get_weather", _SCHEMA)]
    two_calls = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "function": {"name": "a", "arguments": "[1, {\"b\": null}]"}},
        {"id": "", "function": {"name": "b", "arguments": {"z": [1, 2], "a": {"y": None}}}},
        {"function": {"name": "c"}}]}
    return [
        _call([system, user], answer),
        _call([user, call, result], answer, tools=weather),
        _call([system, user, call, result, answer, user], call, tools=weather),
        _call([developer := {"role": "developer", "content": "dev"}, user, two_calls,
               {"role": "tool", "tool_call_id": "x", "content": "plain text"},
               {"role": "tool", "name": "b", "content": ""},
               {"role": "tool", "tool_call_id": None, "name": "c", "content": "  {\"a\": 1}"},
               {"role": "function", "name": "zz", "content": "[]"},
               {"role": "tool", "tool_call_id": "unknown", "content": "{}"}], answer,
              tools=[_tool("a"), _tool("b", {"type": "object"}), _tool("c", None)]),
        _call([developer, {"role": "user", "content": None}, {"role": "user"}], {
            "content": "x", "refusal": "I can't", "reasoning_content": "hm"}),
        _call([user], {"role": "assistant", "content": "", "refusal": ""}),
        _call([user], {"role": "assistant", "content": "a", "reasoning_content": 5}),
        _call([user, {"role": "assistant", "content": "prefill"}], answer),  # continued
        _call([user], answer, tools=[_tool("f", {"type": "object", "x": 0.5})]),  # a float
        _call([user], {**call, "tool_calls": [{**call["tool_calls"][0], "function": {
            "name": "f", "arguments": "{\"a\": 1.5}"}}]}),
        _call([user], {**call, "tool_calls": [{**call["tool_calls"][0], "function": {
            "name": "f", "arguments": "{not json"}}]}),
        _call([user], {**call, "tool_calls": [{**call["tool_calls"][0], "id": 7}]}),
        _call([user], answer, tools=[_tool("f", "{\"type\": \"object\"}")]),
        _call([user], answer, tools=[{"type": "retrieval"}]),
        _call([{"role": "user", "content": [{"type": "text", "text": "parts"}]}], answer),
        _call([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + conv.PNG_B64}}]}], answer),
        _call([{"role": "critic", "content": "?"}], answer),
        _call([user, {"role": "tool", "content": "no id"}], answer),
        _call([user], {"role": "user", "content": "not the assistant"}),
        _call([user], {"role": "assistant", "content": "x", "function_call": {
            "name": "f", "arguments": "{}"}}),
        _call([user], answer, status=500), _call([user], answer, status=200.0),
        _call([user], answer, partial=True), _call([user], answer, partial=False),
        _call([user], answer, provider=None), _call([user], answer, provider="anthropic"),
        {**_call([user], answer), "response": {"choices": [], "model": "m"}},
        {**_call([user], answer), "response": {"error": {"message": "x"}, "choices": [
            {"message": answer}]}},
        {**_call([user], answer), "response": {"type": "message", "choices": [
            {"message": answer}]}},
        {**_call([user], answer), "response": {"model": "", "created": "soon", "choices": [
            {"message": answer}, {"message": answer}]}},
        {**_call([user], answer), "response": {"model": 0, "created": 1.5, "choices": [
            {"message": answer}]}},
        {**_call([user], answer), "response": {"model": [1], "choices": [{"message": answer}]}},
        {k: v for k, v in _call([user], answer).items() if k != "provider"},
        {**_call([user], answer), "request": {"messages": [user], "functions": [
            {"name": "f", "parameters": {}}]}},
        {**_call([user], answer), "resourceSpans": []},
        conv.openai_call(),
    ]


def test_calls_normalized_in_c_give_the_python_path_s_rows() -> None:
    records = _call_variants()
    lines = [json.dumps(r, ensure_ascii=ascii_).encode() for r in records
             for ascii_ in (False, True)]
    found = [_module().fast_record(line) for line in lines]
    assert sum(1 for f in found if f is not None and f[0] == "call") > len(lines) * 0.3
    for line, f in zip(lines, found, strict=True):
        if f is not None:
            assert f[1] == _reference(line)
    for fmt in ("auto", "openai", "anthropic"):
        fast, slow = _both(lines, fmt)
        assert fast == slow


def test_mutated_calls_give_the_python_path_s_rows_and_reasons() -> None:
    lines = _mutated(_call_variants()[:5], 5, 60, (("replace", "OBJECT"), ("replace", 0.5)))
    fast, slow = _both(lines)
    assert fast == slow
    assert sum(1 for r in slow if r[4]) > 50
    assert sum(1 for line in lines if (f := _module().fast_record(line)) and f[0] == "call") \
        > len(lines) * 0.3


def _anthropic(messages: list[Any], content: Any, *, system: Any = None, tools: Any = None,
               **top: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 1024,
                               "messages": messages}
    if system is not None:
        request["system"] = system
    if tools is not None:
        request["tools"] = tools
    return {"request": request, "response": {"type": "message", "role": "assistant",
                                             "model": "claude-sonnet-4-5-2025",
                                             "content": content}, **top}


def _anthropic_variants() -> list[dict[str, Any]]:
    user = {"role": "user", "content": "Weather in Paris?"}
    use = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "look it up", "signature": "sig"},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris", "units": {"c": True, "z": None}}}]}
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "{\"temp\": 21}"},
        {"type": "text", "text": "and tomorrow?"}]}
    reply = [{"type": "text", "text": "Sunny, 21 °C."}]
    tools = [{"name": "get_weather", "description": "weather", "input_schema": _SCHEMA}]
    return [
        _anthropic([user], reply),
        _anthropic([user, use, result], reply, system="Be brief.", tools=tools),
        _anthropic([user, use, result], [{"type": "redacted_thinking", "data": "x"},
                                         *use["content"]], system=[
            {"type": "text", "text": "one"}, {"type": "text", "text": ""}], tools=tools),
        _anthropic([user, use, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "[1, 2]"}, {"type": "text", "text": ""}]},
            {"type": "tool_result", "tool_use_id": "toolu_9"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": None}]}], reply),
        _anthropic([user, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "", "name": "a"}, {"type": "tool_use", "name": "b",
                                                          "input": {}}]}], "plain reply"),
        _anthropic([user, {"role": "assistant", "content": []}, {"role": "user",
                                                                 "content": ""}], reply),
        _anthropic([user, {"role": "assistant", "content": "prefill"}], reply),  # continued
        _anthropic([user], [{"type": "tool_use", "id": "t", "name": "f", "input": None}]),
        _anthropic([user], [{"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1.5}}]),
        _anthropic([user], [{"type": "tool_use", "id": 3, "name": "f"}]),
        _anthropic([{"role": "user", "content": [{"type": "thinking", "thinking": "no"}]}],
                   reply),
        _anthropic([{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": conv.PNG_B64}}]}], reply),
        _anthropic([{"role": "user", "content": [{"type": "document", "source": {}}]}], reply),
        _anthropic([{"role": "system", "content": "x"}], reply),
        _anthropic([user], reply, system=[{"type": "image"}]),
        _anthropic([user], reply, system=7),
        _anthropic([user], None), _anthropic([user], reply, status=529),
        {**_anthropic([user], reply), "response": {"type": "error", "error": {}}},
        {**_anthropic([user], reply), "response": {"type": "message", "role": "user",
                                                   "content": reply}},
        {**_anthropic([user], reply), "response": {"type": "message", "content": reply,
                                                   "model": ""}},
        {**_anthropic([user], reply), "provider": "anthropic"},
        {**_anthropic([user], reply), "provider": "gemini"},
        conv.anthropic_call(),
    ]


def _line_variants() -> list[dict[str, Any]]:
    """OpenAI fine-tuning lines, and lines that are not (another format, or not read here)."""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}]
    return [
        {"messages": msgs}, {"messages": msgs, "model": "ft:gpt-4o"}, {"messages": msgs[:2]},
        {"messages": msgs, "tools": [_tool("f", _SCHEMA)], "model": 5},
        {"messages": msgs, "tools": [{"name": "f", "input_schema": {}}]},
        {"messages": msgs, "system": "anthropic"}, {"messages": "x"}, {"messages": []},
        {"messages": [*msgs, {"role": "assistant", "content": [{"type": "text", "text": "p"}]}]},
        {"messages": msgs, "conversations": []}, {"messages": msgs, "contents": []},
        {"messages": msgs, "request": {}}, conv.openai_finetune_line(),
    ]


def _gemini(contents: Any, candidate: Any, *, system: Any = None, tools: Any = None,
            model: Any = "gemini-2.5-flash", **top: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"contents": contents}
    if system is not None:
        request["systemInstruction"] = system
    if tools is not None:
        request["tools"] = tools
    response: dict[str, Any] = {"candidates": [candidate], "modelVersion": model}
    return {"provider": "gemini", "endpoint": "/v1beta/models/gemini-2.5-pro:generateContent",
            "request": request, "response": response, "status": 200, **top}


def _gemini_variants() -> list[dict[str, Any]]:
    user = {"role": "user", "parts": [{"text": "Weather in Paris?"}]}
    model = {"role": "model", "parts": [{"text": "Let me think.", "thought": True},
                                        {"text": ""}, {"thoughtSignature": "c2ln"},
                                        {"text": "Sunny."}]}
    reply = {"content": {"role": "model", "parts": [{"text": "Sunny, 21 °C."}]},
             "finishReason": "STOP"}
    tools = [{"functionDeclarations": [{"name": "get_weather", "description": "w",
                                        "parameters": _SCHEMA},
                                       {"name": "now", "parametersJsonSchema": {"type": "object"}},
                                       {"name": "bare"}]}, {"googleSearch": {}}]
    snake = {"contents": [user], "system_instruction": {"parts": [{"text": "sys"}]}}
    return [
        _gemini([user], reply),
        _gemini([user, model, user], reply, system={"parts": [{"text": "Be brief."}]},
                tools=tools),
        _gemini([user], reply, system="plain system"),
        _gemini([{"parts": [{"text": "no role"}]}, {"role": "function", "parts": []}], reply),
        _gemini([user], {"content": {"parts": [{"text": "no role"}]}}),
        _gemini([user], reply, model=""), _gemini([user], reply, model=None),
        _gemini([user], reply, model="models/gemini-x"), _gemini([user], reply, model=5),
        {**_gemini([user], reply, model=None), "endpoint": "/v1/models/:x/models/m2?k"},
        {**_gemini([user], reply, model=None), "endpoint": None},
        {**_gemini([user], reply, model=None), "request": {"contents": [user], "model": "r"}},
        {k: v for k, v in _gemini([user], reply).items() if k != "provider"},
        {**_gemini([user], reply), "request": snake},
        _gemini([user, model], reply),  # the request ends with the model's turn
        _gemini("just text", reply),
        _gemini([user], {"content": {"role": "user", "parts": [{"text": "x"}]}}),
        _gemini([user], {"content": {"role": "model", "parts": []}}),
        _gemini([{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png",
                                                            "data": conv.PNG_B64}}]}], reply),
        _gemini([user], {"content": {"role": "model", "parts": [
            {"functionCall": {"name": "f", "args": {}}}]}}),
        _gemini([{"role": "critic", "parts": [{"text": "x"}]}], reply),
        _gemini([user], reply, tools=[{"functionDeclarations": [{"name": "f", "parameters": {
            "type": "OBJECT", "x": 1.5}}]}]),
        {**_gemini([user], reply), "request": {"contents": [user], "config": {}}},
        {**_gemini([user], reply), "response": {"candidates": [reply, reply]}},
        {**_gemini([user], reply), "response": {"promptFeedback": {"blockReason": "SAFETY"}}},
        conv.gemini_call(), conv.gemini_snake_call(),
    ]


@pytest.mark.parametrize("variants", [_anthropic_variants, _line_variants, _gemini_variants])
def test_other_calls_and_lines_normalized_in_c_give_the_python_path_s_rows(
        variants: Any) -> None:
    records = variants()
    lines = [json.dumps(r, ensure_ascii=ascii_).encode() for r in records
             for ascii_ in (False, True)]
    found = [_module().fast_record(line) for line in lines]
    assert sum(1 for f in found if f is not None and f[0] == "call") > len(lines) * 0.3
    for fmt in ("auto", "openai", "anthropic", "gemini"):
        fast, slow = _both(lines, fmt)
        assert fast == slow


@pytest.mark.parametrize("variants", [_anthropic_variants, _line_variants, _gemini_variants])
def test_mutated_other_calls_and_lines_give_the_python_path_s_rows_and_reasons(
        variants: Any) -> None:
    lines = [spelling for text in _mutated(variants()[:5], 7, 60, (("replace", "tool_use"),
                                                                  ("replace", "text")))
             for spelling in (text, text.replace(b'{"', b'{ "', 1))]
    fast, slow = _both(lines)
    assert fast == slow
    assert sum(1 for r in slow if r[4]) > 20
    assert sum(1 for line in lines if (f := _module().fast_record(line)) and f[0] == "call") \
        > len(lines) * 0.2


@pytest.mark.parametrize("index", [b"1.5", b'"\\u0041"', b"true", b"-0"])
def test_a_chunk_index_that_is_no_plain_integer_is_not_merged(index: bytes) -> None:
    # A float or an escaped string lives in the C module's arena, not in the line: reading it
    # as the line's bytes read past the line's end (found under AddressSanitizer, with the
    # arena grown large by many floats first).
    line = (b'{"a":[' + b",".join([b"1e15"] * 2000) + b'],"stream":[{},{"choices":[{"delta":'
            b'{"content":"x"},"index":' + index + b"}]},{},{}]}")
    found = _module().fast_record(line)
    assert found is None or (found[0] != "stream" and found[1] == _reference(line))
