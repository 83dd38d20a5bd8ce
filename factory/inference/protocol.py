"""The OpenAI chat protocol around the one rendering: requests in, tool calls out.

**Requests.** A chat request's ``messages`` and ``tools`` become the canonical conversation
(``shared/docs/canonical-sample.md``) through ingest's own OpenAI reader
(``factory.normalize.openai``) and finishing pass (``canon.finish``), so a served conversation is
rendered from exactly the sample that the same conversation, logged and ingested, trains on:
tool-call arguments and JSON tool results re-serialized canonically (compact, sorted keys), tools
as ``{name, description, parameters}`` (``""`` and ``{}`` when absent, ``strict`` and other
keys dropped), ``developer`` as ``system``, empty text parts dropped, ids renumbered. The chat
template sees that conversation in the shape Hugging Face templates expect (text-only content as
one string, calls under ``function``, tools wrapped in ``{"type": "function"}``); the trainer's
template renders it byte-equal to ``factory.trainer.chat.render`` of the canonical sample
(tests/inference/test_protocol.py). Messages the factory's own evals send with canonical parts
(``reasoning``, ``image`` by sha256) or flat calls (``{id, name, arguments}``) are read as
canonical.

**Replies.** Generated text is read with the trainer's parser of its own format
(``factory.trainer.chat.parse_assistant``): each ``<tool_call>...</tool_call>`` span, up to the first
closing tag, whose JSON has a string ``name`` is a call (``arguments`` canonical JSON); any other
span (bad JSON, no name, no closing tag because ``max_tokens`` cut it) stays in the content as
text, so nothing the model said is lost and nothing raises. The content is the text outside the
calls, with trailing whitespace dropped when there are calls, and ``null`` when nothing is left.
``finish_reason`` is ``length`` when the token budget ran out (the reply is cut, whatever it
holds), else ``tool_calls`` when there are calls, else ``stop``.

**Streaming.** A call can only be recognised from its text, so ``ReplyStream`` is fed the text
deltas and holds back what is still undecided:

- text that cannot start a call streams as content at once, except a suffix that may be the
  start of ``<tool_call>`` and trailing whitespace (dropped if calls follow);
- from an opening ``<tool_call>`` on, nothing is sent until its ``</tool_call>`` arrives: then
  a valid call goes out as OpenAI streams one (a delta with ``index``, ``id``, ``type`` and
  ``function.name`` with empty ``arguments``, then a delta with the ``arguments``), an invalid
  one as content;
- at the end, whatever is still held (an unclosed call, a partial tag) is content.

Non-streamed replies run the same reader over the whole text (``reply_message``), so the
chunks accumulate (as the ``openai`` SDK does it) into the non-streamed message exactly.
"""

from __future__ import annotations

import base64
import uuid
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
from factory.trainer.chat import parse_assistant

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
THINK_OPEN = "<think>\n"
THINK_CLOSE = "\n</think>"
FIRST_DELTA: dict[str, Any] = {"role": "assistant", "content": None}
"""The first delta of a reply to a request with tools: whether it is text is not known yet."""
_CANONICAL_PART_TYPES = frozenset({"reasoning", "image"})
_ROLES = frozenset({"system", "user", "assistant", "tool"})


def new_call_id() -> str:
    """A tool-call id shaped like OpenAI's (``call_`` and 24 hex digits), unique per call."""
    return f"call_{uuid.uuid4().hex[:24]}"


# --- requests -----------------------------------------------------------------------------------


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


# --- replies ------------------------------------------------------------------------------------


def parse_call(span: str) -> dict[str, str] | None:
    """``{name, arguments}`` of one ``<tool_call>...</tool_call>`` span, or None if invalid.

    The trainer's parser decides, so what counts as a call here is what training taught.
    """
    calls = parse_assistant(span).get("tool_calls") or []
    if len(calls) != 1:
        return None
    return {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}


def _tag_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


