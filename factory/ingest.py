"""The ingest pipeline: raw records in, ``raw_traces`` first, then ``samples``/``rejected_traces``.

The gateway's proxy captures and OTLP traces hand ``ingest_records`` an iterable of
``RawRecord``; files (the CLI, the Dagster assets) go through ``ingest_paths``, which has JSON
Lines parsed, hashed and normalized by worker processes (``factory.normalize.rows``) and the
results merged back in file order. Either way records are processed in batches: each batch is
one commit per table (never one per record), raw rows before anything derived from them. A
record's id is the hash of its canonical JSON, so a record seen before is counted as a
duplicate and nothing is written for it: re-ingesting a file commits no snapshot at all.
"""

from __future__ import annotations

import codecs
import concurrent.futures
import dataclasses
import functools
import gc
import gzip
import io
import json
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from factory.blobs import BlobStore
from factory.datafiles import FileTarget
from factory.ingest_blocks import (
    TABLE_NAMES,
    BlockResult,
    BlockTask,
    FileContext,
    ingest_block,
    init_block_worker,
    repeat_value,
    worker_block,
    worker_context,
)
from factory.lake import FileDescriber, Lake, Lineage, stop_idle_reader_pool
from factory.normalize import FORMATS, NormalizeError, detect_format
from factory.normalize import normalize_record as _normalize
from factory.normalize.canon import content_hash, sha256_hex
from factory.normalize.otlp import is_otlp_export, split_otlp_json
from factory.normalize.rows import (
    SampleRow,
    digests,
    first_line,
    id_and_text,
    id_of,
    invalid_json_reason,
    known_mask,
    outcome,
    parse_json,
)
from factory.tables import schema_of

SOURCES = ("upload", "proxy", "otel")
FILE_SUFFIXES = (".jsonl", ".json", ".gz")


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


# -- dedupe --------------------------------------------------------------------------------------
class _KnownIds:
    """Which raw_trace_ids the lake already holds, and which of them still lack an outcome.

    Read once per ingest: every id in raw_traces as its 32-byte digest (``rows.digests``) in
    sorted numpy arrays, exact and a third of the memory of a set of strings; and, the first
    time a known id comes by, the "orphans": raw rows with no row in samples or
    rejected_traces (a crash between the raw and the derived commits), which are normalized
    again. Looking ids up is then a binary search in memory, where scanning the tables per
    chunk to confirm candidates made re-ingesting a file cost as much as ingesting it.
    """

    def __init__(self, lake: Lake, lineage: Lineage | None) -> None:
        self.lake = lake
        self.arrays: list[np.ndarray] = []
        """Sorted digests of the ids (several arrays, merged now and then)."""
        self.prefixes: list[np.ndarray] = []
        """The first 8 bytes of each of ``arrays`` as big-endian integers: as sorted (8 bytes
        more per id, for a search 4x faster than in the digests)."""
        self._orphans: set[bytes] | None = None
        """Digests of ids in raw_traces without an outcome yet (read when first needed)."""
        self._snap = lake.snapshot_id("raw_traces")
        if lineage is not None:
            lineage.record_read("raw_traces", self._snap)
        self._add(self._ids("raw_traces", self._snap))
        self._num_initial = sum(len(a) for a in self.arrays)

    def _read_orphans(self) -> set[bytes]:
        """The raw rows (as of the start) that have no row in samples or rejected_traces."""
        if self._orphans is None:
            self._orphans = set()
            if self._num_initial:
                done = [i for name in ("samples", "rejected_traces")
                        for i in self._ids(name, self.lake.snapshot_id(name))]
                done_keys = np.unique(digests(done))
                raw = np.sort(digests(self._ids("raw_traces", self._snap)))
                if len(done_keys):
                    pos = np.minimum(np.searchsorted(done_keys, raw), len(done_keys) - 1)
                    raw = raw[done_keys[pos] != raw]
                self._orphans = {bytes(k).ljust(32, b"\0") for k in raw}
        return self._orphans

    def _ids(self, name: str, snap: int | None) -> list[str]:
        if snap is None:
            return []
        scan = self.lake.table(name).scan(snapshot_id=snap, selected_fields=("raw_trace_id",))
        return [s for s in scan.to_arrow().column(0).to_pylist() if s]

    def _add(self, ids: list[str]) -> None:
        if not ids:
            return
        self.arrays.append(np.sort(digests(ids)))
        self.prefixes.append(_prefixes(self.arrays[-1]))
        # The arrays at least halve in size from first to last (a few dozen at most): the last
        # two are merged while the last is at least half the one before. Two sorted runs merge
        # in linear time (a stable sort finds them), so each id is merged about log2(n /
        # block) times, and a merge holds at most one more copy of the ids it merges.
        while len(self.arrays) > 1 and 2 * len(self.arrays[-1]) >= len(self.arrays[-2]):
            last = self.arrays.pop()
            merged = np.concatenate([self.arrays.pop(), last])
            del last
            self.prefixes[-2:] = []
            merged.sort(kind="stable")
            self.arrays.append(merged)
            self.prefixes.append(_prefixes(merged))

    def existing(self, ids: list[str]) -> set[str]:
        """The subset of ``ids`` already in raw_traces (or in a batch handed to the writer)."""
        if not ids or not self.arrays:
            return set()
        keys = digests(ids)
        # In order: numpy's binary search starts each key where the one before ended.
        wanted = _prefixes(keys)
        order = np.argsort(wanted)
        wanted = wanted[order]
        found = np.zeros(len(ids), dtype=bool)
        for arr, pre in zip(self.arrays, self.prefixes, strict=True):
            if not len(arr):
                continue
            # The 8-byte prefixes first (a search over integers, 4x faster than over 32-byte
            # strings), then the few ids whose prefix is there, in full.
            pos = np.minimum(np.searchsorted(pre, wanted), len(pre) - 1)
            maybe = order[pre[pos] == wanted]
            if len(maybe):
                found[maybe] |= known_mask([ids[i] for i in maybe.tolist()], [arr])
        return {i for i, f in zip(ids, found, strict=True) if f}

    def orphans_among(self, ids: set[str]) -> set[str]:
        """The subset of ``ids`` (known ones) whose raw row has no outcome yet."""
        if not ids:
            return set()
        orphans = self._read_orphans()
        if not orphans:
            return set()
        listed = list(ids)
        return {i for i, key in zip(listed, digests(listed), strict=True)
                if bytes(key).ljust(32, b"\0") in orphans}

    def healed(self, ids: set[str]) -> None:
        """These orphans get their outcome in this ingest: later copies are duplicates."""
        if ids and self._orphans:
            for key in digests(list(ids)):
                self._orphans.discard(bytes(key).ljust(32, b"\0"))

    def remember(self, ids: list[str]) -> None:
        self._add(ids)


