"""Anthropic Messages into canonical conversations.

Top-level ``system`` (string or text blocks); ``text``, ``image`` (base64 and url sources),
``tool_use``, ``tool_result`` (string or block content) and ``thinking`` blocks (signatures and
redacted thinking dropped). Tool results nested in a user turn become their own ``tool``
messages, ahead of the turn's remaining content. Streams of SSE event objects are reassembled.
"""

from __future__ import annotations

import json
from typing import Any

from factory.normalize.canon import (
    NormalizeError,
    append_response,
    expect_dict,
    expect_list,
    finish,
    kind,
    model_of,
    read_call,
    text_at,
    text_part,
    tool_call,
    tool_def,
    tool_message,
    tool_result_parts,
    turn_messages,
)
from factory.normalize.images import inline_image, url_image

PROVIDER = "anthropic"


def normalize(payload: Any) -> list[dict[str, Any]]:
    """A ``{system?, messages, tools?}`` line whose conversation already holds the reply."""
    body = expect_dict(payload, "record")
    if "messages" not in body:
        raise NormalizeError("messages: missing (an Anthropic record needs a messages array)")
    blobs: dict[str, bytes] = {}
    messages = convert_request(body, blobs, "record")
    return [finish(messages, convert_tools(body, "record"), provider=PROVIDER,
                   model=model_of(body), blobs=blobs)]


def normalize_call(request: Any, response: Any, stream: list[Any] | None,
                   endpoint: str | None = None) -> list[dict[str, Any]]:
    call = read_call(request, response, stream, convert_request, convert_tools,
                     reassemble_stream)
    resp, where = call.response, call.where
    if resp.get("type") == "error":
        raise NormalizeError(f"{where}.type: the upstream call returned an error")
    role = resp.get("role", "assistant")
    if role != "assistant":
        raise NormalizeError(f"{where}.role: expected 'assistant', got {role!r}")
    reply = _turn("assistant", resp.get("content"), f"{where}.content", call.blobs)
    assert len(reply) == 1
    model = resp.get("model") or call.request.get("model")
    convo = append_response(call.messages, reply[0])
    return [finish(convo, call.tools, provider=PROVIDER,
                   model=model if isinstance(model, str) else None, blobs=call.blobs)]


def convert_tools(body: dict[str, Any], where: str) -> list[dict[str, Any]]:
    if body.get("tools") is None:
        return []
    out = []
    for i, tool in enumerate(expect_list(body["tools"], f"{where}.tools")):
        at = f"{where}.tools[{i}]"
        if not isinstance(tool, dict):
            expect_dict(tool, at)
        out.append(tool_def(tool.get("name"), tool.get("description"), tool.get("input_schema"),
                            at))
    return out


def convert_request(body: dict[str, Any], blobs: dict[str, bytes],
                    where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, str):
            parts = [{"type": "text", "text": system}]
        else:
            parts = []
            for k, block in enumerate(expect_list(system, f"{where}.system")):
                block = expect_dict(block, f"{where}.system[{k}]")
                if block.get("type") != "text":
                    raise NormalizeError(f"{where}.system[{k}].type: expected 'text', got "
                                         f"{block.get('type')!r}")
                parts.append(text_part(block.get("text"), f"{where}.system[{k}].text"))
        out.append({"role": "system", "content": parts})
    for i, msg in enumerate(expect_list(body.get("messages"), f"{where}.messages")):
        if not isinstance(msg, dict):
            expect_dict(msg, f"{where}.messages[{i}]")
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise NormalizeError(f"{where}.messages[{i}].role: unknown role {role!r} (Anthropic "
                                 f"has user and assistant)")
        content = msg.get("content")
        if isinstance(content, str):  # as _turn does, without formatting the path it would name
            out.append({"role": role, "content": [{"type": "text", "text": content}]})
        else:
            out += _turn(role, content, f"{where}.messages[{i}].content", blobs)
    return out


def _turn(role: str, content: Any, where: str, blobs: dict[str, bytes]) -> list[dict[str, Any]]:
    """One Anthropic turn: its tool results as tool messages, then the rest as one message."""
    if isinstance(content, str):
        return [{"role": role, "content": [{"type": "text", "text": content}]}]
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(expect_list(content, where)):
        if not isinstance(block, dict):
            expect_dict(block, f"{where}[{k}]")
        btype = block.get("type")
        if btype == "text":
            parts.append({"type": "text", "text": text_at(block.get("text"), where, k, "text")})
            continue
        # The blocks of every turn (text, thinking, tool results) name their path only in an
        # error; the rarer ones below format it up front.
        if btype == "thinking":
            if role != "assistant":
                raise NormalizeError(f"{where}[{k}].type: thinking blocks belong to assistant "
                                     f"turns")
            parts.append({"type": "reasoning",
                          "text": text_at(block.get("thinking"), where, k, "thinking")})
            continue
        if btype == "tool_result":
            if role != "user":
                raise NormalizeError(f"{where}[{k}].type: tool_result blocks belong to user turns")
            use_id = block.get("tool_use_id")
            if not use_id or not isinstance(use_id, str):
                raise NormalizeError(f"{where}[{k}].tool_use_id: expected a non-empty string")
            result = block.get("content")
            if isinstance(result, str):  # as _result reads it, without formatting its path
                result_parts = tool_result_parts(result)
            else:
                result_parts = _result(result, f"{where}[{k}].content", blobs)
            tools.append(tool_message(use_id, None, result_parts))
            continue
        at = f"{where}[{k}]"
        if btype == "image":
            parts.append(_image(block.get("source"), f"{at}.source", blobs))
        elif btype == "redacted_thinking":
            continue
        elif btype == "tool_use":
            if role != "assistant":
                raise NormalizeError(f"{at}.type: tool_use blocks belong to assistant turns")
            if not isinstance(block.get("input", {}), dict):
                raise NormalizeError(f"{at}.input: expected an object")
            calls.append(tool_call(block.get("id"), block.get("name"), block.get("input"), at))
        else:
            raise NormalizeError(f"{at}.type: unsupported content block type {btype!r}")
    return turn_messages(role, tools, parts, calls)


