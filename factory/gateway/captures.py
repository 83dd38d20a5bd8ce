"""A spooled capture read back: its id in ``raw_traces`` and the capture record ingest reads.

The proxy spools a call's bytes as relayed (``factory.gateway.spool``); the flusher and the
shadow pairs decode them here, off the request path: SSE events, streamed JSON arrays, a
compressed body. ``stream_complete`` tells the proxy whether a stream's bytes already hold its
last event.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any

import orjson

from factory.gateway.spool import SpoolEntry


def capture_raw_trace_id(capture_id: str) -> str:
    """Deterministic id of a proxy capture in ``raw_traces``."""
    return hashlib.sha256(f"proxy:{capture_id}".encode()).hexdigest()


def parse_sse(data: bytes) -> list[Any]:
    """The JSON ``data:`` payloads of an SSE stream, in order (``[DONE]`` and comments skipped;
    a torn last event of a partial stream is dropped)."""
    events: list[Any] = []
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    for block in text.split("\n\n"):
        lines = [line[5:].removeprefix(" ") for line in block.split("\n")
                 if line.startswith("data:")]
        if not lines:
            continue
        joined = "\n".join(lines)
        if joined.strip() == "[DONE]":
            continue
        try:
            events.append(orjson.loads(joined))
        except orjson.JSONDecodeError:
            continue
    return events


# The end marker of a stream is in its last event; only this many bytes of the end are read.
_END_TAIL_BYTES = 4096


def stream_complete(kind: str | None, data: bytes) -> bool:
    """Whether relayed stream bytes already end with their protocol's last event: an SSE
    ``data: [DONE]`` (OpenAI) or ``message_stop`` event (Anthropic), or the closing ``]`` of a
    streamed JSON array (Gemini without ``alt=sse``). Gemini's SSE has no end marker: False.

    SDKs hang up once they have read the last event (the openai SDK closes the response on
    ``[DONE]``), often before the upstream's end of body has reached the gateway: a client gone
    after this point got the whole answer, and the capture is complete.
    """
    if kind == "json":
        try:
            return isinstance(orjson.loads(data), list)
        except orjson.JSONDecodeError:
            return False
    if kind != "sse":
        return False
    tail = data[-_END_TAIL_BYTES:]
    text = tail.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    if len(tail) < len(data):
        text = text.partition("\n")[2]  # drop the line the cut went through
    body = text.rstrip("\n")
    if len(text) - len(body) < 2:
        return False  # an SSE event is dispatched only at the blank line after it
    lines = body.rpartition("\n\n")[2].split("\n")
    data_text = "\n".join(line[5:].removeprefix(" ") for line in lines
                          if line.startswith("data:")).strip()
    if data_text == "[DONE]" or "event: message_stop" in lines or "event:message_stop" in lines:
        return True
    try:
        last = orjson.loads(data_text)
    except orjson.JSONDecodeError:
        return False
    return isinstance(last, dict) and last.get("type") == "message_stop"


def parse_json_array_stream(data: bytes) -> list[Any]:
    """The objects of a streamed JSON array (Gemini without ``alt=sse``), complete or cut short."""
    try:
        value = orjson.loads(data)
        return value if isinstance(value, list) else [value]
    except orjson.JSONDecodeError:
        pass
    decoder = json.JSONDecoder()
    text = data.decode("utf-8", errors="replace")
    items: list[Any] = []
    pos = 0
    while pos < len(text):
        while pos < len(text) and text[pos] in "[,] \r\n\t":
            pos += 1
        if pos >= len(text):
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        items.append(obj)
    return items


def _json_or_text(data: bytes) -> Any:
    if not data:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode("utf-8", errors="replace")


def capture_payload(entry: SpoolEntry) -> dict[str, Any]:
    """The capture record for ingest, from a spooled capture (bodies parsed here, not on the
    request path)."""
    h = entry.header
    req_len = h["rl"]
    request = orjson.loads(entry.body[:req_len])
    response_bytes = entry.body[req_len:]
    encoding = (h.get("ce") or "").lower()
    if encoding in ("gzip", "x-gzip", "deflate"):
        try:
            response_bytes = zlib.decompressobj(47 if "gzip" in encoding else 15).decompress(
                response_bytes)
        except zlib.error:
            pass  # kept as received; ingest rejects it with the reason
    payload: dict[str, Any] = {"capture_id": h["id"], "provider": h["provider"],
                               "endpoint": h["endpoint"], "request": request}
    stream = h.get("stream")
    if stream == "sse":
        payload["stream"] = parse_sse(response_bytes)
    elif stream == "json":
        payload["stream"] = parse_json_array_stream(response_bytes)
    else:
        payload["response"] = _json_or_text(response_bytes)
    payload["status"] = h["status"]
    payload["partial"] = h["partial"]
    if h.get("error"):
        payload["error"] = h["error"]
    return payload