def _prefixes(keys: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each 32-byte digest as a big-endian integer: ordered as the
    digests are (byte by byte)."""
    return keys.view(np.uint8).reshape(-1, 32)[:, :8].copy().view(">u8").ravel().astype(
        np.uint64)


# -- the pipeline --------------------------------------------------------------------------------
class _Item:
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


def _item_of(rec: RawRecord) -> _Item:
    """A record handed in by a caller; never raises. Normalized later, if not a duplicate."""
    tags = dict(rec.tags)
    if rec.parse_error is not None:
        text = rec.text if rec.text is not None else str(rec.payload)
        return _Item(rec.raw_trace_id or sha256_hex(text), "unknown", rec.source,
                     rec.received_at, tags, rec.project, text=text, reason=rec.parse_error,
                     rows=[])
    if rec.text is not None:
        text = rec.text
        rid = rec.raw_trace_id or id_of(rec.payload, text)
    else:
        rid, text = id_and_text(rec.payload)
        rid = rec.raw_trace_id or rid
    fmt = rec.format_hint if rec.format_hint != "auto" else detect_format(rec.payload)
    return _Item(rid, fmt or "unknown", rec.source, rec.received_at, tags, rec.project,
                 text=text, payload=rec.payload)


# Records normalized between two dedupe look-ups: small enough that their parsed payloads stay
# in cache and memory, large enough that the vectorized prefix check is cheap per record.
_CHUNK_RECORDS = 1000
_RAW_COLUMNS = ("raw_trace_id", "source", "format", "received_at", "project", "tags", "payload")
_SAMPLE_COLUMNS = ("sample_id", "provider", "model", "messages", "tools", "num_turns",
                   "has_images", "has_tool_calls", "created_at", "raw_trace_id", "source",
                   "project", "tags")
_REJECTED_COLUMNS = ("raw_trace_id", "source", "format", "received_at", "reason", "payload")


def _column(values: list[Any], type_: pa.DataType) -> pa.Array:
    """``pa.array(values)``, converting a value once when every row has the same one.

    Source, time, project and tags are the same for every record of a file; converting a
    Python dict to an Arrow map per row was a visible part of the write.
    """
    if len(values) > 1 and values[-1] == values[0] and values.count(values[0]) == len(values):
        return repeat_value(values[0], type_, len(values))
    return pa.array(values, type=type_)


class _Batch:
    """The rows of one commit per table, kept as columns (no per-row dicts)."""

    def __init__(self) -> None:
        self.num_read = 0
        self.num_bytes = 0
        """Characters of payload and messages text held (what a batch's memory is mostly)."""
        self.ids: set[str] = set()
        """raw_trace_ids this batch gives an outcome to (pending until it is committed)."""
        self.raw: dict[str, list[Any]] = {c: [] for c in _RAW_COLUMNS}
        self.sample_rows: list[SampleRow] = []
        self.sample_items: list[_Item] = []
        """The record each of ``sample_rows`` came from."""
        self.rejected: dict[str, list[Any]] = {c: [] for c in _REJECTED_COLUMNS}

    def add_raw(self, item: _Item) -> None:
        raw = self.raw
        raw["raw_trace_id"].append(item.rid)
        raw["source"].append(item.source)
        raw["format"].append(item.fmt)
        raw["received_at"].append(item.received_at)
        raw["project"].append(item.project)
        raw["tags"].append(item.tags)
        text = item.payload_text()
        raw["payload"].append(text)
        self.num_bytes += len(text)

    def add_rejected(self, item: _Item) -> None:
        rej = self.rejected
        rej["raw_trace_id"].append(item.rid)
        rej["source"].append(item.source)
        rej["format"].append(item.fmt)
        rej["received_at"].append(item.received_at)
        rej["reason"].append(item.reason)
        rej["payload"].append(item.payload_text())

    def add_samples(self, item: _Item, rows: list[SampleRow]) -> None:
        # Kept as the rows they came as; ``tables`` turns them into columns in one pass.
        self.sample_rows.extend(rows)
        self.sample_items.extend([item] * len(rows))
        for row in rows:
            self.num_bytes += len(row[3])

    @property
    def num_samples(self) -> int:
        return len(self.sample_rows)

    def _sample_columns(self) -> dict[str, list[Any]]:
        if not self.sample_rows:
            return {c: [] for c in _SAMPLE_COLUMNS}
        cols = dict(zip(_SAMPLE_COLUMNS, map(list, zip(*self.sample_rows, strict=True)),
                        strict=False))
        items = self.sample_items
        cols["created_at"] = [t if t is not None else item.received_at
                              for t, item in zip(cols["created_at"], items, strict=True)]
        cols["raw_trace_id"] = [item.rid for item in items]
        cols["source"] = [item.source for item in items]
        cols["project"] = [item.project for item in items]
        cols["tags"] = [item.tags for item in items]
        return cols

    def tables(self) -> list[tuple[str, pa.Table]]:
        """(table, rows) in commit order: raw rows before anything derived from them."""
        out = []
        for name, cols in (("raw_traces", self.raw), ("samples", self._sample_columns()),
                           ("rejected_traces", self.rejected)):
            schema = schema_of(name)
            num_rows = len(cols["raw_trace_id"])
            out.append((name, pa.Table.from_arrays(
                [_column(cols[f.name], f.type) if f.name in cols
                 else pa.nulls(num_rows, f.type) for f in schema], schema=schema)))
        return out


class _Writer:
    """Commits batches on a background thread, in order, while the next ones are normalized.

    The queue holds at most ``depth`` batches, so memory stays flat however fast the reader is.
    Parquet encoding and the catalog commit release the GIL for much of their time, so this
    overlaps them with normalization. A failed commit stops the writer (nothing after it is
    committed, as if the batches ran one after another) and is raised to the caller.

    With ``threaded=False`` each batch is committed inline when submitted. That is the default:
    on a loaded 2-core machine the thread measured more CPU and no better wall time (one run of
    100k records: 21.5 s CPU / 55 s wall threaded, 16.1 s / 48 s inline), since every thread
    there competes for the same cores (measured on the file path, which since writes data
    files in worker processes instead). Re-measure on an idle or larger machine before making
    it the default for ``ingest_records``.
    """

    def __init__(self, lake: Lake, summary: IngestSummary, lineage: Lineage | None,
                 lineages: Mapping[str, Lineage], *, threaded: bool, depth: int = 1) -> None:
        self.lake = lake
        self.summary = summary
        self.lineage = lineage
        self.lineages = lineages
        # Callers outside Dagster (the gateway's flusher, `factory ingest`) pass no lineage;
        # their commits are still stamped, per table, so samples lead back to raw_traces.
        self.default_run_id = f"ingest-{os.getpid()}-{datetime.now(UTC):%Y%m%dT%H%M%S%f}"
        self._queue: queue.Queue[tuple[_Batch, threading.Event] | None] = queue.Queue(depth)
        self._inflight: deque[tuple[set[str], threading.Event]] = deque()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="ingest-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, done = item
            try:
                if self._error is None:
                    self._commit(batch)
            except BaseException as exc:  # handed to the caller's thread, which re-raises it
                self._error = exc
            finally:
                done.set()

    def _commit(self, batch: _Batch) -> None:
        self._commit_tables([(name, functools.partial(self.lake.append, name, table))
                             for name, table in batch.tables()])

    def _commit_tables(self, commits: list[tuple[str, Callable[..., int | None]]]) -> None:
        """Run each table's commit (called with ``lineage=``) in order, raw_traces first."""
        raw_snap: int | None = None
        for name, commit in commits:
            lineage = self.lineages.get(name, self.lineage) or Lineage(
                run_id=self.default_run_id, asset_key=name)
            if name != "raw_traces" and raw_snap is not None:
                # samples / rejected_traces are made from the raw rows just committed: record
                # that snapshot as their source, so lineage reaches the raw traces.
                lineage = dataclasses.replace(lineage, reads={**lineage.reads,
                                                              "raw_traces": raw_snap})
            snap = commit(lineage=lineage)
            if snap is not None:
                self.summary.snapshots[name] = snap
            if name == "raw_traces":
                # No raw rows this round (all healed: their raw rows are older): the derived
                # rows still come from the raw table as it is now.
                raw_snap = snap if snap is not None else self.lake.snapshot_id("raw_traces")

    def commit_files(self, files: dict[str, list[str]],
                     describers: Mapping[str, FileDescriber] | None = None) -> None:
        """Commit data files written elsewhere (``FileTarget.write``), after every batch
        submitted before them; one snapshot per table, raw_traces first.

        Each table's list is emptied once its commit is made: after a failure ``files`` holds
        exactly the files no snapshot references (for the caller to remove).
        """
        self.wait_idle()

        def commit(name: str, *, lineage: Lineage) -> int | None:
            snap = self.lake.commit_files(name, files.get(name, []), lineage=lineage,
                                          describer=(describers or {}).get(name))
            files[name] = []
            return snap

        self._commit_tables([(name, functools.partial(commit, name)) for name in TABLE_NAMES])

    def submit(self, batch: _Batch) -> None:
        self.raise_error()
        if self._thread is None:
            self._commit(batch)
            return
        done = threading.Event()
        self._inflight.append((batch.ids, done))
        self._queue.put((batch, done))

    def pending(self, rid: str) -> bool:
        """Whether ``rid`` belongs to a submitted batch that is not committed yet."""
        if not self._inflight:
            return False
        while self._inflight and self._inflight[0][1].is_set():
            self._inflight.popleft()
        return any(rid in ids for ids, _ in self._inflight)

    def wait_idle(self) -> None:
        """Block until every submitted batch is committed (or the writer failed)."""
        for _, done in list(self._inflight):
            done.wait()
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Commit what was submitted, stop the thread, and raise the writer's error if any."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self.raise_error()


def _item_chunks(records: Iterable[RawRecord]) -> Iterator[list[_Item]]:
    """``records`` as items, ``_CHUNK_RECORDS`` at a time (lazily: constant memory)."""
    chunk: list[_Item] = []
    for rec in records:
        chunk.append(_item_of(rec))
        if len(chunk) >= _CHUNK_RECORDS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def ingest_records(lake: Lake, records: Iterable[RawRecord], *, lineage: Lineage | None = None,
                   batch_rows: int = 5000,
                   lineages: Mapping[str, Lineage] | None = None,
                   background_writes: bool = False) -> IngestSummary:
    """Store, normalize and write ``records``; one bad record never stops the others.

    Every ``batch_rows`` records read make one commit per table. ``lineage`` stamps every
    commit; ``lineages`` overrides it per table (a multi-asset writes each table as its own
    asset). ``background_writes`` commits each batch on a thread while the next one is
    normalized (see ``_Writer``). Returns the counts and the snapshots committed.
    """
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    known = _KnownIds(lake, lineage)

    return _ingest_chunks(lake, known, _item_chunks(records), lineage=lineage, lineages=lineages,
                          batch_rows=batch_rows, background_writes=background_writes)


def _ingest_chunks(lake: Lake, known: _KnownIds, chunks: Iterable[list[_Item]], *,
                   lineage: Lineage | None, lineages: Mapping[str, Lineage] | None,
                   batch_rows: int, background_writes: bool,
                   batch_bytes: int | None = None) -> IngestSummary:
    """Dedupe, normalize what is left to normalize, and commit, ``batch_rows`` per batch.

    With ``batch_bytes``, a batch is also committed once its payload and messages text reach
    that size (so a file of large records keeps the same memory as one of small ones).
    """
    summary = IngestSummary()
    pipeline = _Pipeline(lake, known, BlobStore(lake.settings), summary,
                         _Writer(lake, summary, lineage, lineages or {},
                                 threaded=background_writes))
    try:
        batch = _Batch()
        for items in chunks:
            while items:
                # A chunk never spans two batches: each batch is exactly batch_rows records.
                room = batch_rows - batch.num_read
                part, items = (items, []) if len(items) <= room else (items[:room], items[room:])
                pipeline.chunk(batch, part)
                if batch.num_read >= batch_rows or (batch_bytes is not None
                                                    and batch.num_bytes >= batch_bytes):
                    pipeline.submit(batch)
                    batch = _Batch()
        if batch.num_read:
            pipeline.submit(batch)
    finally:
        # Batches already handed over are committed even when reading failed, as they would
        # have been had each batch been written before the next was read.
        pipeline.writer.close()
    return summary


class _Pipeline:
    """Dedupe chunks of records and add what is new to the batches for the writer."""

    def __init__(self, lake: Lake, known: _KnownIds, blobs: BlobStore, summary: IngestSummary,
                 writer: _Writer) -> None:
        self.lake = lake
        self.known = known
        self.blobs = blobs
        self.summary = summary
        self.writer = writer

    def submit(self, batch: _Batch) -> None:
        self.summary.num_samples += batch.num_samples
        self.known.remember(batch.raw["raw_trace_id"])
        self.writer.submit(batch)

    def chunk(self, batch: _Batch, chunk: list[_Item]) -> None:
        summary = self.summary
        summary.read += len(chunk)
        batch.num_read += len(chunk)
        prepared: dict[str, _Item] = {}
        for item in chunk:
            rid = item.rid
            # Seen earlier in this run, in a batch not committed yet: a duplicate, exactly as
            # it would be once that batch is in the lake.
            if rid in prepared or rid in batch.ids or self.writer.pending(rid):
                summary.duplicates += 1
                continue
            prepared[rid] = item
        existing = self.known.existing(list(prepared))
        # raw_traces is committed first, so a crash before the samples/rejected commits leaves
        # raw rows with no outcome: those are re-normalized now (their raw row is not written
        # again).
        orphans = self.known.orphans_among(existing)
        self.known.healed(orphans)
        summary.duplicates += len(existing) - len(orphans)
        for rid, item in prepared.items():
            if rid in existing and rid not in orphans:
                continue
            batch.ids.add(rid)
            if rid not in orphans:
                batch.add_raw(item)
            if item.rows is None and item.reason is None:
                payload = item.payload
                if payload is None:  # skipped by a worker as maybe known: parse it again
                    # (a trace split from an OTLP export line has its own text)
                    try:
                        payload = parse_json(item.line_bytes().strip() if item.text is None
                                             else item.text)
                    except (ValueError, RecursionError) as exc:  # a record, never a crash
                        item.reason, item.rows = f"invalid JSON ({first_line(exc)})", []
                if item.reason is None:
                    item.reason, item.rows = outcome(payload, item.fmt, self.blobs)
            if item.reason is not None:
                summary.rejected += 1
                batch.add_rejected(item)
                continue
            summary.ingested += 1
            batch.add_samples(item, item.rows or [])


# -- files ---------------------------------------------------------------------------------------
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
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf) and not eof:
            more = fh.read(_CHUNK)
            eof = not more
            if on_bytes:
                on_bytes(len(more))
            buf, pos = buf[pos:] + more, 0
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
                more = fh.read(_CHUNK)
                eof = not more
                if on_bytes:
                    on_bytes(len(more))
                buf, pos = buf[pos:] + more, 0
                continue
            yield from make(None, buf[pos:pos + 10000],
                            f"{path.name}: element {index}: invalid JSON ({exc.msg})")
            return
        # An element that ends exactly at the buffer edge may be a truncated number: re-read.
        if end >= len(buf) and not eof:
            more = fh.read(_CHUNK)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        yield from make(value, buf[pos:end])
        index += 1
        pos = end
        if pos > _CHUNK:
            buf, pos = buf[pos:], 0


def ingest_paths(lake: Lake, paths: Iterable[str | Path], *, format: str = "auto",
                 tags: Mapping[str, str] | None = None, source: str = "upload",
                 project: str | None = None, lineage: Lineage | None = None,
                 lineages: Mapping[str, Lineage] | None = None, batch_rows: int = 1_000_000,
                 on_bytes: Callable[[int], None] | None = None, workers: int | None = None,
                 batch_bytes: int = 1 << 30) -> IngestSummary:
    """Ingest files and folders (``.jsonl``, ``.json``, ``.gz``) as one stream of records.

    JSON Lines files are cut into blocks of whole lines, and ``workers`` processes (default:
    one per CPU; 1 does it all in this process) each read a block, normalize it and write its
    rows as Parquet data files (``factory.ingest_blocks``). This process only dedupes across
    blocks and commits the files of many blocks at once, raw rows first, so memory stays flat
    however large the file. A file of less than two blocks in all is done in process, without
    the worker start-up. ``.json`` files are read here record by record.

    Data files are committed (one snapshot per table) every ``batch_rows`` records or
    ``batch_bytes`` bytes of input, whichever comes first, and at the end: few commits, because
    every Iceberg commit copies the table's whole metadata, which grows by a snapshot each time.
    A crash loses only the uncommitted files' work (unreferenced files, never half a record);
    re-ingesting the file completes it.
    """
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if batch_bytes < 1:
        raise ValueError(f"batch_bytes must be at least 1, got {batch_bytes}")
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected auto or one of "
                         f"{', '.join(FORMATS)}")
    files = list(iter_files(paths))
    num_workers = workers or default_workers()
    with _fewer_gc_passes():
        known = _KnownIds(lake, lineage)
        kinds = {path: _file_kind(path) for path in files}
        num_line_bytes = sum(p.stat().st_size for p in files if kinds[p] == "jsonl")
        block_bytes = _block_bytes(num_line_bytes, num_workers)
        ctx = FileContext(source=source, received_at=datetime.now(tz=UTC), tags=dict(tags or {}),
                          project=project, format_hint=format)
        targets = {name: lake.file_target(name) for name in TABLE_NAMES}
        run = _FileIngest(lake, known, ctx, lineage=lineage, lineages=lineages or {},
                          batch_rows=batch_rows, batch_bytes=batch_bytes, targets=targets,
                          on_bytes=on_bytes)
        blocks = _BlockWorkers(num_workers, known, lake, ctx, targets,
                               eager=num_line_bytes > block_bytes)
        try:
            for path in files:
                if kinds[path] == "jsonl":
                    for task in _line_blocks(path, block_bytes, on_bytes):
                        for done, result in blocks.submit(task):
                            run.block(done, result)
                    continue
                for done, result in blocks.drain():  # in file order: earlier lines first
                    run.block(done, result)
                for items in _item_chunks(read_file(path, source=source, tags=ctx.tags,
                                                    format_hint=format, project=project,
                                                    on_bytes=on_bytes)):
                    run.items(items)
            # The records held here so far are written while the workers finish their last
            # blocks, not after: what is left for the end is the commit (and the few records
            # of the last blocks).
            run.write_held()
            for done, result in blocks.drain():
                run.block(done, result)
            run.finish()
        except BaseException:
            blocks.close()
            run.abandon()
            raise
        blocks.close()
        return run.summary


