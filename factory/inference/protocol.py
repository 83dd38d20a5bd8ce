"""The OpenAI chat protocol around the one rendering: tool calls out.

**Requests** are read as the canonical conversation the trainer renders, and written in the
serving protocol's shape, by ``factory.normalize.request`` (the gateway uses it too).

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

import uuid
from collections.abc import Callable
from typing import Any

from factory.trainer.chat import parse_assistant

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
THINK_OPEN = "<think>\n"
THINK_CLOSE = "\n</think>"
FIRST_DELTA: dict[str, Any] = {"role": "assistant", "content": None}
"""The first delta of a reply to a request with tools: whether it is text is not known yet."""


def new_call_id() -> str:
    """A tool-call id shaped like OpenAI's (``call_`` and 24 hex digits), unique per call."""
    return f"call_{uuid.uuid4().hex[:24]}"


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
