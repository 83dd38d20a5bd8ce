"""Which format a record is in, and the dispatch to that format's normalizer.

Detection looks at the keys that only one format uses (``contents`` is Gemini, ``conversations``
ShareGPT, ``resourceSpans``/``otlp_trace`` OTLP); ``messages`` is OpenAI unless something
Anthropic-only shows up (a top-level ``system``, ``tool_use``/``tool_result``/``thinking``
blocks, ``input_schema`` tools, an Anthropic response or stream). Plain text chats look the same
in both and normalize to the same canonical conversation either way.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from factory.normalize import anthropic, gemini, openai, otlp, sharegpt
from factory.normalize.canon import NormalizeError, expect_dict, expect_list, kind

FORMATS = ("openai", "anthropic", "gemini", "sharegpt", "otlp")
_MODULES: dict[str, ModuleType] = {"openai": openai, "anthropic": anthropic, "gemini": gemini,
                                   "sharegpt": sharegpt, "otlp": otlp}
_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking",
                               "document"})
_OPENAI_PARTS = frozenset({"image_url", "input_audio", "refusal", "file"})


def detect_format(payload: Any) -> str | None:
    """The format of one record, or None when no format recognizes it."""
    if not isinstance(payload, dict):
        return None
    if "otlp_trace" in payload or otlp.is_otlp_export(payload):
        return "otlp"
    if "request" in payload and ("response" in payload or "stream" in payload):
        provider = payload.get("provider")
        if provider in ("openai", "anthropic", "gemini"):
            return str(provider)
        return _call_format(payload)
    if "conversations" in payload:
        return "sharegpt"
    if "contents" in payload:
        return "gemini"
    if "messages" in payload:
        return "anthropic" if _looks_anthropic(payload) else "openai"
    return None


def _call_format(payload: dict[str, Any]) -> str | None:
    request = payload.get("request")
    response = payload.get("response")
    stream = payload.get("stream")
    if isinstance(response, dict):
        if "candidates" in response or "promptFeedback" in response:
            return "gemini"
        if response.get("type") == "message" or (response.get("type") == "error"
                                                  and "choices" not in response):
            return "anthropic"
        if "choices" in response:
            return "openai"
    if isinstance(stream, list) and stream and isinstance(stream[0], dict):
        first = stream[0]
        if "candidates" in first:
            return "gemini"
        if first.get("type") in ("message_start", "ping") or "event" in first:
            return "anthropic"
        if first.get("object") == "chat.completion.chunk" or "choices" in first:
            return "openai"
    if isinstance(request, dict):
        if "contents" in request:
            return "gemini"
        if "messages" in request:
            return "anthropic" if _looks_anthropic(request) else "openai"
    return None


def _looks_anthropic(body: dict[str, Any]) -> bool:
    if "system" in body:
        return True
    tools = body.get("tools")
    if isinstance(tools, list) and any(isinstance(t, dict) and "input_schema" in t for t in tools):
        return True
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        if msg.get("role") in ("system", "developer", "tool", "function") or "tool_calls" in msg:
            return False
        content = msg.get("content")
        if isinstance(content, list):
            for block in content:
                if not isinstance(block, dict):
                    continue
                btype = block.get("type")
                if not isinstance(btype, str):  # (a dict or list is not hashable)
                    continue
                if btype in _ANTHROPIC_BLOCKS or (btype == "image" and "source" in block):
                    return True
                if btype in _OPENAI_PARTS:
                    return False
    return False


def normalize_record(payload: Any, format: str = "auto") -> list[dict[str, Any]]:
    """The canonical conversations of one record; ``NormalizeError`` naming the fault if none."""
    if format == "auto":
        detected = detect_format(payload)
        if detected is None:
            if not isinstance(payload, dict):
                raise NormalizeError(f"record: expected a JSON object, got {kind(payload)}")
            keys = ", ".join(sorted(payload)[:8]) or "none"
            raise NormalizeError(f"record: no format recognizes it (keys: {keys}; expected "
                                 f"messages, contents, conversations, request+response or "
                                 f"resourceSpans)")
        format = detected
    module = _MODULES.get(format)
    if module is None:
        raise ValueError(f"unknown format {format!r}; expected auto or one of "
                         f"{', '.join(FORMATS)}")
    if hasattr(module, "normalize_call") and isinstance(payload, dict) and "request" in payload and (
            "response" in payload or "stream" in payload):
        return _call(payload, module)
    if not isinstance(payload, dict):
        raise NormalizeError(f"record: expected a JSON object, got {kind(payload)}")
    result: list[dict[str, Any]] = module.normalize(payload)
    return result


def _call(payload: dict[str, Any], module: ModuleType) -> list[dict[str, Any]]:
    """A logged request/response (a gateway capture or an uploaded ``{request, response}``)."""
    status = payload.get("status", 200)
    if status != 200:
        raise NormalizeError(f"status: the upstream call returned {status!r}, not a completed "
                             f"response")
    if payload.get("partial") is True:
        raise NormalizeError("partial: the response ended early (stream cut off)")
    endpoint = payload.get("endpoint")
    stream = payload.get("stream")
    response = payload.get("response")
    if response is None and stream is None:
        raise NormalizeError("response: missing (a logged call needs a response or a stream)")
    if response is None:
        stream = expect_list(stream, "stream")
        if not stream:
            raise NormalizeError("stream: empty (no chunks were captured)")
    else:
        expect_dict(response, "response")
        stream = None
    result: list[dict[str, Any]] = module.normalize_call(
        payload["request"], response, stream, endpoint if isinstance(endpoint, str) else None)
    return result
