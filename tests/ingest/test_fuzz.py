"""Random and mutated records into every normalizer: a sample or a NormalizeError, nothing else."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from factory.ingest import normalize_record
from factory.normalize import FORMATS, NormalizeError, canonical_json
from factory.normalize.canon import sample_id
from factory.normalize.otlp import split_otlp
from tests.ingest import conversations as conv

FUZZ = settings(max_examples=int(__import__("os").environ.get("FUZZ_N", "60")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.sampled_from(["user", "assistant", "model", "text", "image", "tool_use", "function",
                       "data:image/png;base64,AAAA", conv.PNG_B64, "{\"a\": 1}"]),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "parts", "messages",
                                       "contents", "tool_calls", "function", "name", "id",
                                       "arguments", "input", "source", "data", "request",
                                       "response", "stream", "choices", "delta", "otlp_trace",
                                       "spans", "attributes", "conversations", "from", "value",
                                       "functionCall", "inlineData", "candidates"]) | st.text(
                                           max_size=6), children, max_size=5),
    max_leaves=20)


def _check(record: Any, fmt: str) -> None:
    try:
        samples = normalize_record(record, fmt)
    except NormalizeError as exc:
        assert exc.reason and isinstance(exc.reason, str)
        return
    assert samples
    for s in samples:
        assert s["sample_id"] == sample_id(s["messages"], s["tools"])
        for m in s["messages"]:
            assert m["role"] in ("system", "user", "assistant", "tool")
            assert all(p["type"] in ("text", "image", "reasoning") for p in m["content"])
        canonical_json(s["messages"])


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(record: Any, path: tuple[Any, ...], action: str, new: Any) -> Any:
    record = copy.deepcopy(record)
    if not path:
        return new
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if action == "delete":
        del parent[key]
    elif action == "replace":
        parent[key] = new
    elif action == "stringify":
        parent[key] = json.dumps(parent[key])
    elif action == "truncate" and isinstance(parent[key], str | list):
        parent[key] = parent[key][: len(parent[key]) // 2]
    return record


@FUZZ
@given(value=json_values, fmt=st.sampled_from(["auto", *FORMATS]))
def test_random_json_never_crashes(value: Any, fmt: str) -> None:
    _check(value, fmt)


@FUZZ
@given(data=st.data(), form=st.sampled_from(sorted(conv.ALL_FORMS)),
       action=st.sampled_from(["delete", "replace", "stringify", "truncate"]),
       fmt=st.sampled_from(["auto", "auto", *FORMATS]))
def test_mutated_records_never_crash(data: st.DataObject, form: str, action: str,
                                     fmt: str) -> None:
    record = conv.ALL_FORMS[form]()
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(record)
        path = data.draw(st.sampled_from(paths))
        record = _mutate(record, path, action, data.draw(json_values))
    _check(record, fmt)


@settings(max_examples=40, deadline=None)
@given(body=st.binary(max_size=200), ctype=st.sampled_from(
    ["application/json", "application/x-protobuf", "text/plain"]))
def test_split_otlp_garbage_is_a_normalize_error(body: bytes, ctype: str) -> None:
    try:
        records = split_otlp(body, ctype)
    except NormalizeError:
        return
    for record in records:
        json.dumps(record)
        _check(record, "otlp")


def test_a_content_block_type_that_is_not_a_string_rejects_one_record_only() -> None:
    from factory.ingest.rows import process_lines

    # detect_format asked whether a dict was among the Anthropic block types: TypeError
    # (unhashable), out of process_lines, so one record stopped its whole chunk.
    lines = [b'{"messages":[{"role":"user","content":[{"type":{}}]}]}',
             b'{"messages":[{"role":"user","content":[{"type":[1]}]},'
             b'{"role":"assistant","content":"a"}]}',
             json.dumps(conv.openai_finetune_line()).encode()]
    out = process_lines(lines, name="t", first_lineno=1, format_hint="auto", line_errors=[])
    assert [r[4] is None for r in out] == [False, False, True]
    assert all("normalizer failed" not in (r[4] or "") for r in out)