class ReplyStream:
    """Generated text deltas in, OpenAI ``delta`` objects out (see the module docstring).

    ``feed`` takes each text delta and returns the deltas that can be sent now; ``close`` takes
    the engine's finish reason and returns the last deltas and the reply's finish reason.
    ``new_id`` makes each call's id (tests pass a deterministic one).
    """

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.text = ""
        """Everything generated so far."""
        self.content = ""
        """Content decided so far (text outside calls), some of it maybe not sent yet."""
        self.calls: list[dict[str, Any]] = []
        """Calls decided so far, OpenAI-shaped (``id``, ``type``, ``function``)."""
        self._pos = 0  # text before this is decided
        self._sent = 0  # characters of ``content`` sent

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        out = self._scan()
        # Trailing whitespace waits: it is dropped if a call follows and nothing else does.
        out += self._content_up_to(len(self.content.rstrip()))
        return out

    def close(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        out = self._scan()
        self.content += self.text[self._pos:]  # an unclosed call or a partial tag: text
        self._pos = len(self.text)
        final = self.content.rstrip() if self.calls else self.content
        out += self._content_up_to(len(final))
        self.content = final
        if not final and not self.calls:
            out.append({"content": ""})  # after FIRST_DELTA's null: the reply's content is ""
        if finish_reason == "length":
            return out, "length"
        return out, "tool_calls" if self.calls else finish_reason

    def message(self) -> dict[str, Any]:
        """The whole reply as a ``chat.completion`` message (after ``close``)."""
        msg: dict[str, Any] = {"role": "assistant",
                               "content": self.content if self.content or not self.calls
                               else None}
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    def _calls_from(self) -> int | None:
        """Where calls may start: after a leading reasoning block, whose text is never a call
        (as ``parse_assistant`` reads it); None while that is not known yet."""
        if self.text.startswith(THINK_OPEN):
            end = self.text.find(THINK_CLOSE, len(THINK_OPEN))
            return None if end < 0 else end + len(THINK_CLOSE)
        return None if THINK_OPEN.startswith(self.text) else 0

    def _scan(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        floor = self._calls_from()
        if floor is None:
            if self.text.startswith(THINK_OPEN):  # inside the reasoning: all of it is content
                self.content += self.text[self._pos:]
                self._pos = len(self.text)
            return out
        if self._pos < floor:
            self.content += self.text[self._pos:floor]
            self._pos = floor
        while True:
            start = self.text.find(OPEN, self._pos)
            if start < 0:
                # Up to a possible partial opening tag, the rest is content.
                end = len(self.text) - _tag_prefix_len(self.text[self._pos:])
                self.content += self.text[self._pos:end]
                self._pos = end
                return out
            self.content += self.text[self._pos:start]
            self._pos = start
            close = self.text.find(CLOSE, start + len(OPEN))
            if close < 0:
                return out  # the call is still being generated
            end = close + len(CLOSE)
            call = parse_call(self.text[start:end])
            if call is None:
                self.content += self.text[start:end]
            else:
                out += self._content_up_to(len(self.content.rstrip()))
                out += self._call(call)
            self._pos = end

    def _content_up_to(self, n: int) -> list[dict[str, Any]]:
        if n <= self._sent:
            return []
        piece = self.content[self._sent:n]
        self._sent = n
        return [{"content": piece}]

    def _call(self, call: dict[str, str]) -> list[dict[str, Any]]:
        index = len(self.calls)
        call_id = self.new_id()
        self.calls.append({"id": call_id, "type": "function",
                           "function": {"name": call["name"], "arguments": call["arguments"]}})
        return [{"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                 "function": {"name": call["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": index,
                                 "function": {"arguments": call["arguments"]}}]}]


def reply_message(text: str, finish_reason: str, new_id: Callable[[], str] = new_call_id
                  ) -> tuple[dict[str, Any], str]:
    """The ``chat.completion`` message and finish reason for the whole generated ``text``."""
    stream = ReplyStream(new_id)
    stream.feed(text)
    _, reason = stream.close(finish_reason)
    return stream.message(), reason
