"""An OpenAI-compatible upstream that answers with recorded responses (the demo's "frontier").

The demo has no network: the traffic it sends through the gateway must still come back with
frontier-quality answers. ``ReplayUpstream(records)`` serves ``/v1/chat/completions`` from
``{"request", "response"}`` records (those of ``factory.tasks.generate_records``): a request
whose messages equal a record's gets that record's response (the reference answer), streamed
as SSE chunks when asked. A request it has no record for gets a 404 in OpenAI's error shape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from factory.gateway.asgi import (
    SSE_HEADERS,
    ClientGone,
    Receive,
    Scope,
    Send,
    acknowledge_lifespan,
    read_body,
    reply,
)


def _key(messages: Any) -> bytes:
    return orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)


class ReplayUpstream:
    """ASGI app answering recorded requests with their recorded responses."""

    def __init__(self, records: Iterable[Mapping[str, Any]]) -> None:
        self.answers: dict[bytes, dict[str, Any]] = {}
        for record in records:
            self.answers[_key(record["request"]["messages"])] = dict(record["response"])
        self.num_requests = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await acknowledge_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        self.num_requests += 1
        if scope["method"] != "POST" or scope["path"] != "/v1/chat/completions":
            await reply(send, 404, _error(f"no route {scope['method']} {scope['path']}"))
            return
        try:
            body = orjson.loads(raw or b"{}")
        except orjson.JSONDecodeError:
            await reply(send, 400, _error("body is not JSON"))
            return
        answer = self.answers.get(_key(body.get("messages")))
        if answer is None:
            await reply(send, 404, _error("the replay upstream has no recorded answer for "
                                          "these messages"))
            return
        answer = {**answer, "model": body.get("model", answer.get("model"))}
        if body.get("stream") is not True:
            await reply(send, 200, orjson.dumps(answer))
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for piece in _sse(answer, include_usage=bool(
                (body.get("stream_options") or {}).get("include_usage"))):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _sse(answer: dict[str, Any], *, include_usage: bool) -> list[bytes]:
    content = answer["choices"][0]["message"].get("content") or ""
    base = {"id": answer.get("id", "chatcmpl-replay"), "object": "chat.completion.chunk",
            "created": answer.get("created", int(time.time())), "model": answer.get("model")}

    def event(obj: Any) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    pieces = [content[i:i + 16] for i in range(0, len(content), 16)] or [""]
    out = [event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]})]
    out += [event({**base, "choices": [{"index": 0, "delta": {"content": p},
                                        "finish_reason": None}]}) for p in pieces]
    out.append(event({**base, "choices": [{"index": 0, "delta": {},
                                           "finish_reason": answer["choices"][0].get(
                                               "finish_reason", "stop")}]}))
    if include_usage and answer.get("usage"):
        out.append(event({**base, "choices": [], "usage": answer["usage"]}))
    out.append(b"data: [DONE]\n\n")
    return out


def _error(message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": None}})
