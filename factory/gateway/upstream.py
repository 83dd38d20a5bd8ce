"""A small keep-alive HTTP/1.1 client for upstream calls (plain TCP or TLS).

Why not httpx: under 64 concurrent requests its connection pool (httpcore) spent 54 of 82 s of
CPU scanning connections (quadratic), capping the gateway at ~40 requests/s. This client keeps
idle connections per origin in a list (O(1) checkout), writes the request in one call and frames
the response by ``Content-Length``, chunked encoding, or connection close; streamed bodies are
yielded chunk by chunk as they arrive.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class UpstreamError(Exception):
    """The upstream could not be reached or broke the protocol (the client gets a 502)."""


class UpstreamTimeout(UpstreamError):
    """The upstream sent nothing for longer than the timeout (the client gets a 504)."""


_Origin = tuple[str, str, int]


class UpstreamResponse:
    """Status and headers; the body is read once with ``read()`` or ``chunks()``."""

    def __init__(self, pool: UpstreamPool, origin: _Origin, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, status: int,
                 headers: list[tuple[bytes, bytes]], *, length: int, chunked: bool,
                 keep_alive: bool) -> None:
        self._pool, self._origin = pool, origin
        self._reader, self._writer = reader, writer
        self.status = status
        self.headers = headers
        """Header (lower-case name, value) pairs as received."""
        self._length, self._chunked, self._keep_alive = length, chunked, keep_alive
        self._done = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        reader, timeout = self._reader, self._pool.timeout_s
        try:
            if self._chunked:
                while True:
                    async with asyncio.timeout(timeout):
                        line = await reader.readline()
                        size = int(line.split(b";", 1)[0], 16)
                        if size == 0:
                            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            break
                        data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._length >= 0:
                remaining = self._length
                while remaining > 0:
                    async with asyncio.timeout(timeout):
                        data = await reader.read(min(remaining, 1 << 20))
                    if not data:
                        raise UpstreamError("upstream closed the connection mid-body")
                    remaining -= len(data)
                    yield data
            else:
                while True:
                    async with asyncio.timeout(timeout):
                        data = await reader.read(1 << 16)
                    if not data:
                        break
                    yield data
                self._keep_alive = False
        except TimeoutError:
            self.close()
            raise UpstreamTimeout("upstream stopped sending") from None
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            self.close()
            raise UpstreamError(f"upstream broke the response: {type(exc).__name__}") from None
        self._done = True
        self.release()

    def release(self) -> None:
        """Return the connection to the pool if the body was fully read, else close it."""
        if self._writer is None:
            return
        if self._done and self._keep_alive:
            self._pool._idle.setdefault(self._origin, []).append((self._reader, self._writer))
            self._writer = None  # type: ignore[assignment]
        else:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None  # type: ignore[assignment]


class UpstreamPool:
    """Keep-alive connections per origin, shared by every request of the gateway."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float,
                 max_idle_per_origin: int = 512) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_origin
        self._idle: dict[_Origin, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._split: dict[str, tuple[_Origin, str]] = {}

    def _parse(self, url: str) -> tuple[_Origin, bytes]:
        base, _, query = url.partition("?")
        cached = self._split.get(base)
        if cached is None:
            parts = urlsplit(base)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamError(f"bad upstream URL {base!r}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            cached = ((parts.scheme, parts.hostname, port), parts.path or "/")
            if len(self._split) < 10_000:
                self._split[base] = cached
        origin, path = cached
        target = f"{path}?{query}" if query else path
        return origin, target.encode("latin-1")

    async def _connect(self, origin: _Origin) -> tuple[asyncio.StreamReader,
                                                       asyncio.StreamWriter]:
        scheme, host, port = origin
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                return await asyncio.open_connection(
                    host, port, ssl=context, server_hostname=host if context else None,
                    limit=1 << 20)
        except TimeoutError:
            raise UpstreamError(f"could not connect to {host}:{port} within "
                                f"{self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise UpstreamError(f"could not connect to {host}:{port}: "
                                f"{exc.strerror or type(exc).__name__}") from None

    async def request(self, method: str, url: str, headers: list[tuple[bytes, bytes]],
                      body: bytes = b"") -> UpstreamResponse:
        origin, target = self._parse(url)
        scheme, host, port = origin
        default_port = 443 if scheme == "https" else 80
        host_header = host if port == default_port else f"{host}:{port}"
        head = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", host_header.encode()]
        for key, value in headers:
            head += [b"\r\n", key, b": ", value]
        if body or method == "POST":
            head += [b"\r\ncontent-length: ", str(len(body)).encode()]
        head.append(b"\r\n\r\n")
        raw = b"".join(head) + body
        idle = self._idle.get(origin)
        while idle:
            reader, writer = idle.pop()
            if writer.is_closing() or reader.at_eof():
                writer.close()
                continue
            try:
                return await self._exchange(origin, reader, writer, raw, method)
            except _StaleConnection:
                writer.close()  # the server closed an idle connection: try another/new one
        reader, writer = await self._connect(origin)
        try:
            return await self._exchange(origin, reader, writer, raw, method)
        except _StaleConnection:
            writer.close()
            raise UpstreamError("upstream closed the connection without answering") from None

    async def _exchange(self, origin: _Origin, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, raw: bytes,
                        method: str) -> UpstreamResponse:
        try:
            writer.write(raw)
            async with asyncio.timeout(self.timeout_s):
                status_line = await reader.readline()
                if not status_line:
                    raise _StaleConnection
                try:
                    status = int(status_line.split(b" ", 2)[1])
                except (IndexError, ValueError):
                    raise UpstreamError(f"upstream sent a bad status line "
                                        f"{status_line[:80]!r}") from None
                headers: list[tuple[bytes, bytes]] = []
                length, chunked, keep_alive = -1, False, True
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b"\n"):
                        break
                    if not line:
                        raise UpstreamError("upstream closed the connection mid-headers")
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    value = value.strip()
                    headers.append((name, value))
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"transfer-encoding":
                        chunked = b"chunked" in value.lower()
                    elif name == b"connection" and b"close" in value.lower():
                        keep_alive = False
        except TimeoutError:
            writer.close()
            raise UpstreamTimeout(f"upstream did not answer within {self.timeout_s:g}s") \
                from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _StaleConnection from exc
        except (OSError, ValueError) as exc:
            writer.close()
            raise UpstreamError(f"upstream failed: {type(exc).__name__}") from None
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            length, chunked = 0, False
        response = UpstreamResponse(self, origin, reader, writer, status, headers,
                                    length=length, chunked=chunked, keep_alive=keep_alive)
        if length == 0 and not chunked:
            response._done = True
            response.release()
        return response

    def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()


class _StaleConnection(Exception):
    pass
