"""One conversation (system prompt, image, tool call, tool result) in every input format.

Each builder returns a record that must normalize to ``CANONICAL`` exactly; the streamed
variants split the same replies into the chunks each provider streams.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib
from typing import Any


def png_bytes(width: int = 2, height: int = 2, seed: int = 0) -> bytes:
    """A real PNG image (valid chunks and CRCs)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    rows = b"".join(b"\x00" + bytes((seed + x + y) % 256 for x in range(width * 3))
                    for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0,
                                                              0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


PNG = png_bytes()
PNG_B64 = base64.b64encode(PNG).decode()
PNG_SHA = hashlib.sha256(PNG).hexdigest()
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\x00" * 32 + b"\xff\xd9"
JPEG_B64 = base64.b64encode(JPEG).decode()

SYSTEM = "You are a weather assistant. Answer briefly."
QUESTION = "What's the weather where this photo was taken? Réponds en anglais."
ANSWER = "It is sunny and 21 °C in Paris."
ARGS = {"city": "Paris"}
RESULT = {"temp_c": 21, "sky": "sunny"}
TOOL_NAME = "get_weather"
TOOL_DESC = "Current weather for a city."
PARAMS = {"type": "object", "properties": {"city": {"type": "string",
                                                    "description": "City name"}},
          "required": ["city"]}
GEMINI_PARAMS = {"type": "OBJECT", "properties": {"city": {"type": "STRING",
                                                           "description": "City name"}},
                 "required": ["city"]}

CANONICAL_MESSAGES = [
    {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
    {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                 {"type": "image", "media_type": "image/png", "sha256": PNG_SHA}]},
    {"role": "assistant", "content": [],
     "tool_calls": [{"id": "call_0", "name": TOOL_NAME, "arguments": '{"city":"Paris"}'}]},
    {"role": "tool", "tool_call_id": "call_0",
     "content": [{"type": "text", "text": '{"sky":"sunny","temp_c":21}'}]},
    {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
]
CANONICAL_TOOLS = [{"name": TOOL_NAME, "description": TOOL_DESC, "parameters": PARAMS}]


# -- OpenAI --------------------------------------------------------------------------------------
def openai_request() -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}",
                                                    "detail": "low"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_Xy12", "type": "function",
                 "function": {"name": TOOL_NAME, "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_Xy12", "content": '{"temp_c": 21, "sky": "sunny"}'},
        ],
        "tools": [{"type": "function", "function": {"name": TOOL_NAME, "description": TOOL_DESC,
                                                    "parameters": PARAMS}}],
        "temperature": 0.2,
    }


def openai_call() -> dict[str, Any]:
    return {"capture_id": "0b6f0d6e-1c1e-4c55-9a53-0d1f6a0c0001", "provider": "openai",
            "endpoint": "/v1/chat/completions", "request": openai_request(),
            "response": {"id": "chatcmpl-1", "object": "chat.completion", "created": 1767225600,
                         "model": "gpt-4o-mini-2024-07-18",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": ANSWER,
                                                  "refusal": None}}]},
            "status": 200, "partial": False}


def openai_stream_call() -> dict[str, Any]:
    base = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1767225600,
            "model": "gpt-4o-mini-2024-07-18"}
    pieces = ["It is sunny", " and 21 °C", " in Paris."]
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{**base, "choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({**base, "choices": [], "usage": {"total_tokens": 9}})
    return {"request": {**openai_request(), "stream": True}, "stream": chunks}


def openai_finetune_line() -> dict[str, Any]:
    req = openai_request()
    return {"messages": [*req["messages"], {"role": "assistant", "content": ANSWER}],
            "tools": req["tools"]}


# -- Anthropic -----------------------------------------------------------------------------------
def anthropic_request() -> dict[str, Any]:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 512,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": PNG_B64}}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_01A", "name": TOOL_NAME, "input": ARGS}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A",
                 "content": [{"type": "text", "text": '{"temp_c":21,"sky":"sunny"}'}]}]},
        ],
        "tools": [{"name": TOOL_NAME, "description": TOOL_DESC, "input_schema": PARAMS}],
    }


