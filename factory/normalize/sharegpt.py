"""ShareGPT (``conversations`` of ``from``/``value`` turns) into canonical conversations.

Speaker names vary between datasets (``human``/``user``, ``gpt``/``assistant``/``model``...).
The LLaMA-Factory tool convention is read too: ``function_call`` turns hold
``{"name", "arguments"}`` JSON (one or a list) and ``observation`` turns hold the results; a
top-level ``system`` string and ``tools`` (JSON text or a list) are honoured.
"""

from __future__ import annotations

import json
from typing import Any

from factory.normalize.canon import (
    NormalizeError,
    expect_dict,
    expect_list,
    finish,
    text_part,
    tool_call,
    tool_def,
    tool_message,
    tool_result_parts,
)

_SPEAKER = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "model": "assistant", "chatgpt": "assistant", "bard": "assistant",
            "bing": "assistant", "system": "system", "function_call": "call",
            "observation": "tool", "tool": "tool", "function": "tool"}


def normalize(payload: Any) -> list[dict[str, Any]]:
    body = expect_dict(payload, "record")
    turns = expect_list(body.get("conversations"), "conversations")
    if body.get("images"):
        raise NormalizeError("images: ShareGPT image paths cannot be resolved at ingest")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None and system != "":
        messages.append({"role": "system", "content": [text_part(system, "system")]})
    for i, turn in enumerate(turns):
        # Paths are formatted only for an error: this runs for every turn of every record.
        if not isinstance(turn, dict):
            expect_dict(turn, f"conversations[{i}]")
        speaker = turn.get("from")
        role = _SPEAKER.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise NormalizeError(f"conversations[{i}].from: unknown speaker {speaker!r}")
        value = turn.get("value")
        if isinstance(value, str) and role != "call":
            messages.append(tool_message(None, None, tool_result_parts(value)) if role == "tool"
                            else {"role": role, "content": [{"type": "text", "text": value}]})
            continue
        at = f"conversations[{i}]"
        if role == "call":
            messages.append({"role": "assistant", "content": [],
                             "tool_calls": _calls(value, f"{at}.value")})
        elif role == "tool":
            text_part(value, f"{at}.value")
            messages.append(tool_message(None, None, tool_result_parts(value)))
        else:
            messages.append({"role": role, "content": [text_part(value, f"{at}.value")]})
    return [finish(messages, _tools(body.get("tools")), provider=None, model=None,
                   where="conversations")]


def _calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, str):
        raise NormalizeError(f"{where}: expected JSON text of a function call")
    try:
        parsed = json.loads(value)
    except ValueError:
        raise NormalizeError(f"{where}: function_call value is not JSON") from None
    items = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for k, item in enumerate(items):
        item = expect_dict(item, f"{where}[{k}]")
        out.append(tool_call(None, item.get("name"), item.get("arguments"), f"{where}[{k}]"))
    return out


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None or raw == "":
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise NormalizeError("tools: a string that is not JSON") from None
    out = []
    for i, tool in enumerate(expect_list(raw, "tools")):
        tool = expect_dict(tool, f"tools[{i}]")
        if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
            tool = tool["function"]
        out.append(tool_def(tool.get("name"), tool.get("description"), tool.get("parameters"),
                            f"tools[{i}]"))
    return out
