"""A chat request between OpenAI's shape, the canonical conversation and the serving protocol.

**In.** A chat request's ``messages`` and ``tools`` become the canonical conversation
(``shared/docs/canonical-sample.md``) through ingest's own OpenAI reader
(``factory.normalize.openai``) and finishing pass (``canon.finish``), so a served conversation is
rendered from exactly the sample that the same conversation, logged and ingested, trains on:
tool-call arguments and JSON tool results re-serialized canonically (compact, sorted keys), tools
as ``{name, description, parameters}`` (``""`` and ``{}`` when absent, ``strict`` and other
keys dropped), ``developer`` as ``system``, empty text parts dropped, ids renumbered
(``canonical_request``). Messages the factory's own evals send with canonical parts
(``reasoning``, ``image`` by sha256) or flat calls (``{id, name, arguments}``) are read as
canonical. ``chat_template_input`` gives that conversation in the shape Hugging Face templates
expect (text-only content as one string, calls under ``function``, tools wrapped in ``{"type":
"function"}``); the trainer's template renders it byte-equal to ``factory.trainer.chat.render``
of the canonical sample (tests/inference/test_protocol.py).

**Out.** ``wire_messages`` and ``wire_tools`` write canonical (or OpenAI-shaped) messages and
tools as the serving protocol carries them (docs/serving-protocol.md), for the factory's clients
and for the gateway, which sends requests on a route to a factory deployment in that form
(``as_trained``): vLLM renders a request as it is sent, so what it renders is what the trainer
rendered only once the request is canonical.

Here, below the gateway and the inference server, so both read requests one way.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from factory.normalize.canon import (
    NormalizeError,
    canon_json_text,
    expect_dict,
    expect_list,
    finish,
    text_part,
    tool_call,
)
from factory.normalize.openai import convert_messages, convert_tools
from factory.trainer.chat import _content as rendered_content

_CANONICAL_PART_TYPES = frozenset({"reasoning", "image"})
_ROLES = frozenset({"system", "user", "assistant", "tool"})


def canonical_request(messages: Any, tools: Any = None, *,
                      blobs: dict[str, bytes] | None = None
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """An OpenAI chat request's ``messages`` and ``tools`` as the canonical conversation.

    The bytes of the request's inline images (``image_url`` data URLs, now canonical image
    parts by sha256) go into ``blobs`` when given. Raises ``NormalizeError`` (a
    ``ValueError``) naming the field, as ingest does.
    """
    items = expect_list(messages, "messages")
    if not items:
        raise NormalizeError("messages: must be a non-empty list")
    canonical_at = {i for i, m in enumerate(items) if _is_canonical(m)}
    # Ingest's reader keeps its error paths (messages[i]...) when it reads the whole list, so the
    # canonical messages are swapped for an empty user turn there and put back after.
    placeholder = {"role": "user", "content": ""}
    openai = [placeholder if i in canonical_at else m for i, m in enumerate(items)]
    converted = convert_messages(openai, blobs if blobs is not None else {})
    for i in canonical_at:
        converted[i] = _canonical_message(items[i], f"messages[{i}]")
    canon_tools = convert_tools({"tools": _wrapped_tools(tools)}, "request") if tools else []
    # ``finish`` is the ids' renumbering and the empty-text rule of every ingested sample. It
    # refuses a conversation with no assistant turn (a training sample needs one, a request
    # usually has none), so it finishes the request followed by an empty assistant turn.
    done = finish([*converted, {"role": "assistant", "content": []}], canon_tools,
                  provider=None, model=None)
    return done["messages"][:-1], canon_tools


def chat_template_input(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Canonical messages and tools in the shape Hugging Face chat templates read.

    Content made only of text parts becomes one string (parts joined with ``\\n``, as the
    rendering joins them), so a template that only knows string content (a base model's shipped
    one) still renders text chats; calls go under ``function`` and tools under
    ``{"type": "function", "function": ...}``. Values are not changed: arguments stay the
    canonical JSON strings.
    """
    out = []
    for m in messages:
        parts = m["content"]
        msg: dict[str, Any] = {"role": m["role"], "content": (
            "\n".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts)
            else parts)}
        if m.get("tool_calls"):
            msg["content"] = msg["content"] or None
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in m["tool_calls"]]
        if m["role"] == "tool":
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out, ([{"type": "function", "function": t} for t in tools] or None)


ImageURL = Callable[[dict[str, Any]], str]
"""The URL a canonical image part is sent as (``data:`` URL of its blob: ``image_data_urls``)."""


def image_data_urls(blob_root: str | Path) -> ImageURL:
    """Canonical image parts as ``data:`` URLs of their bytes in the blob store under
    ``blob_root`` (a remote image's part as its ``url``); ``ValueError`` naming the sha256 when
    the blob is not there."""
    # torch (~2 s): only a client of a model that reads images needs it
    from factory.trainer.vision import MissingImage, blob_reader

    read = blob_reader(blob_root)

    def url(part: dict[str, Any]) -> str:
        if isinstance(part.get("url"), str) and not part.get("sha256"):
            return str(part["url"])
        try:
            data = read(str(part.get("sha256")))
        except MissingImage as e:
            raise ValueError(str(e)) from None
        media = part.get("media_type") or "image/png"
        return f"data:{media};base64," + base64.b64encode(data).decode()

    return url


