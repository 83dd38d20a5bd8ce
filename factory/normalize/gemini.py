"""Gemini ``generateContent`` into canonical conversations.

Both key styles are read: camelCase (REST) and snake_case (the Python SDK). ``systemInstruction``;
roles ``user``, ``model`` and ``function``; ``inlineData``/``fileData``; ``functionCall`` and
``functionResponse`` (matched by order and name, since Gemini gives no ids); thought parts as
reasoning; upper-case OpenAPI types in ``functionDeclarations`` lower-cased. Streams of
``streamGenerateContent`` chunks are merged.
"""

from __future__ import annotations

import re
from typing import Any

from factory.normalize.canon import (
    NormalizeError,
    append_response,
    expect_dict,
    expect_list,
    finish,
    indexed,
    model_of,
    read_call,
    text_part,
    tool_call,
    tool_def,
    tool_message,
    tool_result_parts,
    turn_messages,
)
from factory.normalize.images import inline_image, url_image

PROVIDER = "gemini"
_ROLE = {"user": "user", "model": "assistant", "function": "user", "tool": "user"}
_MODEL_IN_PATH = re.compile(r"models/([^/:?]+)")


def _snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


_SNAKE: dict[str, str] = {}


def get(obj: dict[str, Any], camel: str) -> Any:
    """``obj[camel]``, or its snake_case spelling (the SDK's)."""
    if camel in obj:
        return obj[camel]
    snake = _SNAKE.get(camel)
    if snake is None:
        snake = _SNAKE[camel] = _snake(camel)
    return obj.get(snake)


def normalize(payload: Any) -> list[dict[str, Any]]:
    """A request-shaped record whose ``contents`` already end with the model's turn."""
    body = expect_dict(payload, "record")
    blobs: dict[str, bytes] = {}
    messages = convert_request(body, blobs, "record")
    return [finish(messages, convert_tools(body, "record"), provider=PROVIDER,
                   model=_model_name(model_of(body)), blobs=blobs)]


def normalize_call(request: Any, response: Any, stream: list[Any] | None,
                   endpoint: str | None = None) -> list[dict[str, Any]]:
    call = read_call(request, response, stream, convert_request, convert_tools,
                     reassemble_stream)
    resp, where = call.response, call.where
    candidates = get(resp, "candidates")
    if not candidates:
        feedback = get(resp, "promptFeedback")
        reason = get(feedback, "blockReason") if isinstance(feedback, dict) else None
        why = f" (prompt blocked: {reason})" if reason else ""
        raise NormalizeError(f"{where}.candidates: no candidate returned{why}")
    model = get(resp, "modelVersion") or call.request.get("model")
    if not model and endpoint:
        match = _MODEL_IN_PATH.search(endpoint)
        model = match.group(1) if match else None
    out = []
    for i, cand in enumerate(expect_list(candidates, f"{where}.candidates")):
        at = f"{where}.candidates[{i}]"
        cand = expect_dict(cand, at)
        content = get(cand, "content")
        if not isinstance(content, dict) or not get(content, "parts"):
            finish_reason = get(cand, "finishReason")
            raise NormalizeError(f"{at}.content: no parts (finishReason {finish_reason})")
        reply = _turn(content, f"{at}.content", call.blobs, default_role="model")
        if len(reply) != 1 or reply[0]["role"] != "assistant":
            raise NormalizeError(f"{at}.content.role: expected the model's turn")
        convo = append_response(call.messages, reply[0])
        out.append(finish(convo, call.tools, provider=PROVIDER,
                          model=_model_name(model if isinstance(model, str) else None),
                          blobs=call.blobs))
    return out


def _model_name(model: str | None) -> str | None:
    if model and model.startswith("models/"):
        return model[len("models/"):]
    return model


