"""The ingest pipeline: records in, ``raw_traces`` first, then ``samples``/``rejected_traces``.

The gateway's proxy captures and OTLP traces hand ``ingest_records`` an iterable of
``RawRecord``; files (the CLI, the Dagster assets) go through ``ingest_paths``, which has JSON
Lines parsed, hashed and normalized by worker processes (``factory.ingest.workers``) and the
results merged back in file order. Either way records are processed in batches: each batch is
one commit per table (never one per record), raw rows before anything derived from them. A
record seen before is counted as a duplicate and nothing is written for it
(``factory.ingest.dedupe``): re-ingesting a file commits no snapshot at all.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from factory.blobs import BlobStore
from factory.datafiles import FileTarget
from factory.ingest.commit import Writer
from factory.ingest.dedupe import KnownIds
from factory.ingest.files import (
    BlockTask,
    block_size,
    file_kind,
    iter_files,
    line_blocks,
    read_file,
)
from factory.ingest.records import FileContext, IngestSummary, Item, RawRecord, item_chunks
from factory.ingest.rows import first_line, invalid_json_reason, outcome, parse_json
from factory.ingest.tables import TABLE_NAMES, Batch
from factory.ingest.workers import BlockResult, BlockWorkers, delete_files
from factory.lake import Lake, Lineage
from factory.normalize import FORMATS


def ingest_records(lake: Lake, records: Iterable[RawRecord], *,
                   lineages: Mapping[str, Lineage] | None = None, batch_rows: int = 5000,
                   background_writes: bool = False, new_ids: bool = False) -> IngestSummary:
    """Store, normalize and write ``records``; one bad record never stops the others.

    Every ``batch_rows`` records read make one commit per table, each stamped with the
    table's entry of ``lineages`` (see ``Writer``). ``background_writes`` commits each batch on
    a thread while the next one is normalized. ``new_ids``: no record's ``raw_trace_id`` can be
    in the lake yet (the gateway's first attempt at captures it spooled), so the lake's ids are
    not read (a read that grows with raw_traces); duplicates among ``records`` are still
    skipped. Returns the counts and the snapshots committed.
    """
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    lineages = lineages or {}
    summary = IngestSummary()
    writer = Writer(lake, summary, lineages, threaded=background_writes)
    known = KnownIds(lake, lineages.get("raw_traces"), read=not new_ids)
    pipeline = _Pipeline(lake, known, summary, writer, batch_rows=batch_rows)
    try:
        for items in item_chunks(records):
            for full in pipeline.add(items):
                writer.submit(full)
        if (last := pipeline.take()) is not None:
            writer.submit(last)
    finally:
        # Batches already handed over are committed even when reading failed, as they would
        # have been had each batch been written before the next was read.
        writer.close()
    return summary


class _Pipeline:
    """Dedupe chunks of records and add what is new to batches, ``batch_rows`` records each
    (or fewer, once their payload and messages text reach ``batch_bytes``: a file of large
    records keeps the same memory as one of small ones)."""

    def __init__(self, lake: Lake, known: KnownIds, summary: IngestSummary, writer: Writer, *,
                 batch_rows: int, batch_bytes: int | None = None) -> None:
        self.known = known
        self.blobs = BlobStore(lake.settings)
        self.summary = summary
        self.writer = writer
        self.batch_rows = batch_rows
        self.batch_bytes = batch_bytes
        self.batch = Batch()
        """The batch records are added to."""

    def add(self, items: list[Item]) -> Iterator[Batch]:
        """Add ``items`` to the open batch; yields each batch that fills (``take``)."""
        while items:
            # A chunk never spans two batches: each batch is exactly batch_rows records.
            room = self.batch_rows - self.batch.num_read
            part, items = (items, []) if len(items) <= room else (items[:room], items[room:])
            self._chunk(self.batch, part)
            if self.batch.num_read >= self.batch_rows or (
                    self.batch_bytes is not None and self.batch.num_bytes >= self.batch_bytes):
                full, self.batch = self.batch, Batch()
                self._close(full)
                yield full

    def take(self) -> Batch | None:
        """The open batch, closed (``_close``), with a new one open in its place; None if it
        holds no record."""
        batch, self.batch = self.batch, Batch()
        if not batch.num_read:
            return None
        self._close(batch)
        return batch

    def _close(self, batch: Batch) -> None:
        """A batch about to be written: its samples counted, its ids known from now on."""
        self.summary.num_samples += batch.num_samples
        self.known.remember(batch.raw_ids)

    def _chunk(self, batch: Batch, chunk: list[Item]) -> None:
        summary = self.summary
        summary.read += len(chunk)
        batch.num_read += len(chunk)
        prepared: dict[str, Item] = {}
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



def ingest_paths(lake: Lake, paths: Iterable[str | Path], *, format: str = "auto",
                 tags: Mapping[str, str] | None = None, source: str = "upload",
                 project: str | None = None, lineages: Mapping[str, Lineage] | None = None,
                 batch_rows: int = 1_000_000,
                 on_bytes: Callable[[int], None] | None = None, workers: int | None = None,
                 batch_bytes: int = 1 << 30) -> IngestSummary:
    """Ingest files and folders (``.jsonl``, ``.json``, ``.gz``) as one stream of records.

    JSON Lines files are cut into blocks of whole lines, and ``workers`` processes (default:
    one per CPU; 1 does it all in this process) each read a block, normalize it and write its
    rows as Parquet data files (``factory.ingest.workers``). This process only dedupes across
    blocks and commits the files of many blocks at once, raw rows first, so memory stays flat
    however large the file. A file of less than two blocks in all is done in process, without
    the worker start-up. ``.json`` files are read here record by record.

    Data files are committed (one snapshot per table) every ``batch_rows`` records or
    ``batch_bytes`` bytes of input, whichever comes first, and at the end: few commits, because
    every Iceberg commit copies the table's whole metadata, which grows by a snapshot each time.
    A crash loses only the uncommitted files' work (unreferenced files, never half a record);
    re-ingesting the file completes it. Each table's commits are stamped with its entry of
    ``lineages`` (see ``Writer``).
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
    lineages = lineages or {}
    with _fewer_gc_passes():
        known = KnownIds(lake, lineages.get("raw_traces"))
        kinds = {path: file_kind(path) for path in files}
        num_line_bytes = sum(p.stat().st_size for p in files if kinds[p] == "jsonl")
        block_bytes = block_size(num_line_bytes, num_workers)
        ctx = FileContext(source=source, received_at=datetime.now(tz=UTC), tags=dict(tags or {}),
                          project=project, format_hint=format)
        targets = {name: lake.file_target(name) for name in TABLE_NAMES}
        run = _FileIngest(lake, known, ctx, lineages=lineages, batch_rows=batch_rows,
                          batch_bytes=batch_bytes, targets=targets, on_bytes=on_bytes)
        blocks = BlockWorkers(num_workers, known, lake, ctx, targets,
                              eager=num_line_bytes > block_bytes)
        try:
            for path in files:
                if kinds[path] == "jsonl":
                    for task in line_blocks(path, block_bytes, on_bytes):
                        for done, result in blocks.submit(task):
                            run.block(done, result)
                    continue
                for done, result in blocks.drain():  # in file order: earlier lines first
                    run.block(done, result)
                for items in item_chunks(read_file(path, source=source, tags=ctx.tags,
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



class _FileIngest:
    """The main process's side of a file ingest: dedupe across blocks, count, commit."""

    def __init__(self, lake: Lake, known: KnownIds, ctx: FileContext, *,
                 lineages: Mapping[str, Lineage], batch_rows: int, batch_bytes: int,
                 targets: dict[str, FileTarget],
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.lake = lake
        self.on_bytes = on_bytes
        self.known = known
        self.ctx = ctx
        self.batch_rows = batch_rows
        self.batch_bytes = batch_bytes
        self.summary = IngestSummary()
        self.writer = Writer(lake, self.summary, lineages, threaded=False)
        self.pipeline = _Pipeline(lake, known, self.summary, self.writer, batch_rows=batch_rows,
                                  batch_bytes=batch_bytes)
        """Records handled here (from .json files, lines that are not JSON, records a worker
        held back as known to the lake), written as data files like a block's rows."""
        self.targets = targets
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

    def items(self, items: list[Item]) -> None:
        for batch in self.pipeline.add(items):
            self._write(batch)
            self._commit_if_due()

    def _write(self, batch: Batch) -> None:
        """Write the records handled here as data files, for the next commit."""
        for name, table in batch.tables():
            if table.num_rows:
                location = self.lake.new_data_locations(name, 1)[0]
                self.files[name].append(self.targets[name].write(table, location))
                self.describers[name].add([location])
        self.num_rows += batch.num_read
        self.num_bytes += batch.num_bytes

    def write_held(self) -> None:
        """Write the records handled here so far (committed with the blocks' files)."""
        if (batch := self.pipeline.take()) is not None:
            self._write(batch)

    def block(self, task: BlockTask, result: BlockResult) -> None:
        try:
            self._block(task, result)
        except BaseException:  # its files are not in self.files yet: remove them here
            delete_files(self.lake, result.files)
            raise

    def _block(self, task: BlockTask, result: BlockResult) -> None:
        summary = self.summary
        # Repeats of records an earlier block (or a .json file) of this ingest gave: the files
        # are rewritten without them, as if the block had known those ids.
        earlier = self.known.existing(result.ids) | (set(result.ids) & self.pipeline.batch.ids)
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
            self.items([Item(rid, "unknown", ctx.source, ctx.received_at, ctx.tags,
                              ctx.project, text=text, rows=[],
                              reason=invalid_json_reason(result.name, first + index, error))
                        for index, rid, text, error in result.invalid])
        if result.held:
            # Most are duplicates, whose lines are never read; a line is read back (from the
            # file, or a compressed file's block) only for a raw row that lacks an outcome.
            source, base = (task.data, 0) if task.data is not None else (task.path, task.start)
            self.items([Item(rid, fmt, ctx.source, ctx.received_at, ctx.tags, ctx.project,
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
        self.write_held()
        if any(self.files.values()):
            # (empties each table's list once committed)
            self.writer.commit_files(self.files, self.describers)
        self.num_rows = self.num_bytes = 0

    def finish(self) -> None:
        self._commit_files()

    def abandon(self) -> None:
        """After a failure: the data files not committed are removed (commits already made
        stand, as they would have had the ingest stopped there)."""
        delete_files(self.lake, self.files)
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
