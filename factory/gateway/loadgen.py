"""A minimal keep-alive HTTP/1.1 load generator for the gateway's load tests and benchmark.

Python HTTP clients spend 0.3-1 ms of CPU per request, which on a small machine would measure the
client rather than the gateway; this one writes pre-built request bytes on persistent asyncio
connections and parses only the status line, ``Content-Length`` and chunked framing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Result:
    """One request's outcome (status 0: the connection failed)."""

    index: int
    status: int
    seconds: float
    ttfb_seconds: float
    body: bytes


def build_request(host: str, port: int, path: str, body: bytes,
                  headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Connection:
    """One persistent connection; ``request`` sends bytes and reads one full response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None

    async def request(self, raw: bytes) -> tuple[int, float, bytes]:
        """(status, seconds to first response byte, body); raises OSError on a broken link."""
        if self.writer is None:
            await self._open()
        assert self.reader is not None and self.writer is not None
        started = time.perf_counter()
        self.writer.write(raw)
        status_line = await self.reader.readline()
        ttfb = time.perf_counter() - started
        if not status_line:
            await self.close()
            raise ConnectionResetError("connection closed before a response")
        status = int(status_line.split(b" ", 2)[1])
        length, chunked, close = -1, False, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                parts.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            body = b"".join(parts)
        elif length >= 0:
            body = await self.reader.readexactly(length)
        else:
            body = await self.reader.read()
            close = True
        if close:
            await self.close()
        return status, ttfb, body


async def run_load(url: str, requests: list[tuple[str, bytes]], *, concurrency: int,
                   headers: dict[str, str] | None = None, keep_bodies: bool = False,
                   on_result: Callable[[Result], None] | None = None,
                   retry_connect_s: float = 0.0) -> list[Result]:
    """Send ``(path, body)`` requests over ``concurrency`` connections; results in input order.

    A failed connection gives status 0 for that request (not retried: the caller decides).
    With ``retry_connect_s``, a worker whose connection failed waits that long before
    reconnecting (the gateway may be restarting).
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    results: list[Result | None] = [None] * len(requests)
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        conn = Connection(host, port)
        while next_index < len(requests):
            i = next_index
            next_index += 1
            path, body = requests[i]
            started = time.perf_counter()
            try:
                status, ttfb, data = await conn.request(build_request(host, port, path, body,
                                                                      headers))
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                await conn.close()
                status, ttfb, data = 0, 0.0, b""
                if retry_connect_s:
                    await asyncio.sleep(retry_connect_s)
            result = Result(i, status, time.perf_counter() - started, ttfb,
                            data if keep_bodies else b"")
            results[i] = result
            if on_result is not None:
                on_result(result)
        await conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]
