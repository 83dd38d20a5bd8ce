"""Reading input files: the records of a ``.json`` file, and the blocks of a JSON Lines file.

A ``.jsonl`` line is a record and a ``.json`` file is a record or an array of records, either
maybe gzipped (``.gz``). ``read_file`` streams any of them as ``RawRecord``s; ``line_blocks``
cuts a JSON Lines file into blocks of whole lines (``BlockTask``) for the worker processes.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from factory.ingest.records import RawRecord
from factory.ingest.rows import first_line, parse_json
from factory.normalize import FORMATS, NormalizeError
from factory.normalize.otlp import is_otlp_export, split_otlp_json

FILE_SUFFIXES = (".jsonl", ".json", ".gz")


def iter_files(paths: Iterable[str | Path]) -> Iterator[Path]:
    """Every ingestible file under ``paths`` (folders recursively, sorted); ValueError if none."""
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise ValueError(f"no such file or folder: {path}")
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file()
                              and p.name.endswith(FILE_SUFFIXES) and not p.name.startswith("."))
        else:
            yield path


def _open_text(path: Path) -> IO[str]:
    # utf-8-sig: a byte order mark at the start is dropped, not read as part of the JSON.
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig",
                                errors="surrogateescape")
    return open(path, encoding="utf-8-sig", errors="surrogateescape")


def _open_binary(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _kind_of(path: Path, fh: IO[str]) -> str:
    """``jsonl`` or ``json`` for a file: by suffix, sniffing a bare ``.gz``."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    return "sniff"


def read_file(path: Path, *, source: str = "upload", tags: Mapping[str, str] | None = None,
              format_hint: str = "auto", project: str | None = None,
              on_bytes: Callable[[int], None] | None = None) -> Iterator[RawRecord]:
    """Stream the records of one file in constant memory.

    A ``.jsonl`` line is a record; a ``.json`` file is a record or an array of records (read
    element by element); an OTLP export is split per trace. A line that is not JSON becomes a
    record that will be rejected with the line number, never a crash.
    """
    if format_hint != "auto" and format_hint not in FORMATS:
        raise ValueError(f"unknown format {format_hint!r}; expected auto or one of "
                         f"{', '.join(FORMATS)}")
    tags = dict(tags or {})
    now = datetime.now(tz=UTC)

    def make(value: Any, text: str | None, error: str | None = None) -> Iterator[RawRecord]:
        if error is None and is_otlp_export(value):
            try:
                traces = split_otlp_json(value)
            except NormalizeError as exc:
                error = f"{path.name}: OTLP export: {exc.reason}"
            else:
                for trace in traces:
                    yield RawRecord(payload=trace, source=source, received_at=now, tags=tags,
                                    project=project, format_hint="otlp")
                return
        yield RawRecord(payload=value if error is None else text, source=source,
                        received_at=now, tags=tags, project=project, format_hint=format_hint,
                        text=text, parse_error=error)

    with _open_text(path) as fh:
        kind = _kind_of(path, fh)
        first = _peek_nonspace(fh)
        if kind == "sniff":
            kind = "json" if first == "[" else "jsonl"
        if kind == "json" and first == "[":
            yield from _iter_json_array(path, fh, make, on_bytes)
            return
        if kind == "json":
            text = fh.read()
            if on_bytes:
                on_bytes(len(text.encode("utf-8", "surrogateescape")))
            try:
                value = parse_json(text)
            except ValueError as exc:
                yield from make(None, text, f"{path.name}: invalid JSON ({exc})")
                return
            yield from make(value, text)
            return
    # JSON Lines are read as bytes: orjson parses bytes directly, and the text is decoded once.
    with _open_binary(path) as bfh:
        for lineno, line in enumerate(bfh, start=1):
            if on_bytes:
                on_bytes(len(line))
            if lineno == 1 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8):]
            stripped = line.strip()
            if not stripped:
                continue
            text = stripped.decode("utf-8", "replace")
            try:
                value = parse_json(stripped)
            except (ValueError, RecursionError) as exc:
                yield from make(None, text,
                                f"{path.name}:{lineno}: invalid JSON ({first_line(exc)})")
                continue
            if is_otlp_export(value):
                yield from make(value, text)
            else:  # the common case, without a generator per line
                yield RawRecord(payload=value, source=source, received_at=now, tags=tags,
                                project=project, format_hint=format_hint, text=text)


def _peek_nonspace(fh: IO[str]) -> str:
    """The first non-whitespace character, leaving the stream at the start."""
    pos = fh.tell()
    while True:
        chunk = fh.read(4096)
        if not chunk:
            fh.seek(pos)
            return ""
        stripped = chunk.lstrip()
        if stripped:
            fh.seek(pos)
            return stripped[0]


_CHUNK = 1 << 20