def convert_tools(body: dict[str, Any], where: str) -> list[dict[str, Any]]:
    tools = get(body, "tools")
    if tools is None:
        config = get(body, "config")  # SDK: generate_content(config={"tools": ...})
        tools = get(config, "tools") if isinstance(config, dict) else None
    if tools is None:
        return []
    out = []
    for i, tool in enumerate(expect_list(tools, f"{where}.tools")):
        at = f"{where}.tools[{i}]"
        tool = expect_dict(tool, at)
        decls = get(tool, "functionDeclarations")
        if decls is None:
            continue  # googleSearch, codeExecution...: switches, not function tools
        for k, decl in enumerate(expect_list(decls, f"{at}.functionDeclarations")):
            dat = f"{at}.functionDeclarations[{k}]"
            decl = expect_dict(decl, dat)
            params = get(decl, "parameters")
            if params is None:
                params = get(decl, "parametersJsonSchema")
            out.append(tool_def(decl.get("name"), decl.get("description"), params, dat))
    return out


def convert_request(body: dict[str, Any], blobs: dict[str, bytes],
                    where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = get(body, "systemInstruction")
    if system is None:
        config = get(body, "config")
        system = get(config, "systemInstruction") if isinstance(config, dict) else None
    if system is not None:
        at = f"{where}.systemInstruction"
        if isinstance(system, str):
            parts = [{"type": "text", "text": system}]
        else:
            system = expect_dict(system, at)
            parts = []
            for k, part in enumerate(expect_list(get(system, "parts"), f"{at}.parts")):
                if not isinstance(part, dict):
                    expect_dict(part, f"{at}.parts[{k}]")
                text = part.get("text")
                if not isinstance(text, str):
                    text_part(text, f"{at}.parts[{k}].text")
                parts.append({"type": "text", "text": text})
        out.append({"role": "system", "content": parts})
    contents = get(body, "contents")
    if contents is None:
        raise NormalizeError(f"{where}.contents: missing (a Gemini record needs contents)")
    if isinstance(contents, str):
        contents = [{"role": "user", "parts": [{"text": contents}]}]
    for i, content in enumerate(expect_list(contents, f"{where}.contents")):
        out += _turn(content, f"{where}.contents[{i}]", blobs, default_role="user")
    return out


def _turn(content: Any, where: str, blobs: dict[str, bytes],
          default_role: str) -> list[dict[str, Any]]:
    if not isinstance(content, dict):
        expect_dict(content, where)
    role = content.get("role") or default_role
    if not isinstance(role, str) or role not in _ROLE:  # a list is not hashable: no TypeError
        raise NormalizeError(f"{where}.role: unknown role {role!r} (Gemini has user, model "
                             f"and function)")
    canon_role = _ROLE[role]
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    content_parts = get(content, "parts")
    if not isinstance(content_parts, list):
        expect_list(content_parts, f"{where}.parts")
    for k, part in enumerate(content_parts):
        if not isinstance(part, dict):
            expect_dict(part, f"{where}.parts[{k}]")
        if "text" in part:
            text = part["text"]
            if not isinstance(text, str):
                text_part(text, f"{where}.parts[{k}].text")
            if part.get("thought") is True:
                parts.append({"type": "reasoning", "text": text})
            else:
                parts.append({"type": "text", "text": text})
            continue
        at = f"{where}.parts[{k}]"
        if (inline := get(part, "inlineData")) is not None:
            inline = expect_dict(inline, f"{at}.inlineData")
            mime = get(inline, "mimeType")
            if not isinstance(mime, str) or not mime.startswith("image/"):
                raise NormalizeError(f"{at}.inlineData.mimeType: {mime!r} is not an image type")
            parts.append(inline_image(inline.get("data"), mime, f"{at}.inlineData.data", blobs))
        elif (file_data := get(part, "fileData")) is not None:
            file_data = expect_dict(file_data, f"{at}.fileData")
            mime = get(file_data, "mimeType")
            if mime is not None and (not isinstance(mime, str) or not mime.startswith("image/")):
                raise NormalizeError(f"{at}.fileData.mimeType: {mime!r} is not an image type")
            parts.append(url_image(get(file_data, "fileUri"), mime, f"{at}.fileData.fileUri",
                                   blobs))
        elif (call := get(part, "functionCall")) is not None:
            if canon_role != "assistant":
                raise NormalizeError(f"{at}.functionCall: only the model's turn calls functions")
            call = expect_dict(call, f"{at}.functionCall")
            args = call.get("args")
            if args is not None and not isinstance(args, dict):
                raise NormalizeError(f"{at}.functionCall.args: expected an object")
            calls.append(tool_call(call.get("id"), call.get("name"), args,
                                   f"{at}.functionCall"))
        elif (resp := get(part, "functionResponse")) is not None:
            if canon_role == "assistant":
                raise NormalizeError(f"{at}.functionResponse: the model's turn cannot hold one")
            resp = expect_dict(resp, f"{at}.functionResponse")
            name = resp.get("name")
            if not isinstance(name, str) or not name:
                raise NormalizeError(f"{at}.functionResponse.name: expected a non-empty string")
            result = resp.get("response")
            if not isinstance(result, dict):
                raise NormalizeError(f"{at}.functionResponse.response: expected an object")
            tools.append(tool_message(resp.get("id"), name, tool_result_parts(result)))
        elif get(part, "thoughtSignature") is not None and len(part) == 1:
            continue
        else:
            keys = ", ".join(sorted(part)) or "nothing"
            raise NormalizeError(f"{at}: unsupported part (has {keys})")
    return turn_messages(canon_role, tools, parts, calls)


def reassemble_stream(chunks: list[Any]) -> dict[str, Any]:
    """``streamGenerateContent`` chunks into one response: parts merged per candidate."""
    # Adjacent text parts (same ``thought``) merge into the first of them. Their texts are
    # gathered and joined once the run ends: merging chunk by chunk would copy the text so far
    # each time, quadratic in the length of a reply.
    cands: dict[int, dict[str, Any]] = {}
    runs: dict[int, list[str]] = {}  # candidate -> texts of its last part, while more merge in
    model = None
    feedback = None
    for i, chunk in enumerate(chunks):
        at = f"stream[{i}]"
        chunk = expect_dict(chunk, at)
        model = model or get(chunk, "modelVersion")
        feedback = feedback or get(chunk, "promptFeedback")
        for index, cand, cat in indexed(get(chunk, "candidates") or [], f"{at}.candidates"):
            acc = cands.setdefault(index, {"role": "model", "parts": []})
            content = get(cand, "content")
            if content is None:
                continue
            content = expect_dict(content, f"{cat}.content")
            for k, part in enumerate(expect_list(get(content, "parts") or [],
                                                 f"{cat}.content.parts")):
                part = expect_dict(part, f"{cat}.content.parts[{k}]")
                prev = acc["parts"][-1] if acc["parts"] else None
                if ("text" in part and isinstance(part["text"], str) and prev is not None
                        and "text" in prev and isinstance(prev["text"], str)
                        and bool(prev.get("thought")) == bool(part.get("thought"))):
                    run = runs.get(index)
                    if run is None:
                        runs[index] = [prev["text"], part["text"]]
                    else:
                        run.append(part["text"])
                else:
                    if index in runs:
                        _merge_run(acc, runs.pop(index))
                    acc["parts"].append(part)
            if get(cand, "finishReason"):
                acc["finishReason"] = get(cand, "finishReason")
    for index, run in runs.items():
        _merge_run(cands[index], run)
    candidates = [{"index": k, "content": {"role": v["role"], "parts": v["parts"]},
                   "finishReason": v.get("finishReason")} for k, v in sorted(cands.items())]
    return {"candidates": candidates, "modelVersion": model, "promptFeedback": feedback}


def _merge_run(acc: dict[str, Any], texts: list[str]) -> None:
    """The candidate's last part with the texts of the parts merged into it."""
    acc["parts"][-1] = {**acc["parts"][-1], "text": "".join(texts)}
