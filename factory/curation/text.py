"""Reading canonical samples: text of turns, the prompt, template-ready messages.

Everything here is a pure function of one sample's ``messages``/``tools`` JSON, so both engines
(in process and Spark workers) compute exactly the same values.
"""

from __future__ import annotations

from typing import Any

import orjson

from factory.language import words


def parse_json(text: str | None) -> Any:
    if text is None or text == "":
        return []
    return orjson.loads(text)


def part_text(part: dict[str, Any]) -> str:
    """Text of one content part as the template sees it (images as a placeholder)."""
    kind = part.get("type")
    if kind in ("text", "reasoning"):
        return str(part.get("text") or "")
    if kind == "image":
        return "<image>"
    return ""


def message_text(msg: dict[str, Any], *, with_reasoning: bool = True) -> str:
    parts = msg.get("content") or []
    return "\n".join(part_text(p) for p in parts
                     if isinstance(p, dict) and (with_reasoning or p.get("type") != "reasoning"))


def render_tool_call(call: dict[str, Any]) -> str:
    """A tool call as text: one line of JSON inside ``<tool_call>`` tags (Hermes style)."""
    body = orjson.dumps({"name": call.get("name", ""), "arguments": _args_value(call)},
                        option=orjson.OPT_SORT_KEYS).decode()
    return f"<tool_call>\n{body}\n</tool_call>"


def _args_value(call: dict[str, Any]) -> Any:
    raw = call.get("arguments", "")
    try:
        return orjson.loads(raw) if isinstance(raw, str) and raw else raw
    except orjson.JSONDecodeError:
        return raw


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Canonical messages as ``{"role", "content": str}`` for a chat template.

    Chat templates only know string content: text parts are joined by newlines, images become
    ``<image>``, tool calls are appended as ``<tool_call>`` JSON lines and tool results are
    wrapped in ``<tool_response>`` so the same conversation always renders the same text.
    """
    out = []
    for msg in messages:
        role = str(msg.get("role", ""))
        text = message_text(msg)
        if role == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(render_tool_call(c) for c in msg["tool_calls"])
            text = f"{text}\n{calls}" if text else calls
        elif role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    return out


def last_assistant_index(messages: list[dict[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return i
    return -1


def final_output(messages: list[dict[str, Any]]) -> str:
    """Text of the last assistant turn (without reasoning), or ``""``."""
    i = last_assistant_index(messages)
    return message_text(messages[i], with_reasoning=False).strip() if i >= 0 else ""


def user_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [message_text(m) for m in messages if m.get("role") == "user"]


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """What the model was asked: the user turns (system prompts excluded: they are shared)."""
    return "\n".join(user_texts(messages))


def conversation_text(messages: list[dict[str, Any]]) -> str:
    """Every non-system turn's text, tool calls included: the text near-duplicates compare."""
    out = []
    for msg in template_messages([m for m in messages if m.get("role") != "system"]):
        out.append(msg["content"])
    return "\n".join(out)


def system_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(message_text(m) for m in messages if m.get("role") == "system")


def normalize(text: str) -> str:
    """Case- and whitespace-insensitive form used for exact prompt matching."""
    return " ".join(words(text))