def holds_image(content: Any) -> TypeGuard[list[Any]]:
    """Whether a message's content holds a canonical image part."""
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "image" for p in content)


def wire_messages(messages: Any, image_url: ImageURL | None = None) -> list[dict[str, Any]]:
    """Canonical or OpenAI-shaped messages as the serving protocol carries them
    (docs/serving-protocol.md): content a string, text parts or null, calls nested under
    ``function``. vLLM refuses the canonical ``reasoning`` and ``image`` parts, so content that
    holds one is sent as the text the trainer renders for it (``<think>`` block, the ``[image]``
    placeholder of text-only models, parts joined by newlines): the server renders the same
    prompt, and vLLM accepts it. With ``image_url`` (a vision-language model) content holding
    an image goes as parts instead: text and reasoning as text parts, each image as an OpenAI
    ``image_url`` part (``image_data_urls``), which the server renders as the trainer does.
    Other messages go as they are."""
    out = []
    for m in messages:
        msg = dict(m)
        parts = msg.get("content")
        if image_url is not None and holds_image(parts):
            msg["content"] = [
                {"type": "image_url", "image_url": {"url": image_url(p)}}
                if p.get("type") == "image" else
                {"type": "text", "text": rendered_content([p])} for p in parts]
        elif isinstance(parts, list) and any(isinstance(p, dict) and p.get("type")
                                             in _CANONICAL_PART_TYPES for p in parts):
            msg["content"] = rendered_content(parts)
        if msg.get("tool_calls"):
            if not msg.get("content"):
                msg["content"] = None
            msg["tool_calls"] = [
                c if not isinstance(c, dict) or "function" in c else
                {"id": c.get("id"), "type": "function",
                 "function": {"name": c.get("name"), "arguments": c.get("arguments")}}
                for c in msg["tool_calls"]]
        out.append(msg)
    return out


def wire_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as the serving protocol carries them (``{"type": "function", "function": ...}``),
    from canonical (flat) or OpenAI-shaped ones; None for none."""
    return _wrapped_tools(list(tools)) if tools else None


def _is_canonical(msg: Any) -> bool:
    """Whether ``msg`` holds what only the canonical form has (not OpenAI's shape)."""
    if not isinstance(msg, dict):
        return False
    content = msg.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type")
                                         in _CANONICAL_PART_TYPES for p in content):
        return True
    calls = msg.get("tool_calls")
    return isinstance(calls, list) and any(isinstance(c, dict) and "function" not in c
                                           for c in calls)


def _canonical_message(msg: dict[str, Any], at: str) -> dict[str, Any]:
    role = msg.get("role")
    if role not in _ROLES:
        raise NormalizeError(f"{at}.role: unknown role {role!r}")
    parts = []
    for k, part in enumerate(expect_list(msg.get("content") or [], f"{at}.content")):
        part = expect_dict(part, f"{at}.content[{k}]")
        kind = part.get("type")
        if kind in ("text", "reasoning"):
            text = text_part(part.get("text"), f"{at}.content[{k}].text")["text"]
            parts.append({"type": kind, "text": canon_json_text(text) if role == "tool" else text})
        elif kind == "image":
            parts.append(dict(part))
        else:
            raise NormalizeError(f"{at}.content[{k}].type: unsupported content part type "
                                 f"{kind!r}")
    new: dict[str, Any] = {"role": role, "content": parts}
    if role == "assistant" and msg.get("tool_calls"):
        calls = []
        for j, call in enumerate(expect_list(msg["tool_calls"], f"{at}.tool_calls")):
            call = expect_dict(call, f"{at}.tool_calls[{j}]")
            fn = expect_dict(call.get("function", call), f"{at}.tool_calls[{j}]")
            calls.append(tool_call(call.get("id"), fn.get("name"), fn.get("arguments"),
                                   f"{at}.tool_calls[{j}]"))
        new["tool_calls"] = calls
    if role == "tool":
        new["tool_call_id"] = msg.get("tool_call_id")
    return new


def _wrapped_tools(tools: Any) -> Any:
    """Tools given flat (``{name, ...}``, as canonical samples hold them) wrapped as OpenAI's."""
    if not isinstance(tools, list):
        return tools
    return [{"type": "function", "function": t}
            if isinstance(t, dict) and "function" not in t and "name" in t else t for t in tools]


def as_trained(request: dict[str, Any]) -> dict[str, Any] | None:
    """``messages`` (and ``tools``, when sent) of an OpenAI chat ``request`` as the trainer
    renders them: read as the canonical conversation and written back in the serving protocol's
    shape (``canonical_request``, ``wire_messages``, ``wire_tools``); None when the request
    cannot be read that way (the server it goes to says why) or holds an image (sent as it is:
    its pixels travel only in the request's own parts)."""
    try:
        messages, tools = canonical_request(request.get("messages"), request.get("tools"),
                                            blobs={})
    except ValueError:
        return None
    if any(holds_image(m.get("content")) for m in messages):
        return None
    out: dict[str, Any] = {"messages": wire_messages(messages)}
    if request.get("tools") is not None:
        out["tools"] = wire_tools(tools) or []
    return out
