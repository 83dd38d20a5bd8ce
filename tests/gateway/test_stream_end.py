"""A client that hangs up right after a stream's last event leaves a complete capture.

The openai SDK closes the response as soon as it reads ``data: [DONE]``; when the upstream's end
of body reaches the gateway later than that (a loaded upstream process descheduled between its
last two writes), the gateway saw a client disconnect mid-relay and stored the capture as
partial, which ingest rejects: the deploy test then waited 120 s for a sample that never came.
The upstream here holds every response open after its last event until the gateway drops the
connection, so that ordering happens on every run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from factory.gateway import Gateway, ServerThread
from factory.gateway.asgi import acknowledge_lifespan
from factory.gateway.captures import stream_complete
from factory.ingest.rows import outcome
from tests.gateway.conftest import Collected, make_config
from tests.waiting import wait_until

_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}


def _sse(obj: Any, name: str | None = None) -> bytes:
    return (f"event: {name}\n".encode() if name else b"") + b"data: " + orjson.dumps(obj) + b"\n\n"


def _openai(*, done: bool) -> list[bytes]:
    deltas = [({"role": "assistant", "content": ""}, None), ({"content": "hi "}, None),
              ({"content": "there"}, None), ({}, "length")]
    events = [_sse({**_CHUNK, "choices": [{"index": 0, "delta": d, "finish_reason": f}]})
              for d, f in deltas]
    return events + [b"data: [DONE]\n\n"] if done else events


def _anthropic() -> list[bytes]:
    return [_sse({"type": "message_start", "message": {
                "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                "content": [], "stop_reason": None, "usage": {"input_tokens": 1,
                                                              "output_tokens": 0}}},
                 "message_start"),
            _sse({"type": "content_block_start", "index": 0,
                  "content_block": {"type": "text", "text": ""}}, "content_block_start"),
            _sse({"type": "content_block_delta", "index": 0,
                  "delta": {"type": "text_delta", "text": "hi there"}}, "content_block_delta"),
            _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            _sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                  "usage": {"output_tokens": 2}}, "message_delta"),
            _sse({"type": "message_stop"}, "message_stop")]


class _HoldingUpstream:
    """Streams ``events``, then keeps the body open until the gateway drops the connection."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.num_dropped = 0
        """Responses whose connection the gateway closed before their end of body."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await acknowledge_lifespan(receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        try:  # uvicorn answers receive() with http.disconnect once the gateway hangs up
            message = await asyncio.wait_for(receive(), timeout=10)
            self.num_dropped += message["type"] == "http.disconnect"
        except TimeoutError:
            pass
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture(scope="module")
def holding() -> Iterator[tuple[_HoldingUpstream, ServerThread]]:
    app = _HoldingUpstream()
    with ServerThread(app) as srv:
        yield app, srv


@pytest.fixture()
def relay(factory_home: Path, holding: tuple[_HoldingUpstream, ServerThread],
          collected: Collected) -> Iterator[tuple[_HoldingUpstream, ServerThread]]:
    app, upstream = holding
    app.num_dropped = 0
    gateway = Gateway(make_config(upstream, upstream_timeout_s=30), lake_factory=lambda: None,
                      ingest=collected)
    with ServerThread(gateway) as srv:
        yield app, srv


async def _read_until_then_hang_up(port: int, path: str, marker: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = orjson.dumps({"model": "m", "stream": True, "max_tokens": 8,
                         "messages": [{"role": "user", "content": "hi"}]})
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                 .encode() + body)
    await writer.drain()
    seen = await asyncio.wait_for(reader.readuntil(marker), timeout=20)
    writer.close()
    return seen


def _capture(collected: Collected) -> dict[str, Any]:
    wait_until(lambda: len(collected) == 1, what="the capture")
    payload: dict[str, Any] = collected[0].payload
    return payload


def test_the_openai_sdk_hanging_up_on_done_leaves_a_complete_capture(
        relay: tuple[_HoldingUpstream, ServerThread], collected: Collected) -> None:
    upstream, gateway = relay
    upstream.events = _openai(done=True)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test", max_retries=0,
                           timeout=20)
    stream: Any = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "hi there"
    payload = _capture(collected)
    assert upstream.num_dropped == 1  # the SDK hung up before the upstream's end of body
    assert payload["partial"] is False and "error" not in payload
    reason, rows = outcome(payload, "auto", None)
    assert reason is None and len(rows) == 1  # ingest makes it a sample, not a rejection


def test_a_client_hanging_up_after_message_stop_leaves_a_complete_capture(
        relay: tuple[_HoldingUpstream, ServerThread], collected: Collected) -> None:
    upstream, gateway = relay
    upstream.events = _anthropic()
    asyncio.run(_read_until_then_hang_up(gateway.port, "/v1/messages",
                                         b'{"type":"message_stop"}\n\n'))
    payload = _capture(collected)
    assert upstream.num_dropped == 1
    assert payload["partial"] is False and "error" not in payload
    assert outcome(payload, "auto", None)[0] is None


def test_a_client_hanging_up_before_the_end_marker_still_leaves_a_partial_capture(
        relay: tuple[_HoldingUpstream, ServerThread], collected: Collected) -> None:
    upstream, gateway = relay
    upstream.events = _openai(done=False)  # finish_reason sent, [DONE] not yet
    asyncio.run(_read_until_then_hang_up(gateway.port, "/v1/chat/completions",
                                         b'"finish_reason":"length"}]}\n\n'))
    payload = _capture(collected)
    assert payload["partial"] is True and payload["error"] == "client disconnected mid-stream"
    assert outcome(payload, "auto", None)[0] == "partial: the response ended early (stream cut off)"


@pytest.mark.parametrize(("kind", "data", "complete"), [
    ("sse", b"".join(_openai(done=True)), True),
    ("sse", b"".join(_openai(done=True)).replace(b"\n", b"\r\n"), True),
    ("sse", b"".join(_openai(done=True)) + b"\n", True),
    ("sse", b"".join(_openai(done=False)), False),
    ("sse", b"".join(_openai(done=True))[:-1], False),  # [DONE] not yet dispatched
    ("sse", b"".join(_openai(done=True))[:-4], False),  # "data: [DO"
    ("sse", b"".join(_anthropic()), True),
    ("sse", b"".join(_anthropic()[:-1]), False),
    ("sse", b"data: " + orjson.dumps({"type": "message_stop"}) + b"\n\n", True),
    ("sse", b"x" * 5000 + b"\n\n" + b"data: [DONE]\n\n", True),
    # A long last event whose cut tail happens to start like the end marker.
    ("sse", b'data: {"t": "' + b"x" * 5000 + b'data: [DONE]"}\n\n', False),
    ("sse", b"", False),
    ("json", b'[{"candidates": []},\r\n{"candidates": []}]', True),
    ("json", b'[{"candidates": [{"content": {"parts": []}}]', False),
    (None, b"data: [DONE]\n\n", False),
])
def test_stream_complete_sees_only_a_dispatched_end_marker(kind: str | None, data: bytes,
                                                          complete: bool) -> None:
    assert stream_complete(kind, data) is complete
