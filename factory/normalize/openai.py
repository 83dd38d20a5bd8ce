"""OpenAI Chat Completions into canonical conversations.

Accepts fine-tuning lines (``{"messages", "tools"}``) and logged calls (request plus a response
or a list of streamed ``chat.completion.chunk`` objects, reassembled here). Handles string and
part-list content, ``image_url`` (data and http URLs), ``tool_calls`` and ``tool`` messages,
the legacy ``functions``/``function_call``/``function`` role, ``refusal`` and the
``reasoning_content`` some OpenAI-compatible servers add.
"""

from __future__ import annotations

from typing import Any

from factory.normalize.canon import (
    NormalizeError,
    append_response,
    expect_dict,
    expect_list,
    finish,
    indexed,
    kind,
    model_of,
    read_call,
    text_part,
    tool_call,
    tool_def,
    tool_message,
    tool_result_parts,
    unix_time,
)
from factory.normalize.images import url_image

PROVIDER = "openai"
_ROLE = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool", "function": "tool"}
# Roles whose message is only its content (no tool calls, refusal or reasoning to read).
_PLAIN_ROLES = frozenset({"system", "developer", "user"})


def normalize(payload: Any) -> list[dict[str, Any]]:
    """A fine-tuning line or a bare request body that already ends with the assistant turn."""
    body = expect_dict(payload, "record")
    if "messages" not in body:
        raise NormalizeError("messages: missing (an OpenAI record needs a messages array)")
    blobs: dict[str, bytes] = {}
    messages = convert_messages(body["messages"], blobs)
    tools = convert_tools(body)
    return [finish(messages, tools, provider=PROVIDER, model=model_of(body), blobs=blobs)]


def normalize_call(request: Any, response: Any, stream: list[Any] | None,
                   endpoint: str | None = None) -> list[dict[str, Any]]:
    """A logged call: the request's conversation plus each returned choice."""
    call = read_call(request, response, stream, convert_request, convert_tools,
                     reassemble_stream)
    resp, where, blobs = call.response, call.where, call.blobs
    if "error" in resp and "choices" not in resp:
        raise NormalizeError(f"{where}.error: the upstream call failed")
    choices = resp.get("choices")
    if not isinstance(choices, list):
        expect_list(choices, f"{where}.choices")
    if not choices:
        raise NormalizeError(f"{where}.choices: empty (no completion returned)")
    model = resp.get("model") or call.request.get("model")
    model = model if isinstance(model, str) else None
    created = unix_time(resp.get("created"))
    out = []
    for i, choice in enumerate(choices):
        at = f"{where}.choices[{i}].message"
        if not isinstance(choice, dict):
            expect_dict(choice, f"{where}.choices[{i}]")
        msg = choice.get("message")
        if not isinstance(msg, dict):
            expect_dict(msg, at)
        role = msg.get("role", "assistant")
        if role != "assistant":
            raise NormalizeError(f"{at}.role: expected 'assistant', got {role!r}")
        reply = _message(msg, "assistant", at, blobs)
        convo = append_response(call.messages, reply)
        out.append(finish(convo, call.tools, provider=PROVIDER, model=model, blobs=blobs,
                          created_at=created))
    return out


def convert_tools(body: dict[str, Any], where: str = "record") -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    if body.get("tools") is not None:
        for i, tool in enumerate(expect_list(body["tools"], f"{where}.tools")):
            # Paths other than the one tool_def needs are formatted only for an error.
            if not isinstance(tool, dict):
                expect_dict(tool, f"{where}.tools[{i}]")
            kind_ = tool.get("type", "function")
            if kind_ != "function":
                raise NormalizeError(f"{where}.tools[{i}].type: {kind_!r} tools are not "
                                     f"supported (only function tools)")
            at = f"{where}.tools[{i}].function"
            fn = tool.get("function")
            if not isinstance(fn, dict):
                expect_dict(fn, at)
            tools.append(tool_def(fn.get("name"), fn.get("description"), fn.get("parameters"),
                                  at))
    if body.get("functions") is not None:
        for i, fn in enumerate(expect_list(body["functions"], f"{where}.functions")):
            at = f"{where}.functions[{i}]"
            fn = expect_dict(fn, at)
            tools.append(tool_def(fn.get("name"), fn.get("description"), fn.get("parameters"),
                                  at))
    return tools


def convert_request(body: dict[str, Any], blobs: dict[str, bytes],
                    where: str) -> list[dict[str, Any]]:
    """The conversation of a request body: its ``messages``."""
    return convert_messages(body.get("messages"), blobs, where=f"{where}.messages")