def anthropic_call() -> dict[str, Any]:
    return {"capture_id": "0b6f0d6e-1c1e-4c55-9a53-0d1f6a0c0002", "provider": "anthropic",
            "endpoint": "/v1/messages", "request": anthropic_request(),
            "response": {"id": "msg_1", "type": "message", "role": "assistant",
                         "model": "claude-sonnet-4-5-20250929",
                         "content": [{"type": "text", "text": ANSWER}],
                         "stop_reason": "end_turn"},
            "status": 200, "partial": False}


def anthropic_stream_call() -> dict[str, Any]:
    events = [
        {"type": "message_start", "message": {"id": "msg_2", "type": "message",
                                              "role": "assistant", "content": [],
                                              "model": "claude-sonnet-4-5-20250929"}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "It is sunny and 21 °C"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": " in Paris."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}},
        {"type": "message_stop"},
    ]
    return {"request": {**anthropic_request(), "stream": True}, "stream": events}


# -- Gemini --------------------------------------------------------------------------------------
def gemini_request() -> dict[str, Any]:
    return {
        "systemInstruction": {"parts": [{"text": SYSTEM}]},
        "contents": [
            {"role": "user", "parts": [{"text": QUESTION},
                                       {"inlineData": {"mimeType": "image/png", "data": PNG_B64}}]},
            {"role": "model", "parts": [{"functionCall": {"name": TOOL_NAME, "args": ARGS}}]},
            {"role": "function", "parts": [{"functionResponse": {"name": TOOL_NAME,
                                                                 "response": RESULT}}]},
        ],
        "tools": [{"functionDeclarations": [{"name": TOOL_NAME, "description": TOOL_DESC,
                                             "parameters": GEMINI_PARAMS}]}],
        "generationConfig": {"temperature": 0.2},
    }


def gemini_call() -> dict[str, Any]:
    return {"capture_id": "0b6f0d6e-1c1e-4c55-9a53-0d1f6a0c0003", "provider": "gemini",
            "endpoint": "/v1beta/models/gemini-2.5-flash:generateContent",
            "request": gemini_request(),
            "response": {"candidates": [{"content": {"role": "model",
                                                     "parts": [{"text": ANSWER}]},
                                         "finishReason": "STOP", "index": 0}],
                         "modelVersion": "gemini-2.5-flash"},
            "status": 200, "partial": False}


def gemini_snake_call() -> dict[str, Any]:
    """The same call as the Python SDK spells it (snake_case keys), uploaded without capture."""
    return {
        "request": {
            "model": "gemini-2.5-flash",
            "system_instruction": {"parts": [{"text": SYSTEM}]},
            "contents": [
                {"role": "user", "parts": [{"text": QUESTION},
                                           {"inline_data": {"mime_type": "image/png",
                                                            "data": PNG_B64}}]},
                {"role": "model", "parts": [{"function_call": {"name": TOOL_NAME,
                                                               "args": ARGS}}]},
                {"role": "user", "parts": [{"function_response": {"name": TOOL_NAME,
                                                                  "response": RESULT}}]},
            ],
            "tools": [{"function_declarations": [{"name": TOOL_NAME, "description": TOOL_DESC,
                                                  "parameters": GEMINI_PARAMS}]}],
        },
        "response": {"candidates": [{"content": {"role": "model", "parts": [{"text": ANSWER}]},
                                     "finish_reason": "STOP"}],
                     "model_version": "gemini-2.5-flash"},
    }


def gemini_stream_call() -> dict[str, Any]:
    chunks = [{"candidates": [{"content": {"role": "model", "parts": [{"text": p}]},
                               "index": 0}], "modelVersion": "gemini-2.5-flash"}
              for p in ("It is sunny ", "and 21 °C in Paris.")]
    chunks[-1]["candidates"][0]["finishReason"] = "STOP"
    return {"provider": "gemini", "endpoint": "/v1beta/models/gemini-2.5-flash:"
                                              "streamGenerateContent?alt=sse",
            "request": gemini_request(), "stream": chunks, "status": 200}


# -- OTLP ----------------------------------------------------------------------------------------
def semconv_chat_attributes(final: bool) -> dict[str, Any]:
    """The GenAI semconv attributes of the first (tool call) or second (answer) chat span."""
    import json

    user = {"role": "user", "parts": [
        {"type": "text", "content": QUESTION},
        {"type": "blob", "modality": "image", "mime_type": "image/png", "content": PNG_B64}]}
    call = {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_77",
                                            "name": TOOL_NAME, "arguments": ARGS}]}
    result = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_77",
                                         "response": RESULT}]}
    inputs = [user, call, result] if final else [user]
    output = ({"role": "assistant", "parts": [{"type": "text", "content": ANSWER}],
               "finish_reason": "stop"} if final else {**call, "finish_reason": "tool_call"})
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": SYSTEM}]),
        "gen_ai.input.messages": json.dumps(inputs),
        "gen_ai.output.messages": json.dumps([output]),
        "gen_ai.tool.definitions": json.dumps([{"type": "function", "name": TOOL_NAME,
                                                "description": TOOL_DESC,
                                                "parameters": PARAMS}]),
    }


