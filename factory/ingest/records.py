"""What goes into an ingest and what comes out: ``RawRecord``, ``IngestSummary``, and the
``Item`` each record travels as until its rows are written.

A record's id is the sha256 of its canonical JSON (``raw_trace_id_of``), so the same record
sent twice is one raw row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from factory.ingest.rows import SampleRow, id_and_text, id_of
from factory.normalize import detect_format
from factory.normalize import normalize_record as _normalize
from factory.normalize.canon import content_hash, sha256_hex

SOURCES = ("upload", "proxy", "otel")


@dataclass
class RawRecord:
    """One input record, as received."""

    payload: Any
    """The parsed JSON value (usually a dict); the raw text when ``parse_error`` is set."""
    source: str
    """Where it came from: ``upload``, ``proxy`` or ``otel``."""
    received_at: datetime
    """When the factory received it (UTC)."""
    tags: dict[str, str]
    """Free-form labels (``--tag k=v``), copied onto the samples."""
    project: str | None = None
    """The project the record belongs to, if the sender named one."""
    format_hint: str = "auto"
    """``auto`` to detect per record, or one of ``FORMATS`` to force it."""
    raw_trace_id: str | None = None
    """None: the sha256 of the canonical JSON of ``payload`` (so re-sent records dedupe)."""
    text: str | None = None
    """The JSON text as received, stored in ``raw_traces.payload`` when given."""
    parse_error: str | None = None
    """Why the text could not be parsed as JSON (the record is then rejected, not dropped)."""


@dataclass
class IngestSummary:
    """What one ingest did; ``read == ingested + rejected + duplicates``."""

    read: int = 0
    ingested: int = 0
    rejected: int = 0
    duplicates: int = 0
    num_samples: int = 0
    """Samples written (a record may hold several conversations)."""
    snapshots: dict[str, int] = field(default_factory=dict)
    """The last snapshot id this ingest committed to each table."""

    def as_dict(self) -> dict[str, int]:
        return {"read": self.read, "ingested": self.ingested, "rejected": self.rejected,
                "duplicates": self.duplicates}

    def add(self, other: IngestSummary) -> None:
        self.read += other.read
        self.ingested += other.ingested
        self.rejected += other.rejected
        self.duplicates += other.duplicates
        self.num_samples += other.num_samples
        self.snapshots.update(other.snapshots)


def normalize_record(payload: Any, format: str = "auto") -> list[dict[str, Any]]:
    """The canonical conversations of one record (pure); ``NormalizeError`` if it has none.

    Each is a dict with ``messages``, ``tools``, ``sample_id``, ``provider``, ``model``,
    ``created_at`` and ``blobs`` (decoded image bytes by sha256, for the blob store).
    """
    return _normalize(payload, format)


def raw_trace_id_of(payload: Any) -> str:
    """The content hash that identifies a record: sha256 of its sorted-key JSON."""
    return content_hash(payload)


@dataclass(frozen=True)
class FileContext:
    """What every record of an ingest of files shares."""

    source: str
    received_at: datetime
    tags: dict[str, str]
    project: str | None
    format_hint: str


class Item:
    """One record on its way to the tables: its id, text, format and (once known) outcome."""

    __slots__ = ("fmt", "line", "payload", "project", "received_at", "reason", "ref", "rid",
                 "rows", "source", "tags", "text")

    def __init__(self, rid: str, fmt: str, source: str, received_at: datetime,
                 tags: dict[str, str], project: str | None, *, text: str | None = None,
                 line: bytes | None = None, payload: Any = None, reason: str | None = None,
                 rows: list[SampleRow] | None = None,
                 ref: tuple[str | bytes, int, int] | None = None) -> None:
        self.rid = rid
        self.fmt = fmt
        self.source = source
        self.received_at = received_at
        self.tags = tags
        self.project = project
        self.text = text
        """The stored payload text; None: ``line`` decoded."""
        self.line = line
        self.payload = payload
        """The parsed record, when normalization is still to do (None: parse ``line``)."""
        self.reason = reason
        """Why it is rejected; None while accepted or not normalized yet."""
        self.rows = rows
        """Its sample rows; None (with no reason): not normalized yet."""
        self.ref = ref
        """Where its line is, when not given: (file path or block bytes, offset, length)."""

    def line_bytes(self) -> bytes:
        """The record's line, read from the file the first time it is needed."""
        if self.line is None:
            assert self.ref is not None, "an item has its text, its line or where its line is"
            source, offset, length = self.ref
            if isinstance(source, bytes):
                self.line = source[offset:offset + length]
            else:
                with open(source, "rb") as fh:
                    fh.seek(offset)
                    self.line = fh.read(length)
        return self.line

    def payload_text(self) -> str:
        if self.text is None:
            self.text = self.line_bytes().strip().decode("utf-8", "replace")
        return self.text


def item_of(rec: RawRecord) -> Item:
    """A record handed in by a caller; never raises. Normalized later, if not a duplicate."""
    tags = dict(rec.tags)
    if rec.parse_error is not None:
        text = rec.text if rec.text is not None else str(rec.payload)
        return Item(rec.raw_trace_id or sha256_hex(text), "unknown", rec.source,
                    rec.received_at, tags, rec.project, text=text, reason=rec.parse_error,
                    rows=[])
    if rec.text is not None:
        text = rec.text
        rid = rec.raw_trace_id or id_of(rec.payload, text)
    else:
        rid, text = id_and_text(rec.payload)
        rid = rec.raw_trace_id or rid
    fmt = rec.format_hint if rec.format_hint != "auto" else detect_format(rec.payload)
    return Item(rid, fmt or "unknown", rec.source, rec.received_at, tags, rec.project,
                text=text, payload=rec.payload)


CHUNK_RECORDS = 1000
"""Records normalized between two dedupe look-ups: small enough that their parsed payloads stay
in cache and memory, large enough that the vectorized prefix check is cheap per record."""


def item_chunks(records: Iterable[RawRecord]) -> Iterator[list[Item]]:
    """``records`` as items, ``CHUNK_RECORDS`` at a time (lazily: constant memory)."""
    chunk: list[Item] = []
    for rec in records:
        chunk.append(item_of(rec))
        if len(chunk) >= CHUNK_RECORDS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