def default_workers() -> int:
    """One normalizing process per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# The smallest block of lines handed to a worker: big enough that the inter-process hop is a
# small part of its cost. Large files get larger blocks (fewer, larger data files) up to
# _MAX_BLOCK_BYTES, while every worker still gets several blocks. Past 8 MiB a worker's CPU
# per record grows (its block, lines and rows no longer stay in cache): per 200k bench
# records, 10.0 CPU-s in 8 MiB blocks, 10.8 in 16 MiB, 11.3-12.7 in 32 MiB; 10.4-10.6 in 4.
_BLOCK_BYTES = 4 << 20
_MAX_BLOCK_BYTES = 8 << 20


def _block_bytes(num_bytes: int, workers: int) -> int:
    return max(_BLOCK_BYTES, min(_MAX_BLOCK_BYTES, num_bytes // (4 * workers)))


def _file_kind(path: Path) -> str:
    """``jsonl`` for JSON Lines (by name; a bare ``.gz`` by its first character), else ``json``."""
    with _open_text(path) as fh:
        kind = _kind_of(path, fh)
        if kind == "sniff":
            kind = "json" if _peek_nonspace(fh) == "[" else "jsonl"
    return kind


def _line_blocks(path: Path, block_bytes: int,
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


class _BlockWorkers:
    """Blocks through ``ingest_block``, in worker processes or in process, results in order.

    At most ``2 * workers`` blocks are in flight. The worker processes start (forked when
    this process has no other thread, else spawned: ``worker_context``) at the first block
    when ``eager``, else when a second block arrives. Every block, in a worker or here, checks
    against the ids the lake held when the ingest started, so records already there are not
    normalized again (ids given by earlier blocks are the main process's to drop).

    A block that fails leaves no data file behind: the locations it was given are removed.
    """

    def __init__(self, workers: int, known: _KnownIds, lake: Lake, ctx: FileContext,
                 targets: dict[str, FileTarget], *, eager: bool) -> None:
        self.workers = workers
        self.eager = eager
        self.known_at_start = list(known.arrays)
        self.lake = lake
        self.ctx = ctx
        self.blobs = BlobStore(lake.settings)
        self.targets = targets
        self._locations: dict[str, list[str]] = {name: [] for name in TABLE_NAMES}
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pending: deque[tuple[BlockTask, Future[BlockResult] | BlockResult]] = deque()
        self._num_blocks = 0

    def _new_locations(self) -> dict[str, str]:
        """A fresh data file location per table (handed out in runs: each run loads the
        table once)."""
        for name, free in self._locations.items():
            if not free:
                free.extend(self.lake.new_data_locations(name, 64))
        return {name: free.pop() for name, free in self._locations.items()}

    def submit(self, task: BlockTask) -> Iterator[tuple[BlockTask, BlockResult]]:
        """Queue a block; yields the results that must be taken out first."""
        self._num_blocks += 1
        task = dataclasses.replace(task, locations=self._new_locations())
        if self.workers > 1 and self._pool is None and (self.eager or self._num_blocks == 2):
            stop_idle_reader_pool()  # (the workers can then be forked)
            local = all(loc.startswith("file:") or "://" not in loc
                        for loc in task.locations.values())
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=worker_context(local_files=local),
                initializer=init_block_worker,
                initargs=([a.tobytes() for a in self.known_at_start], self.lake.settings,
                          self.targets))
        result: Future[BlockResult] | BlockResult
        if self._pool is None:
            try:
                result = ingest_block(task, self.ctx, targets=self.targets,
                                      known=self.known_at_start, blobs=self.blobs)
            except BaseException:
                self._forget(task)
                raise
        else:
            result = self._pool.submit(worker_block, task, self.ctx)
        self._pending.append((task, result))
        while len(self._pending) > 2 * self.workers:
            yield self._take()

    def drain(self) -> Iterator[tuple[BlockTask, BlockResult]]:
        while self._pending:
            yield self._take()

    def _take(self) -> tuple[BlockTask, BlockResult]:
        task, result = self._pending.popleft()
        if isinstance(result, BlockResult):
            return task, result
        try:
            return task, result.result()
        except BaseException:  # a worker failed (or died) mid-block
            self._forget(task)
            raise

    def _forget(self, task: BlockTask) -> None:
        """Remove whatever a failed block may have written."""
        _delete_files(self.lake, {name: [loc] for name, loc in task.locations.items()})

    def close(self) -> None:
        """Stop the workers; the data files of blocks never taken out are removed."""
        pending = list(self._pending)
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for task, result in pending:
            if isinstance(result, Future) and (result.cancelled()
                                               or result.exception() is not None):
                self._forget(task)
                continue
            done = result if isinstance(result, BlockResult) else result.result()
            _delete_files(self.lake, done.files)


def _delete_files(lake: Lake, files: Mapping[str, list[str]]) -> None:
    for name, data_files in files.items():
        try:
            lake.delete_files(name, data_files)
        except OSError:  # garbage left behind is harmless: never referenced by a snapshot
            pass


class _FileIngest:
    """The main process's side of a file ingest: dedupe across blocks, count, commit."""

    def __init__(self, lake: Lake, known: _KnownIds, ctx: FileContext, *,
                 lineage: Lineage | None, lineages: Mapping[str, Lineage], batch_rows: int,
                 batch_bytes: int, targets: dict[str, FileTarget],
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.lake = lake
        self.on_bytes = on_bytes
        self.known = known
        self.ctx = ctx
        self.batch_rows = batch_rows
        self.batch_bytes = batch_bytes
        self.summary = IngestSummary()
        self.writer = _Writer(lake, self.summary, lineage, lineages, threaded=False)
        self.pipeline = _Pipeline(lake, known, BlobStore(lake.settings), self.summary,
                                  self.writer)
        self.targets = targets
        self.batch = _Batch()
        """Records handled here (from .json files, lines that are not JSON, records a worker
        held back as known to the lake), written as data files like a block's rows."""
        self.files: dict[str, list[str]] = {name: [] for name in TABLE_NAMES}
        """Data files written and not committed yet: every table's are committed together,
        raw_traces first, so a crash never leaves a derived row without its raw row."""
        self.describers = {name: lake.describer(name) for name in TABLE_NAMES}
        """The Iceberg description of each of ``files``, made as they arrive (the commit,
        after the last block, has nothing else to do)."""
        self.num_rows = 0
        self.num_bytes = 0
        self.next_lineno = 1
        """The line number of the next block's first line (blocks come in file order)."""

    def items(self, items: list[_Item]) -> None:
        while items:
            room = self.batch_rows - self.batch.num_read
            part, items = (items, []) if len(items) <= room else (items[:room], items[room:])
            self.pipeline.chunk(self.batch, part)
            if self.batch.num_read >= self.batch_rows or self.batch.num_bytes >= self.batch_bytes:
                self._submit_batch()

    def _submit_batch(self) -> None:
        self._write_batch()
        self._commit_if_due()

    def _write_batch(self) -> None:
        """Write the records handled here as data files, for the next commit."""
        batch = self.batch
        if not batch.num_read:
            return
        self.summary.num_samples += batch.num_samples
        self.known.remember(batch.raw["raw_trace_id"])
        for name, table in batch.tables():
            if table.num_rows:
                location = self.lake.new_data_locations(name, 1)[0]
                self.files[name].append(self.targets[name].write(table, location))
                self.describers[name].add([location])
        self.num_rows += batch.num_read
        self.num_bytes += batch.num_bytes
        self.batch = _Batch()

    def block(self, task: BlockTask, result: BlockResult) -> None:
        try:
            self._block(task, result)
        except BaseException:  # its files are not in self.files yet: remove them here
            _delete_files(self.lake, result.files)
            raise

    def _block(self, task: BlockTask, result: BlockResult) -> None:
        summary = self.summary
        # Repeats of records an earlier block (or a .json file) of this ingest gave: the files
        # are rewritten without them, as if the block had known those ids.
        earlier = self.known.existing(result.ids) | (set(result.ids) & self.batch.ids)
        if earlier:
            self._drop(result, earlier)
        summary.read += result.num_read - len(result.held) - len(result.invalid)
        summary.duplicates += result.num_duplicates + len(earlier)
        for rid, rejected, num in zip(result.ids, result.rejected, result.num_samples,
                                      strict=True):
            if rid in earlier:
                continue
            if rejected:
                summary.rejected += 1
            else:
                summary.ingested += 1
                summary.num_samples += num
        self.known.remember([i for i in result.ids if i not in earlier] if earlier
                            else result.ids)
        # All described before any is listed: should a footer not read, the block's files are
        # all still its own to remove (``block``).
        for name, data_files in result.files.items():
            self.describers[name].add(data_files)
        for name, data_files in result.files.items():
            self.files[name].extend(data_files)
        result.files = {}  # self.files has them now
        # held and invalid records are counted when their batch is written
        self.num_rows += result.num_read - len(result.held) - len(result.invalid)
        self.num_bytes += result.num_bytes
        if self.on_bytes and result.plain:
            self.on_bytes(result.num_bytes)
        ctx = self.ctx
        first = 1 if result.start == 0 else self.next_lineno
        self.next_lineno = first + result.num_lines
        if result.invalid:  # rejected here: only this process knows the line numbers
            self.items([_Item(rid, "unknown", ctx.source, ctx.received_at, ctx.tags,
                              ctx.project, text=text, rows=[],
                              reason=invalid_json_reason(result.name, first + index, error))
                        for index, rid, text, error in result.invalid])
        if result.held:
            # Most are duplicates, whose lines are never read; a line is read back (from the
            # file, or a compressed file's block) only for a raw row that lacks an outcome.
            source, base = (task.data, 0) if task.data is not None else (task.path, task.start)
            self.items([_Item(rid, fmt, ctx.source, ctx.received_at, ctx.tags, ctx.project,
                              text=where if isinstance(where, str) else None,
                              ref=None if isinstance(where, str)
                              else (source, base + where[0], where[1]),
                              reason=reason, rows=[] if reason is not None else None)
                        for rid, fmt, where, reason in result.held])
        self._commit_if_due()

    def _drop(self, result: BlockResult, ids: set[str]) -> None:
        """Rewrite the block's files without the rows of ``ids`` (all of them: just delete
        the files, as for a file ingested twice in one go)."""
        everything = len(ids) == len(result.ids)
        drop = pa.array(sorted(ids), type=pa.string())
        kept: dict[str, list[str]] = {}
        for name, data_files in result.files.items():
            if not data_files:
                continue
            if not everything:
                rows = self.lake.read_files(name, data_files)
                keep = rows.filter(pc.invert(pc.is_in(rows.column("raw_trace_id"), drop)))
                if keep.num_rows:
                    location = self.lake.new_data_locations(name, 1)[0]
                    kept[name] = [self.targets[name].write(keep, location)]
            self.lake.delete_files(name, data_files)
        result.files = kept

    def _commit_if_due(self) -> None:
        if self.num_rows >= self.batch_rows or self.num_bytes >= self.batch_bytes:
            self._commit_files()

    def _commit_files(self) -> None:
        # The records held here so far go with this commit: a file of many blocks (each
        # with a few lines that are not JSON) does not pile them up until its end.
        self._write_batch()
        if any(self.files.values()):
            # (empties each table's list once committed)
            self.writer.commit_files(self.files, self.describers)
        self.num_rows = self.num_bytes = 0

    def write_held(self) -> None:
        """Write the records handled here so far (committed with the blocks' files)."""
        self._write_batch()

    def finish(self) -> None:
        self._commit_files()

    def abandon(self) -> None:
        """After a failure: the data files not committed are removed (commits already made
        stand, as they would have had the ingest stopped there)."""
        _delete_files(self.lake, self.files)
        self.files = {name: [] for name in TABLE_NAMES}


@contextmanager
def _fewer_gc_passes() -> Iterator[None]:
    """Raise the cyclic GC's first threshold while a file streams through.

    A batch keeps thousands of parsed records alive, and with the default threshold (700
    allocations) the collector re-walks them constantly: measured 30% of ingest time on the
    bench. Records are acyclic, so collecting less often frees the same memory.
    """
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], 50_000), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