def _kv(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, value in attrs.items():
        if isinstance(value, bool):
            v = {"boolValue": value}
        elif isinstance(value, int):
            v = {"intValue": str(value)}
        else:
            v = {"stringValue": value}
        out.append({"key": key, "value": v})
    return out


def otlp_export(trace_id: str = "5b8efff798038103d269b633813fc60c") -> dict[str, Any]:
    """An OTLP/JSON export of one linear agent run: chat -> execute_tool -> chat."""
    t0 = 1767225600_000_000_000
    spans = [
        {"traceId": trace_id, "spanId": "eee19b7ec3c1b174", "name": "invoke_agent weather",
         "kind": 1, "startTimeUnixNano": str(t0), "endTimeUnixNano": str(t0 + 9_000_000),
         "attributes": _kv({"gen_ai.operation.name": "invoke_agent"})},
        # Listed out of order on purpose: assembly sorts by start time.
        {"traceId": trace_id, "spanId": "eee19b7ec3c1b177", "parentSpanId": "eee19b7ec3c1b174",
         "name": "chat gpt-4o-mini", "kind": 3, "startTimeUnixNano": str(t0 + 5_000_000),
         "endTimeUnixNano": str(t0 + 8_000_000), "attributes": _kv(semconv_chat_attributes(True))},
        {"traceId": trace_id, "spanId": "eee19b7ec3c1b175", "parentSpanId": "eee19b7ec3c1b174",
         "name": "chat gpt-4o-mini", "kind": 3, "startTimeUnixNano": str(t0 + 1_000_000),
         "endTimeUnixNano": str(t0 + 3_000_000),
         "attributes": _kv(semconv_chat_attributes(False))},
        {"traceId": trace_id, "spanId": "eee19b7ec3c1b176", "parentSpanId": "eee19b7ec3c1b174",
         "name": "execute_tool get_weather", "kind": 1, "startTimeUnixNano": str(t0 + 3_500_000),
         "endTimeUnixNano": str(t0 + 4_000_000),
         "attributes": _kv({"gen_ai.operation.name": "execute_tool",
                            "gen_ai.tool.name": TOOL_NAME, "gen_ai.tool.call.id": "call_77"})},
    ]
    return {"resourceSpans": [{
        "resource": {"attributes": _kv({"service.name": "weather-agent"})},
        "scopeSpans": [{"scope": {"name": "agent"}, "spans": spans}]}]}


ALL_FORMS = {
    "openai": openai_call,
    "openai_stream": openai_stream_call,
    "openai_finetune": openai_finetune_line,
    "anthropic": anthropic_call,
    "anthropic_stream": anthropic_stream_call,
    "gemini_camel": gemini_call,
    "gemini_snake": gemini_snake_call,
    "gemini_stream": gemini_stream_call,
    "otlp": otlp_export,
}