def convert_messages(raw: Any, blobs: dict[str, bytes],
                     where: str = "messages") -> list[dict[str, Any]]:
    items = expect_list(raw, where)
    out = []
    for i, msg in enumerate(items):
        if not isinstance(msg, dict):
            expect_dict(msg, f"{where}[{i}]")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLE:
            raise NormalizeError(f"{where}[{i}].role: unknown role {role!r}")
        content = msg.get("content")
        # The common case, text and nothing else to read: what _message returns for it, without
        # the call and its path. An assistant message qualifies only when it has no other key
        # (no tool calls, refusal or reasoning).
        if isinstance(content, str) and (role in _PLAIN_ROLES
                                         or (role == "assistant" and len(msg) == 2)):
            out.append({"role": _ROLE[role], "content": [{"type": "text", "text": content}]})
            continue
        out.append(_message(msg, role, f"{where}[{i}]", blobs))
    return out


def _message(msg: dict[str, Any], role: str, at: str, blobs: dict[str, bytes]) -> dict[str, Any]:
    # ``at`` is the message's path; the paths below it are only formatted for an error (this
    # runs for every assistant and tool message).
    canon_role = _ROLE[role]
    content = msg.get("content")
    if canon_role == "tool":
        if isinstance(content, str):
            parts = tool_result_parts(content)
        else:
            parts = _content(content, f"{at}.content", blobs, tool=True)
        name = msg.get("name") if isinstance(msg.get("name"), str) else None
        if role == "tool" and msg.get("tool_call_id") is None and name is None:
            raise NormalizeError(f"{at}.tool_call_id: missing on a tool message")
        return tool_message(msg.get("tool_call_id"), name, parts)
    parts = []
    if canon_role == "assistant":
        reasoning = msg.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            parts.append({"type": "reasoning", "text": reasoning})
    if isinstance(content, str):
        parts.append({"type": "text", "text": content})
    elif content is not None:
        parts += _content(content, f"{at}.content", blobs)
    new: dict[str, Any] = {"role": canon_role, "content": parts}
    if canon_role != "assistant":
        return new
    refusal = msg.get("refusal")
    if refusal is not None:
        parts.append(text_part(refusal, f"{at}.refusal"))
    calls = []
    tool_calls = msg.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            expect_list(tool_calls, f"{at}.tool_calls")
        for j, call in enumerate(tool_calls):
            if not isinstance(call, dict):
                expect_dict(call, f"{at}.tool_calls[{j}]")
            if call.get("type", "function") != "function":
                raise NormalizeError(f"{at}.tool_calls[{j}].type: {call.get('type')!r} calls "
                                     f"are not supported")
            fn = call.get("function")
            if not isinstance(fn, dict):
                expect_dict(fn, f"{at}.tool_calls[{j}].function")
            args = fn.get("arguments")
            if not (args is None or isinstance(args, _ARGUMENTS)):
                _arguments(args, f"{at}.tool_calls[{j}].function.arguments")
            calls.append(tool_call(call.get("id"), fn.get("name"), args,
                                   f"{at}.tool_calls[{j}].function"))
    if msg.get("function_call") is not None:
        fn = expect_dict(msg["function_call"], f"{at}.function_call")
        calls.append(tool_call(None, fn.get("name"),
                               _arguments(fn.get("arguments"), f"{at}.function_call.arguments"),
                               f"{at}.function_call"))
    if calls:
        new["tool_calls"] = calls
    return new


_ARGUMENTS = (str, dict, list)


def _arguments(value: Any, where: str) -> Any:
    if value is None or isinstance(value, _ARGUMENTS):
        return value
    raise NormalizeError(f"{where}: expected a JSON string, got {kind(value)}")


def _content(content: Any, where: str, blobs: dict[str, bytes],
             tool: bool = False) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return tool_result_parts(content) if tool else [{"type": "text", "text": content}]
    parts = []
    for k, part in enumerate(expect_list(content, where)):
        at = f"{where}[{k}]"
        part = expect_dict(part, at)
        ptype = part.get("type")
        if ptype == "text":
            text = text_part(part.get("text"), f"{at}.text")
            parts.append(tool_result_parts(text["text"])[0] if tool else text)
        elif ptype == "refusal":
            parts.append(text_part(part.get("refusal"), f"{at}.refusal"))
        elif ptype == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            parts.append(url_image(url, None, f"{at}.image_url.url", blobs))
        else:
            raise NormalizeError(f"{at}.type: unsupported content part type {ptype!r}")
    return parts


_DELTA_TEXT = (("content", "content"), ("refusal", "refusal"), ("reasoning_content", "reasoning"))