def _result(content: Any, where: str, blobs: dict[str, bytes]) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return tool_result_parts(content)
    parts = []
    for k, block in enumerate(expect_list(content, where)):
        at = f"{where}[{k}]"
        block = expect_dict(block, at)
        if block.get("type") == "text":
            parts += tool_result_parts(text_part(block.get("text"), f"{at}.text")["text"])
        elif block.get("type") == "image":
            parts.append(_image(block.get("source"), f"{at}.source", blobs))
        else:
            raise NormalizeError(f"{at}.type: unsupported tool_result block type "
                                 f"{block.get('type')!r}")
    return parts


def _image(source: Any, where: str, blobs: dict[str, bytes]) -> dict[str, Any]:
    source = expect_dict(source, where)
    stype = source.get("type")
    if stype == "base64":
        media = source.get("media_type")
        if not isinstance(media, str) or not media:
            raise NormalizeError(f"{where}.media_type: expected an image media type")
        return inline_image(source.get("data"), media, f"{where}.data", blobs)
    if stype == "url":
        return url_image(source.get("url"), None, f"{where}.url", blobs)
    raise NormalizeError(f"{where}.type: unsupported image source {stype!r} (base64 or url)")


# The delta types that carry a block's text, and the key of that text in the delta and block.
_DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking"}


def reassemble_stream(events: list[Any]) -> dict[str, Any]:
    """SSE event objects (``message_start`` ... ``message_stop``) into one message."""
    # An event per token: paths (``stream[i]...``) are formatted only for an error, and the
    # text of each block is gathered as pieces joined once at the end (adding every delta to
    # the block's string would copy the whole text so far: quadratic in the length of a reply).
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    pieces: dict[int, dict[str, list[str]]] = {}  # block index -> "text"/"thinking" -> pieces
    partial_json: dict[int, list[str]] = {}
    for i, event in enumerate(events):
        if not isinstance(event, dict):
            expect_dict(event, f"stream[{i}]")
        if "type" not in event and isinstance(event.get("data"), dict):
            event = event["data"]  # an {"event": ..., "data": ...} SSE frame
        etype = event.get("type")
        if etype == "content_block_delta":
            index = _index(event, i)
            if index not in blocks:
                raise NormalizeError(f"stream[{i}].index: delta for block {index} that never "
                                     f"started")
            delta = event.get("delta")
            if not isinstance(delta, dict):
                expect_dict(delta, f"stream[{i}].delta")
            dtype = delta.get("type")
            key = _DELTA_TEXT.get(dtype) if isinstance(dtype, str) else None
            if key is not None:  # text_delta, thinking_delta
                text = delta.get(key)
                if not isinstance(text, str):
                    text_part(text, f"stream[{i}].delta.{key}")
                block_pieces = pieces.setdefault(index, {})
                if key in block_pieces:
                    block_pieces[key].append(text)
                else:  # the first delta extends the block's own text (a start it came with)
                    block = blocks[index]
                    start = block.get(key, "")
                    if not isinstance(start, str):
                        raise NormalizeError(
                            f"stream[{i}]: block {index} started with a {key} that is "
                            f"{kind(start)}, not a string, so its {dtype} cannot extend it")
                    block[key] = start + text
                    block_pieces[key] = [block[key]]
            elif dtype == "input_json_delta":
                partial_json.setdefault(index, []).append(
                    text_part(delta.get("partial_json"), f"stream[{i}].delta.partial_json")["text"])
            elif dtype in ("signature_delta", "citations_delta"):
                continue
            else:
                raise NormalizeError(f"stream[{i}].delta.type: unknown delta type {dtype!r}")
        elif etype == "message_start":
            message = dict(expect_dict(event.get("message"), f"stream[{i}].message"))
        elif etype == "content_block_start":
            index = _index(event, i)
            blocks[index] = dict(expect_dict(event.get("content_block"),
                                             f"stream[{i}].content_block"))
            pieces.pop(index, None)  # a restarted block starts over from its own text
        elif etype == "error":
            raise NormalizeError(f"stream[{i}].type: the stream reported an error")
        elif etype in ("content_block_stop", "message_delta", "message_stop", "ping"):
            continue
        else:
            raise NormalizeError(f"stream[{i}].type: unknown stream event {etype!r}")
    if message is None:
        raise NormalizeError("stream: no message_start event")
    for index, block_pieces in pieces.items():
        for key, texts in block_pieces.items():
            blocks[index][key] = "".join(texts)
    for index, json_pieces in partial_json.items():
        text = "".join(json_pieces)
        try:
            blocks[index]["input"] = json.loads(text) if text else {}
        except ValueError:
            raise NormalizeError(f"stream: tool_use block {index}: streamed input is not valid "
                                 f"JSON") from None
    message["content"] = [blocks[k] for k in sorted(blocks)]
    return message


def _index(event: dict[str, Any], i: int) -> int:
    index = event.get("index")
    if not isinstance(index, int) or isinstance(index, bool):
        raise NormalizeError(f"stream[{i}].index: expected an integer")
    return index
