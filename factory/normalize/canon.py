"""Canonical JSON, ids and the finishing pass shared by every normalizer.

The contract is ``shared/docs/canonical-sample.md``: every normalizer builds provider-neutral
messages with provisional tool-call ids, then ``finish`` renumbers the ids, drops empty text
parts, checks the shape and computes the ``sample_id``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

ROLES = frozenset({"system", "user", "assistant", "tool"})

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                            allow_nan=False)
# Lower-cased only when the whole value is one of these (Gemini's OpenAPI enum spelling).
_SCHEMA_TYPES = frozenset({"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"})
# Keys whose values are user data inside a schema, never lower-cased.
_USER_DATA = frozenset({"enum", "const", "default", "example", "examples"})
# isinstance tuples, built once: ``isinstance(x, dict | list)`` builds the union on every call,
# which costs 3x the check itself (these run for every value of every schema and tool call).
_CONTAINER = (dict, list)
_CALL_ID = (str, int)
_NUMBER = (int, float)


class NormalizeError(ValueError):
    """A record no normalizer can turn into a sample; the message names the field and the fault."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# (built with chr: mypyc refuses surrogates in string literals)
_SURROGATE = re.compile("[" + chr(0xD800) + "-" + chr(0xDFFF) + "]")


def _escape_surrogate(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def canonical_json(value: Any) -> str:
    """Compact, sorted-key JSON with non-ASCII kept (the identity serialization).

    A lone surrogate (JSON allows the escape ``"\\ud800"``; Python reads it into a string)
    is written escaped, as it came: unescaped it has no UTF-8 form, and the text could not
    be stored at all.
    """
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        raise NormalizeError(f"value is not JSON-serializable: {exc}") from None
    if not text.isascii() and _SURROGATE.search(text):
        text = _SURROGATE.sub(_escape_surrogate, text)
    return text


def canonical_json_strings(value: Any) -> str:
    """``canonical_json`` for values without floats, through orjson (about 10x faster).

    With no floats, orjson's sorted compact output is byte-identical to ``json.dumps`` with
    ``sort_keys`` and ``ensure_ascii=False`` (same escapes; UTF-8 byte order is code point
    order); canonical messages hold only strings, so they qualify. Anything orjson refuses
    (lone surrogates, integers past 64 bits) falls back to the reference encoder.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")
    except (TypeError, orjson.JSONEncodeError):
        return canonical_json(value)


# Where orjson and the reference encoder may differ: a float (orjson writes 0.00001 and 1e+16
# where json writes 1e-05 and 1e+16... the exponent rules differ) always has a digit followed by
# "." or "e"; NaN and infinities, which the reference refuses, come out of orjson as null.
# Matching inside a string is harmless: it only sends that value to the reference encoder.
_MAYBE_FLOAT = re.compile(rb"[0-9][.eE]")
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")


def _maybe_float(out: bytes) -> bool:
    """Whether orjson output matches ``_MAYBE_FLOAT``.

    Most canonical JSON here (tool schemas, arguments, results) holds no digit at all; one
    ``translate`` and one byte search say so in a fifth of the time the regex takes to scan it.
    """
    return b"0" in out.translate(_DIGITS_TO_ZERO) and _MAYBE_FLOAT.search(out) is not None


def canonical_json_fast(value: Any) -> str:
    """``canonical_json`` (same bytes, same errors) through orjson wherever that is identical.

    orjson's sorted compact output equals the reference for strings, integers, booleans, lists
    and objects (see ``canonical_json_strings``); any value whose orjson output might hold a
    float or a NaN, or that orjson refuses, is encoded by the reference encoder instead.
    """
    fast = _fast_bytes(value)
    return fast.decode("utf-8") if fast is not None else canonical_json(value)


# orjson options that make it refuse (so the reference encoder decides) the Python values it would
# write but the json module refuses: datetimes and dataclasses.
_STRICT = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


def _fast_bytes(value: Any, option: int = orjson.OPT_SORT_KEYS) -> bytes | None:
    """The UTF-8 of ``canonical_json(value)`` when orjson gives it, else None (see above)."""
    try:
        out = orjson.dumps(value, option=option)
    except (TypeError, orjson.JSONEncodeError):
        return None
    if b"null" in out or _maybe_float(out):
        return None
    return out


def content_hash(value: Any) -> str:
    """A stable sha256 of a JSON value (key order and whitespace ignored): raw_trace_id."""
    try:
        data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        data = canonical_json(value).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def sample_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """Hex SHA-256 of the canonical JSON of ``{"messages", "tools"}``."""
    return sha256_hex(canonical_json({"messages": messages, "tools": tools}))


def canon_json_text(value: Any) -> str:
    """A tool argument or result as text: JSON objects/arrays (or strings holding one) canonical.

    Any other string is kept exactly as it came; other JSON values are serialized canonically.
    """
    if isinstance(value, str):
        # The first character decides; a tool result can be long, so it is only copied
        # without its leading whitespace when it has some.
        first = value[:1]
        if first in ("{", "[") or (first.isspace() and value.lstrip()[:1] in ("{", "[")):
            try:
                fast = orjson.dumps(orjson.loads(value), option=orjson.OPT_SORT_KEYS)
            except (orjson.JSONDecodeError, orjson.JSONEncodeError):
                fast = None
            # orjson reads what json reads to the same value, except integers past 64 bits
            # (it makes them floats) and what it refuses (NaN, lone surrogates), and writes it
            # the same except floats: with no float in its output, that output is the
            # canonical text. Anything else takes the reference path (json.loads, the
            # reference encoder).
            if fast is not None and fast[:1] in (b"{", b"[") and not _maybe_float(fast):
                return fast.decode("utf-8")
            try:
                parsed = json.loads(value)
            except (ValueError, RecursionError):
                return value
            if isinstance(parsed, _CONTAINER):
                try:
                    return _ENCODER.encode(parsed)
                except (TypeError, ValueError):
                    return value
        return value
    # Tool inputs given as objects (Anthropic, Gemini): orjson where its bytes are the same.
    fast = _fast_bytes(value, _STRICT)
    return fast.decode("utf-8") if fast is not None else canonical_json(value)


def lower_schema_types(schema: Any) -> Any:
    """JSON Schema with OpenAPI upper-case ``type`` names (``OBJECT``) lower-cased, recursively."""
    if isinstance(schema, dict):
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if type(value) is str:  # most values (descriptions, type names): no isinstance calls
                out[key] = value.lower() if key == "type" and value in _SCHEMA_TYPES else value
            elif isinstance(value, _CONTAINER):
                if key == "type" and isinstance(value, list):
                    out[key] = [v.lower() if isinstance(v, str) and v in _SCHEMA_TYPES else v
                                for v in value]
                elif key in _USER_DATA:
                    out[key] = value  # user data, not schema
                else:
                    out[key] = lower_schema_types(value)
            elif key == "type" and isinstance(value, str) and value in _SCHEMA_TYPES:
                out[key] = value.lower()
            else:
                out[key] = value  # a scalar: nothing to lower (and no call to find that out)
        return out
    if isinstance(schema, list):
        return [lower_schema_types(v) if isinstance(v, _CONTAINER) else v for v in schema]
    return schema


def tool_def(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """One canonical tool: exactly ``name``, ``description`` and ``parameters``."""
    if not isinstance(name, str) or not name:
        raise NormalizeError(f"{where}.name: expected a non-empty string, got {_kind(name)}")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise NormalizeError(f"{where}.description: expected a string, got {_kind(description)}")
    if parameters is None:
        parameters = {}
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except ValueError:
            raise NormalizeError(f"{where}.parameters: a string that is not JSON") from None
    if not isinstance(parameters, dict):
        raise NormalizeError(f"{where}.parameters: expected a JSON Schema object, "
                             f"got {_kind(parameters)}")
    return {"name": name, "description": description, "parameters": lower_schema_types(parameters)}


def text_part(text: Any, where: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise NormalizeError(f"{where}: expected a string, got {_kind(text)}")
    return {"type": "text", "text": text}


def tool_call(call_id: Any, name: Any, arguments: Any, where: str) -> dict[str, Any]:
    """A provisional tool call; ``finish`` renumbers its id."""
    if not isinstance(name, str) or not name:
        raise NormalizeError(f"{where}.name: expected a non-empty string, got {_kind(name)}")
    if call_id is not None and not isinstance(call_id, _CALL_ID):
        raise NormalizeError(f"{where}.id: expected a string, got {_kind(call_id)}")
    if arguments is None:
        arguments = {}
    return {"id": None if call_id in (None, "") else str(call_id), "name": name,
            "arguments": canon_json_text(arguments)}


def tool_message(call_id: Any, name: str | None, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A provisional tool result; ``name`` helps match providers that give no ids."""
    msg: dict[str, Any] = {"role": "tool", "tool_call_id": None if call_id in (None, "")
                           else str(call_id), "content": parts}
    if name:
        msg["_name"] = name
    return msg


def tool_result_parts(value: Any) -> list[dict[str, Any]]:
    """A tool result given as one value: a single (canonical where JSON) text part."""
    return [{"type": "text", "text": canon_json_text(value)}]


def finish(messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
           provider: str | None, model: str | None, blobs: dict[str, bytes] | None = None,
           created_at: Any = None, where: str = "messages") -> dict[str, Any]:
    """Renumber tool-call ids, drop empty text, check the shape; the canonical conversation."""
    if not messages:
        raise NormalizeError(f"{where}: the conversation is empty")
    out: list[dict[str, Any]] = []
    id_map: dict[str, str] = {}
    pending: list[tuple[str, str]] = []  # (canonical id, name) of calls not yet answered
    num_calls = 0
    num_assistant = 0
    has_images = False
    has_tool_calls = False
    for i, msg in enumerate(messages):
        role = msg["role"]
        if role not in ROLES:
            raise NormalizeError(f"{where}[{i}].role: unknown role {role!r}")
        # Every part but empty text (``text`` is only read off text parts). Most messages have
        # one part: checked without a list comprehension, a function call in Python 3.11.
        parts = msg["content"]
        if len(parts) == 1:
            first = parts[0]
            kind = first["type"]
            content = [first] if kind != "text" or first["text"] != "" else []
            if kind == "image":
                has_images = True
        else:
            content = [p for p in parts if p["type"] != "text" or p["text"] != ""]
            if not has_images:
                has_images = "image" in [p["type"] for p in content]
        new: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            num_assistant += 1
            if msg.get("tool_calls"):
                calls = []
                for call in msg["tool_calls"]:
                    new_id = f"call_{num_calls}"
                    num_calls += 1
                    if call["id"] is not None:
                        id_map[call["id"]] = new_id
                    pending.append((new_id, call["name"]))
                    calls.append({"id": new_id, "name": call["name"],
                                  "arguments": call["arguments"]})
                new["tool_calls"] = calls
                has_tool_calls = True
        elif role == "tool":
            pid, name = msg.get("tool_call_id"), msg.get("_name")
            cid = id_map.get(pid) if pid is not None else None
            if cid is None:
                match = [c for c, n in pending if n == name] if name else []
                if match:
                    cid = match[0]
                elif pid is None and pending and not name:
                    cid = pending[0][0]
                else:
                    cid = f"call_{num_calls}"
                    num_calls += 1
                    if pid is not None:
                        id_map[pid] = cid
            pending = [(c, n) for c, n in pending if c != cid]
            new["tool_call_id"] = cid
        out.append(new)
    if not num_assistant:
        raise NormalizeError(f"{where}: no assistant turn (nothing to learn from)")
    # The JSON is hashed as the bytes orjson wrote, not decoded and encoded again; the
    # reference encoder's text (what orjson refuses: lone surrogates, huge integers) is encoded.
    try:
        messages_bytes = orjson.dumps(out, option=orjson.OPT_SORT_KEYS)
        messages_json = messages_bytes.decode("utf-8")
    except (TypeError, orjson.JSONEncodeError):  # as in canonical_json_strings
        messages_json = canonical_json(out)
        messages_bytes = messages_json.encode("utf-8", "surrogatepass")
    tools_bytes = _fast_bytes(tools) if tools else b"[]"
    if tools_bytes is None:
        tools_json = canonical_json(tools)
        tools_bytes = tools_json.encode("utf-8", "surrogatepass")
    else:
        tools_json = tools_bytes.decode("utf-8")
    # Same bytes as canonical_json({"messages": ..., "tools": ...}): keys sort that way.
    # (hashed piece by piece: the document is not copied into one bytes object first)
    digest = hashlib.sha256(b'{"messages":')
    digest.update(messages_bytes)
    digest.update(b',"tools":')
    digest.update(tools_bytes)
    digest.update(b"}")
    return {
        "messages": out,
        "tools": tools,
        "messages_json": messages_json,
        "tools_json": tools_json,
        "sample_id": digest.hexdigest(),
        "provider": provider,
        "model": model,
        "created_at": created_at,
        "blobs": dict(blobs or {}),
        # the samples columns that describe the conversation, known here without a scan
        "num_turns": num_assistant,
        "has_images": has_images,
        "has_tool_calls": has_tool_calls,
    }


def expect_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise NormalizeError(f"{where}: expected an object, got {_kind(value)}")
    return value


def expect_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise NormalizeError(f"{where}: expected an array, got {_kind(value)}")
    return value


def text_at(value: Any, where: str, index: int, key: str) -> str:
    """``value`` if it is a string; else ``NormalizeError`` naming ``where[index].key`` (the
    path is formatted only then: this reads every text block of every turn)."""
    if isinstance(value, str):
        return value
    raise NormalizeError(f"{where}[{index}].{key}: expected a string, got {_kind(value)}")


def indexed(items: Any, where: str) -> Iterator[tuple[int, dict[str, Any], str]]:
    """(index, object, path) of each object of a streamed list (choices, candidates, tool-call
    deltas): its ``index`` key, its place in the list when it has none."""
    for j, item in enumerate(expect_list(items, where)):
        at = f"{where}[{j}]"
        obj = expect_dict(item, at)
        index = obj.get("index", j)
        if not isinstance(index, int):
            raise NormalizeError(f"{at}.index: expected an integer")
        yield index, obj, at


def model_of(body: dict[str, Any]) -> str | None:
    """A record's ``model``, when it is a string."""
    model = body.get("model")
    return model if isinstance(model, str) else None


@dataclass
class LoggedCall:
    """A logged call read the same way in every format: the request's conversation and tools,
    then the response (a stream reassembled into one)."""

    request: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    blobs: dict[str, bytes]
    """The images of the request (and, as the reply is read, of the response) by sha256."""
    response: dict[str, Any]
    where: str
    """``response``, or ``stream`` when the response was streamed (error paths name it)."""


def read_call(request: Any, response: Any, stream: list[Any] | None,
              conversation: Callable[[dict[str, Any], dict[str, bytes], str],
                                     list[dict[str, Any]]],
              tools: Callable[[dict[str, Any], str], list[dict[str, Any]]],
              reassemble: Callable[[list[Any]], dict[str, Any]]) -> LoggedCall:
    """The parts of a logged call (``LoggedCall``), read with a format's own functions: its
    ``convert_request(body, blobs, where)``, ``convert_tools(body, where)`` and
    ``reassemble_stream(chunks)``."""
    req = expect_dict(request, "request")
    blobs: dict[str, bytes] = {}
    messages = conversation(req, blobs, "request")
    defs = tools(req, "request")
    where = "response"
    if stream is not None:
        response, where = reassemble(stream), "stream"
    return LoggedCall(req, messages, defs, blobs, expect_dict(response, where), where)


def opt_str(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise NormalizeError(f"{where}: expected a string, got {_kind(value)}")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, _NUMBER):
        return "a number"
    if isinstance(value, str):
        return "a string" if value else "an empty string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


kind = _kind


def turn_messages(role: str, results: list[dict[str, Any]], parts: list[dict[str, Any]],
                  calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A provider's turn as canonical messages: its tool results first, each its own ``tool``
    message, then the rest as one message (none when the turn held only tool results)."""
    out = list(results)
    if parts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": parts}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def append_response(messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's conversation with the response's assistant turn appended.

    A request that ends in an assistant turn (an Anthropic prefill) is continued, not repeated:
    the reply's parts join it, adjacent text merged.
    """
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        last = messages[-1]
        content = list(last["content"])
        for part in reply["content"]:
            if content and part["type"] == "text" and content[-1]["type"] == "text":
                content[-1] = {"type": "text", "text": content[-1]["text"] + part["text"]}
            else:
                content.append(part)
        merged = {"role": "assistant", "content": content}
        if reply.get("tool_calls"):
            merged["tool_calls"] = reply["tool_calls"]
        return [*messages[:-1], merged]
    return [*messages, reply]


def unix_time(value: Any) -> Any:
    """A UTC datetime from unix seconds (int/float), else None."""
    if isinstance(value, _NUMBER) and not isinstance(value, bool) and 0 < value < 1e11:
        return datetime.fromtimestamp(value, tz=UTC)
    return None