def reassemble_stream(chunks: list[Any]) -> dict[str, Any]:
    """Streamed ``chat.completion.chunk`` objects into one ``chat.completion`` response."""
    # A stream has a chunk per token, so this loop is the hottest in ingest: the error paths
    # (``stream[i].choices[j]...``) are only formatted once something is wrong.
    choices: dict[int, dict[str, Any]] = {}
    model = created = None
    for i, chunk in enumerate(chunks):
        if type(chunk) is not dict or "error" in chunk:  # rare: "[DONE]", an error, not a chunk
            if chunk == "[DONE]":
                continue
            if not isinstance(chunk, dict):
                expect_dict(chunk, f"stream[{i}]")
            if "error" in chunk and not chunk.get("choices"):
                raise NormalizeError(f"stream[{i}].error: the stream reported an error")
        if not model:
            model = chunk.get("model")
        if not created:
            created = chunk.get("created")
        chunk_choices = chunk.get("choices", [])
        # Fast path for nearly every chunk: one choice whose delta is one token of content,
        # for a choice already started. Plain type checks and no loop over the choices; any
        # other chunk (the first one, tool calls, finish, usage, bad values) goes through the
        # general loop below, which reads it from scratch.
        if type(chunk_choices) is list and len(chunk_choices) == 1:
            choice = chunk_choices[0]
            if type(choice) is dict:
                delta = choice.get("delta")
                index = choice.get("index", 0)
                if type(delta) is dict and len(delta) == 1 and type(index) is int:
                    piece = delta.get("content")
                    acc = choices.get(index)
                    if type(piece) is str and acc is not None:
                        acc["content"].append(piece)
                        continue
        if not isinstance(chunk_choices, list):
            expect_list(chunk_choices, f"stream[{i}].choices")
        for j, choice in enumerate(chunk_choices):
            if not isinstance(choice, dict):
                expect_dict(choice, f"stream[{i}].choices[{j}]")
            index = choice.get("index", 0)
            if not isinstance(index, int):
                raise NormalizeError(f"stream[{i}].choices[{j}].index: expected an integer, got "
                                     f"{kind(index)}")
            acc = choices.get(index)
            if acc is None:
                acc = choices[index] = {"content": [], "refusal": [], "reasoning": [],
                                        "calls": {}, "function_call": None}
            delta = choice.get("delta", {})
            if not isinstance(delta, dict):
                expect_dict(delta, f"stream[{i}].choices[{j}].delta")
            if len(delta) == 1:  # one token of content and nothing else
                piece = delta.get("content")
                if isinstance(piece, str):
                    acc["content"].append(piece)
                    continue
            for key, dest in _DELTA_TEXT:
                piece = delta.get(key)
                if piece is not None:
                    if not isinstance(piece, str):
                        raise NormalizeError(f"stream[{i}].choices[{j}].delta.{key}: expected a "
                                             f"string, got {kind(piece)}")
                    acc[dest].append(piece)
            if "tool_calls" not in delta and "function_call" not in delta:
                continue
            cat = f"stream[{i}].choices[{j}]"
            for cindex, call, kat in indexed(delta.get("tool_calls") or [],
                                             f"{cat}.delta.tool_calls"):
                slot = acc["calls"].setdefault(cindex, {"id": None, "name": "", "args": []})
                _merge_call(slot, call, kat)
            if delta.get("function_call") is not None:
                if acc["function_call"] is None:
                    acc["function_call"] = {"id": None, "name": "", "args": []}
                _merge_call(acc["function_call"], {"function": delta["function_call"]},
                            f"{cat}.delta")
    out = []
    for index in sorted(choices):
        acc = choices[index]
        msg: dict[str, Any] = {"role": "assistant",
                               "content": "".join(acc["content"]) if acc["content"] else None}
        if acc["refusal"]:
            msg["refusal"] = "".join(acc["refusal"])
        if acc["reasoning"]:
            msg["reasoning_content"] = "".join(acc["reasoning"])
        if acc["calls"]:
            msg["tool_calls"] = [
                {"id": slot["id"], "type": "function",
                 "function": {"name": slot["name"], "arguments": "".join(slot["args"])}}
                for _, slot in sorted(acc["calls"].items())]
        if acc["function_call"] is not None:
            fc = acc["function_call"]
            msg["function_call"] = {"name": fc["name"], "arguments": "".join(fc["args"])}
        out.append({"index": index, "message": msg})
    return {"choices": out, "model": model, "created": created}


def _merge_call(slot: dict[str, Any], call: dict[str, Any], at: str) -> None:
    if call.get("id"):
        slot["id"] = slot["id"] or call["id"]
    fn = call.get("function") or {}
    fn = expect_dict(fn, f"{at}.function")
    name = fn.get("name")
    if name:
        if not isinstance(name, str):
            raise NormalizeError(f"{at}.function.name: expected a string, got {kind(name)}")
        # Some compatible servers repeat the full name in every chunk; OpenAI sends it once.
        if not slot["name"].endswith(name):
            slot["name"] += name
    args = fn.get("arguments")
    if args is not None:
        slot["args"].append(text_part(args, f"{at}.function.arguments")["text"])
