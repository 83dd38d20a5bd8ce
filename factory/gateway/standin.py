"""A stand-in provider upstream for offline demos, tests and benchmarks.

It speaks just enough of the OpenAI, Anthropic and Gemini REST APIs for their SDKs: it answers at
once with ``"echo: <last user text>"``, streamed word by word when asked. A few model names
trigger behaviours tests need: ``error-429`` answers a rate-limit error, ``slow`` waits
``slow_s`` before answering, ``slow-stream`` waits ``slow_s / 10`` between streamed chunks.
``python -m factory.gateway.standin --port P`` runs it on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any
from urllib.parse import parse_qsl

import orjson

from factory.gateway.asgi import (
    JSON_HEADERS,
    SSE_HEADERS,
    ClientGone,
    Receive,
    Scope,
    Send,
    acknowledge_lifespan,
    read_body,
    reply,
)
from factory.gateway.server import _uvicorn_config, bind


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict)
                        and isinstance(p.get("text"), str))
    return ""


def _last_user_text(provider: str, body: dict[str, Any]) -> str:
    if provider == "gemini":
        for turn in reversed(body.get("contents") or []):
            if isinstance(turn, dict) and turn.get("role", "user") == "user":
                return _text_of(turn.get("parts"))
        return ""
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return _text_of(message.get("content"))
    return ""


class StandIn:
    """The ASGI app. ``seen_auth`` keeps the auth headers of the last call (for key tests)."""

    def __init__(self, *, slow_s: float = 5.0) -> None:
        self.slow_s = slow_s
        self.num_requests = 0
        self.seen_auth: dict[str, str] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await acknowledge_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.num_requests += 1
        headers = dict(scope["headers"])
        self.seen_auth = {k.decode(): v.decode() for k, v in headers.items()
                          if k in (b"authorization", b"x-api-key", b"x-goog-api-key")}
        query = dict(parse_qsl(scope["query_string"].decode()))
        if "key" in query:
            self.seen_auth["key"] = query["key"]
        path = scope["path"]
        if scope["method"] == "GET" and path == "/v1/models":
            await reply(send, 200, orjson.dumps({"object": "list", "data": [
                {"id": "stand-in", "object": "model", "created": 0, "owned_by": "factory"}]}))
            return
        try:
            body = orjson.loads(await read_body(receive) or b"{}")
        except ClientGone:
            return
        if path == "/v1/chat/completions":
            provider, model = "openai", body.get("model", "")
        elif path == "/v1/messages":
            provider, model = "anthropic", body.get("model", "")
        elif path.startswith("/v1beta/models/"):
            provider = "gemini"
            model = path[len("/v1beta/models/"):].rpartition(":")[0]
        else:
            await reply(send, 404, b'{"error": {"message": "not found"}}')
            return
        if model == "error-429":
            await reply(send, 429, _error(provider))
            return
        if model == "slow":
            await asyncio.sleep(self.slow_s)
        text = "echo: " + _last_user_text(provider, body)
        stream = body.get("stream") is True or path.endswith(":streamGenerateContent")
        if not stream:
            await reply(send, 200, orjson.dumps(_answer(provider, model, text)))
            return
        delay = self.slow_s / 10 if model == "slow-stream" else 0.0
        sse = provider != "gemini" or query.get("alt") == "sse"
        await send({"type": "http.response.start", "status": 200,
                    "headers": SSE_HEADERS if sse else JSON_HEADERS})
        for i, piece in enumerate(_stream(provider, model, text, sse=sse)):
            if delay and i:
                await asyncio.sleep(delay)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error(provider: str) -> bytes:
    message = "rate limited by the stand-in"
    if provider == "anthropic":
        return orjson.dumps({"type": "error",
                             "error": {"type": "rate_limit_error", "message": message}})
    if provider == "gemini":
        return orjson.dumps({"error": {"code": 429, "message": message,
                                       "status": "RESOURCE_EXHAUSTED"}})
    return orjson.dumps({"error": {"message": message, "type": "rate_limit_error",
                                   "param": None, "code": "rate_limit_exceeded"}})


def _answer(provider: str, model: str, text: str) -> dict[str, Any]:
    if provider == "anthropic":
        return {"id": "msg_standin", "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
    if provider == "gemini":
        return {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]},
                                "finishReason": "STOP", "index": 0}],
                "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1,
                                  "totalTokenCount": 2}, "modelVersion": model}
    return {"id": "chatcmpl-standin", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]


def _stream(provider: str, model: str, text: str, *, sse: bool) -> list[bytes]:
    def event(obj: Any, name: str | None = None) -> bytes:
        head = f"event: {name}\n".encode() if name else b""
        return head + b"data: " + orjson.dumps(obj) + b"\n\n"

    words = _words(text)
    if provider == "anthropic":
        out = [event({"type": "message_start", "message": {
            "id": "msg_standin", "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 0}}}, "message_start"),
            event({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}, "content_block_start")]
        out += [event({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": w}}, "content_block_delta")
                for w in words]
        out += [event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                event({"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                          "stop_sequence": None},
                       "usage": {"output_tokens": len(words)}}, "message_delta"),
                event({"type": "message_stop"}, "message_stop")]
        return out
    if provider == "gemini":
        objs = [{"candidates": [{"content": {"role": "model", "parts": [{"text": w}]},
                                 "index": 0, **({"finishReason": "STOP"}
                                                if i == len(words) - 1 else {})}],
                 "modelVersion": model} for i, w in enumerate(words)]
        if sse:
            return [event(o) for o in objs]
        return [(b"[" if i == 0 else b",\r\n") + orjson.dumps(o) for i, o in enumerate(objs)] \
            + [b"]"]
    base = {"id": "chatcmpl-standin", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    out = [event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]})]
    out += [event({**base, "choices": [{"index": 0, "delta": {"content": w},
                                        "finish_reason": None}]}) for w in words]
    out += [event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            b"data: [DONE]\n\n"]
    return out


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--slow-s", type=float, default=5.0)
    args = parser.parse_args()
    sock = bind(args.host, args.port)
    print(f"stand-in upstream on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(_uvicorn_config(StandIn(slow_s=args.slow_s), host=args.host,
                                   port=args.port)).run(sockets=[sock])


if __name__ == "__main__":
    main()
