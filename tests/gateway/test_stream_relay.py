"""Streamed relay: the incremental chunked decoder, and coalescing of what is already read."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.gateway import Gateway, GatewayConfig, ServerThread
from factory.gateway.upstream import ChunkedDecoder
from tests.gateway.conftest import Collected
from tests.waiting import wait_until


def _frame(pieces: list[bytes], *, ext: bool = False, trailer: bool = False) -> bytes:
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(p), b";x=y" if ext else b"", p) for p in pieces)
    return out + b"0\r\n" + (b"x-t: 1\r\n" if trailer else b"") + b"\r\n"


def _decode(wire: bytes, cuts: list[int]) -> tuple[bytes, ChunkedDecoder]:
    decoder = ChunkedDecoder()
    out = []
    last = 0
    for cut in [*sorted(cuts), len(wire)]:
        out.append(decoder.feed(wire[last:cut]))
        last = cut
    return b"".join(out), decoder


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(min_size=1, max_size=40), max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=20),
       ext=st.booleans(), trailer=st.booleans())
def test_decoder_gives_the_body_however_the_wire_is_cut(pieces: list[bytes], cuts: list[int],
                                                       ext: bool, trailer: bool) -> None:
    wire = _frame(pieces, ext=ext, trailer=trailer)
    body, decoder = _decode(wire, [c for c in cuts if c <= len(wire)])
    assert body == b"".join(pieces)
    assert decoder.done and decoder.extra == b""


def test_decoder_waits_for_the_end_and_keeps_extra_bytes() -> None:
    wire = _frame([b"hello", b" world"])
    body, decoder = _decode(wire[:-1], [3, 9])
    assert body == b"hello world" and not decoder.done
    assert decoder.feed(b"\nNEXT") == b"" and decoder.done and decoder.extra == b"NEXT"


@pytest.mark.parametrize("wire", [b"zz\r\nab\r\n", b"-1\r\n", b"2\r\nabXY0\r\n\r\n",
                                  b"1" * 9000])
def test_decoder_refuses_bad_framing(wire: bytes) -> None:
    with pytest.raises(ValueError):
        ChunkedDecoder().feed(wire)


class _BurstUpstream:
    """Answers a streaming call with ``num_events`` SSE events, all written in one go."""

    def __init__(self, num_events: int) -> None:
        self.num_events = num_events
        self.events = [b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {
            "content": f"w{i} "}}]}) + b"\n\n" for i in range(num_events)]
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n" + _frame(self.events))
        await writer.drain()
        writer.close()

    def serve(self) -> None:
        self.loop.run_forever()


@pytest.fixture()
def burst() -> Iterator[_BurstUpstream]:
    import threading

    up = _BurstUpstream(60)
    thread = threading.Thread(target=up.serve, daemon=True)
    thread.start()
    yield up
    up.loop.call_soon_threadsafe(up.loop.stop)
    thread.join(5)


def test_a_burst_of_upstream_chunks_is_relayed_in_few_sends(factory_home: Path,
                                                           burst: _BurstUpstream) -> None:
    collected = Collected()
    config = GatewayConfig(port=0, openai_base_url=f"http://127.0.0.1:{burst.port}/v1",
                           flush_interval_s=0.05, segment_max_age_s=0.05)
    app = Gateway(config, lake_factory=lambda: None, ingest=collected)

    async def client(port: int) -> list[bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = orjson.dumps({"model": "m", "stream": True,
                             "messages": [{"role": "user", "content": "hi"}]})
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await reader.readuntil(b"\r\n\r\n")
        frames = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            frames.append(await reader.readexactly(size))
            await reader.readexactly(2)
        writer.close()
        return frames

    with ServerThread(app) as srv:
        frames = asyncio.run(client(srv.port))
        wait_until(lambda: len(collected) == 1, what="the capture")
    assert b"".join(frames) == b"".join(burst.events)
    # One upstream write of 60 chunks reaches the gateway in one or a few reads; each read is
    # relayed as one frame, not 60 (what the client sees is never merged after the fact).
    assert len(frames) <= 5, len(frames)
    stream = collected[0].payload["stream"]
    assert [e["choices"][0]["delta"]["content"] for e in stream] == [f"w{i} " for i in range(60)]
    assert collected[0].payload["partial"] is False

