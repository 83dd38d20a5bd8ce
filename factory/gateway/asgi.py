"""Plain ASGI, shared by the gateway and the small apps beside it (the stand-in and replay
upstreams): the callable types, reading a request body, answering with bytes, and the lifespan
handshake. No router or request objects: the gateway's hot path pays for none."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class BodyTooLarge(Exception):
    """The request body is over the limit (as declared, or as it arrived)."""


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


async def read_body(receive: Receive, *, limit: int | None = None,
                    declared: bytes | None = None) -> bytes:
    """The whole request body. ``declared``: its ``content-length`` header, refused at once
    when over ``limit``; raises ``BodyTooLarge`` or ``ClientGone``."""
    if limit is not None and declared is not None:
        try:
            if int(declared) > limit:
                raise BodyTooLarge
        except ValueError:
            raise BodyTooLarge from None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def reply(send: Send, status: int, body: bytes,
                headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A whole response: ``body`` with its length (JSON unless ``headers`` say otherwise)."""
    out = list(headers or JSON_HEADERS)
    out.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


async def acknowledge_lifespan(receive: Receive, send: Send) -> None:
    """Answer ASGI startup and shutdown for an app with nothing to start or stop."""
    while True:
        message = await receive()
        kind = message["type"].replace("lifespan.", "")
        await send({"type": f"lifespan.{kind}.complete"})
        if kind == "shutdown":
            return