def _iter_json_array(path: Path, fh: IO[str], make: Callable[..., Iterator[RawRecord]],
                     on_bytes: Callable[[int], None] | None) -> Iterator[RawRecord]:
    """The elements of a top-level JSON array, decoded one by one from a sliding buffer."""
    decoder = json.JSONDecoder()
    buf = fh.read(_CHUNK)
    if on_bytes:
        on_bytes(len(buf))
    pos = buf.index("[") + 1
    eof = False
    index = 0

    def refill() -> None:
        """The rest of the buffer from ``pos``, and the next chunk of the file."""
        nonlocal buf, pos, eof
        more = fh.read(_CHUNK)
        eof = not more
        if on_bytes:
            on_bytes(len(more))
        buf, pos = buf[pos:] + more, 0

    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf) and not eof:
            refill()
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos >= len(buf):
            yield from make(None, "", f"{path.name}: JSON array is not closed")
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            if not eof:
                refill()
                continue
            yield from make(None, buf[pos:pos + 10000],
                            f"{path.name}: element {index}: invalid JSON ({exc.msg})")
            return
        # An element that ends exactly at the buffer edge may be a truncated number: re-read.
        if end >= len(buf) and not eof:
            refill()
            continue
        yield from make(value, buf[pos:end])
        index += 1
        pos = end
        if pos > _CHUNK:
            buf, pos = buf[pos:], 0


# The smallest block of lines handed to a worker: big enough that the inter-process hop is a
# small part of its cost. Large files get larger blocks (fewer, larger data files) up to
# _MAX_BLOCK_BYTES, while every worker still gets several blocks. Past 8 MiB a worker's CPU
# per record grows (its block, lines and rows no longer stay in cache): per 200k bench
# records, 10.0 CPU-s in 8 MiB blocks, 10.8 in 16 MiB, 11.3-12.7 in 32 MiB; 10.4-10.6 in 4.
_BLOCK_BYTES = 4 << 20
_MAX_BLOCK_BYTES = 8 << 20


def block_size(num_bytes: int, workers: int) -> int:
    return max(_BLOCK_BYTES, min(_MAX_BLOCK_BYTES, num_bytes // (4 * workers)))


def file_kind(path: Path) -> str:
    """``jsonl`` for JSON Lines (by name; a bare ``.gz`` by its first character), else ``json``."""
    with _open_text(path) as fh:
        kind = _kind_of(path, fh)
        if kind == "sniff":
            kind = "json" if _peek_nonspace(fh) == "[" else "jsonl"
    return kind


def line_blocks(path: Path, block_bytes: int,
                 on_bytes: Callable[[int], None] | None) -> Iterator[BlockTask]:
    """Blocks of whole lines of a JSON Lines file, about ``block_bytes`` each.

    A plain file's blocks are byte ranges the worker reads itself: this process only reads a
    little past each cut to find the end of the line there (the lines are numbered from the
    newline counts the workers report, and progress is reported as their results come back).
    A compressed file's blocks carry their bytes.
    """
    if path.name.endswith(".gz"):
        yield from _gz_blocks(path, block_bytes, on_bytes)
        return
    size = path.stat().st_size
    pos = 0
    with open(path, "rb") as fh:
        while pos < size:
            end = min(pos + block_bytes, size)
            if end < size:
                fh.seek(end - 1)
                while True:  # to the end of the line the cut falls in
                    piece = fh.read(1 << 16)
                    if not piece:
                        end = size
                        break
                    newline = piece.find(b"\n")
                    if newline >= 0:
                        end += newline
                        break
                    end += len(piece)
                end = min(end, size)
            yield BlockTask(name=path.name, path=str(path), start=pos, end=end)
            pos = end


def _gz_blocks(path: Path, block_bytes: int,
               on_bytes: Callable[[int], None] | None) -> Iterator[BlockTask]:
    """Blocks of whole lines of a compressed JSON Lines file, with their bytes."""
    pos = 0
    rest = b""
    with _open_binary(path) as fh:
        while True:
            data = fh.read(block_bytes)
            if on_bytes and data:
                on_bytes(len(data))
            if not data:
                if rest:
                    yield BlockTask(name=path.name, path=str(path), start=pos,
                                    end=pos + len(rest), data=rest)
                return
            cut = data.rfind(b"\n")
            if cut < 0:  # one line longer than a block: keep reading until it ends
                rest += data
                continue
            block, rest = rest + data[:cut + 1], data[cut + 1:]
            yield BlockTask(name=path.name, path=str(path), start=pos, end=pos + len(block),
                            data=block)
            pos += len(block)


@dataclass(frozen=True)
class BlockTask:
    """Whole lines of a JSON Lines file: a byte range of the file, or the bytes themselves."""

    name: str
    """The file's name, for rejection reasons."""
    path: str
    """The file."""
    start: int
    """Where the block starts in the file (decompressed, for ``.gz``)."""
    end: int
    data: bytes | None = None
    """The block itself, when the file cannot be read at an offset (``.gz``); else a worker
    reads ``start:end`` of ``path`` itself."""
    locations: dict[str, str] = field(default_factory=dict)
    """Where to write each table's data file (``Lake.new_data_locations``)."""

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        with open(self.path, "rb") as fh:
            fh.seek(self.start)
            data = fh.read(self.end - self.start)
        if len(data) != self.end - self.start:
            raise OSError(f"{self.path}: file shrank while it was being ingested")
        return data
