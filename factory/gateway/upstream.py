"""A small keep-alive HTTP/1.1 client for upstream calls (plain TCP or TLS).

Why not httpx: under 64 concurrent requests its connection pool (httpcore) spent 54 of 82 s of
CPU scanning connections (quadratic), capping the gateway at ~40 requests/s. This client keeps
idle connections per origin in a list (O(1) checkout), writes the request in one call and frames
the response by ``Content-Length``, chunked encoding, or connection close; streamed bodies are
yielded as they arrive.

A streamed body is read in whatever pieces the socket has ready, never waiting for more: one
``read()`` that returns the 40 SSE events an upstream wrote back to back is decoded and yielded
as one piece (relayed with one ``send``), instead of one read, one timeout and one send per
upstream chunk, which cost ~0.1 ms of CPU each.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

_READ_SIZE = 1 << 16
_MAX_LINE = 8192


class ChunkedDecoder:
    """Incremental decoder of HTTP/1.1 chunked transfer coding.

    ``feed(data)`` takes bytes as they came off the socket and returns the body bytes they
    complete, across any number of chunks (a chunk cut between two reads is returned in two
    parts); framing cut between reads waits in a small buffer. ``done`` turns true after the last
    chunk and its trailers; ``extra`` keeps whatever followed them. Bad framing is a ValueError.
    """

    _SIZE, _DATA, _CRLF, _TRAILER = range(4)

    def __init__(self) -> None:
        self._state = self._SIZE
        self._remaining = 0
        self._pending = b""
        self.done = False
        """The terminating chunk and the trailers were read."""
        self.extra = b""
        """Bytes received after the end of the body."""

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.extra += data
            return b""
        if self._pending:
            data = self._pending + data
            self._pending = b""
        out: list[bytes] = []
        pos, end = 0, len(data)
        state = self._state
        while pos < end:
            if state == self._DATA:
                take = min(self._remaining, end - pos)
                out.append(data[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    state = self._CRLF
            elif state == self._CRLF:
                if data[pos] == 10:  # a bare LF, tolerated like most clients do
                    pos += 1
                elif end - pos < 2:
                    break
                elif data[pos:pos + 2] == b"\r\n":
                    pos += 2
                else:
                    raise ValueError("chunk data not followed by CRLF")
                state = self._SIZE
            else:
                eol = data.find(b"\n", pos)
                if eol < 0:
                    if end - pos > _MAX_LINE:
                        raise ValueError("chunk size or trailer line too long")
                    break
                line = data[pos:eol]
                pos = eol + 1
                if state == self._TRAILER:
                    if line in (b"", b"\r"):
                        self.done = True
                        self.extra = data[pos:]
                        pos = end
                    continue
                size = int(line.split(b";", 1)[0], 16)  # int() strips the CR and blanks
                if size < 0:
                    raise ValueError(f"negative chunk size {size}")
                if size:
                    state, self._remaining = self._DATA, size
                else:
                    state = self._TRAILER
        self._state = state
        if pos < end:
            self._pending = data[pos:]
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)


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
                decoder = ChunkedDecoder()
                while not decoder.done:
                    async with asyncio.timeout(timeout):
                        data = await reader.read(_READ_SIZE)
                    if not data:
                        raise UpstreamError("upstream closed the connection mid-body")
                    payload = decoder.feed(data)
                    if payload:
                        yield payload
                if decoder.extra:
                    self._keep_alive = False  # bytes past the body: the connection is unusable
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
                        data = await reader.read(_READ_SIZE)
                    if not data:
                        break
                    yield data
                self._keep_alive = False
        except UpstreamError:
            self.close()
            raise
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
