"""Blocks of JSON Lines to Parquet data files: the part of a file ingest that worker processes do.

``factory.ingest.ingest_paths`` cuts a JSON Lines file into blocks of whole lines and hands each
to ``ingest_block``, in a worker process (or in process for a small file). The worker reads its
block from the file itself, parses, hashes and normalizes every line
(``factory.normalize.rows.process_lines``), builds the ``raw_traces``, ``samples`` and
``rejected_traces`` rows of the block and writes them as Parquet data files
(``Lake.write_files``). It commits nothing. The main process gets back the data files, the ids
they hold and per-record counts: it drops the rows that repeat an earlier block (rare: the
files are rewritten), and commits the files of many blocks at once, ``raw_traces`` first.

So the main process handles a few kilobytes per block, where it used to receive every record,
build every row and encode all the Parquet itself: with it no longer the bottleneck, a file
ingest scales with the worker processes.
"""

from __future__ import annotations

import codecs
import ctypes
import functools
import gc
import multiprocessing.context
import multiprocessing.spawn
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from factory.normalize.rows import (
    LineError,
    LineResult,
    SampleRow,
    known_mask,
    process_lines,
)

if TYPE_CHECKING:
    from factory.blobs import BlobStore
    from factory.datafiles import FileTarget

TABLE_NAMES = ("raw_traces", "samples", "rejected_traces")


@dataclass(frozen=True)
class FileContext:
    """What every record of an ingest of files shares."""

    source: str
    received_at: datetime
    tags: dict[str, str]
    project: str | None
    format_hint: str


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


@dataclass
class BlockResult:
    """What a block gave: data files not committed yet, and what the main process needs."""

    name: str = ""
    """The file's name."""
    start: int = 0
    """Where the block starts in the file (0: its first line is line 1)."""
    num_read: int = 0
    """Records read (an OTLP export line counts one per trace), including everything below."""
    num_duplicates: int = 0
    """Records that repeat an earlier record of the same block (nothing written for them)."""
    files: dict[str, list[str]] = field(default_factory=dict)
    """Data files per table (locations), written and not committed."""
    ids: list[str] = field(default_factory=list)
    """The raw_trace_id of each raw row written, in the files' order."""
    rejected: list[bool] = field(default_factory=list)
    """Per id: went to rejected_traces (else to samples)."""
    num_samples: list[int] = field(default_factory=list)
    """Per id: sample rows written."""
    held: list[tuple[str, str, tuple[int, int] | str, str | None]] = field(
        default_factory=list)
    """Records whose id the lake holds already, as (id, format, where, rejection reason if
    known): not written, the main process decides (a duplicate, or a raw row left without an
    outcome by a crash). ``where`` is the record's own text, or (offset, length) of its line
    in the block: a re-ingest sends back ids, not the file, and the main process reads the
    few lines it needs."""
    num_bytes: int = 0
    """Bytes of the block (for batching commits)."""
    plain: bool = True
    """Read from the file by the worker (its bytes are the file's, for progress)."""
    num_lines: int = 0
    """Newlines in the block (the main process numbers the lines of the next blocks)."""
    invalid: list[LineError] = field(default_factory=list)
    """Lines that are not JSON, not written: their rejection reason names the line number,
    which only the main process knows (it does not read the file)."""


# -- the worker process --------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}

_SPAWNING = threading.Lock()
_SPAWNER: list[int] = []
"""The thread starting a worker, while it does (only its spawns are changed)."""


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        # The preparation data a spawned child gets names its main module: this thread's
        # workers get factory.worker_env instead of the parent's (see there). Only for this
        # thread: another one spawning meanwhile gets the usual data.
        with _SPAWNING:
            prepare = multiprocessing.spawn.get_preparation_data

            def worker_preparation(name: str) -> dict[str, Any]:
                data: dict[str, Any] = prepare(name)
                if _SPAWNER and _SPAWNER[0] == threading.get_ident():
                    data.pop("init_main_from_path", None)
                    data["init_main_from_name"] = "factory.worker_env"
                return data

            _SPAWNER.append(threading.get_ident())
            multiprocessing.spawn.get_preparation_data = worker_preparation
            try:
                return multiprocessing.context.SpawnProcess._Popen(process_obj)
            finally:
                multiprocessing.spawn.get_preparation_data = prepare
                _SPAWNER.clear()


class WorkerContext(multiprocessing.context.SpawnContext):
    """The spawn start method, with ``factory.worker_env`` as the children's main module
    (not the parent's), which also sets their environment."""

    Process = _WorkerProcess


def worker_context(*, local_files: bool = True) -> multiprocessing.context.BaseContext:
    """How the workers start: forked on Linux when this process runs no Python thread but the
    main one and the data files are local (``local_files``), else spawned (``WorkerContext``).

    A forked worker has every module loaded already, where a spawned one imports numpy,
    pyarrow and the normalizers first (0.2 CPU-s each, a few percent of the bench's 200k
    records on two cores: measured 5.69-5.82 s forked, 5.96-6.02 s spawned). A fork copies
    the locks of every thread as they are at that moment, so a process with other Python
    threads (a Dagster run, the gateway, pyiceberg's reader pool after a scan) spawns its
    workers. Native threads are not seen here: those of numpy's OpenBLAS and of Arrow's pools,
    which this process may run, reset themselves in a forked child; an object store's client
    (S3 data files) is not known to, so its workers are spawned. Other systems than Linux
    spawn, as Python does by default there.

    A forked worker keeps the memory allocator settings of this process: ``WORKER_ENV``
    (``factory.worker_env``) applies to spawned workers only (measured: no difference in CPU
    for the forked ones, with glibc's or Arrow's system allocator instead).
    """
    if (local_files and sys.platform == "linux" and threading.active_count() == 1
            and "fork" in multiprocessing.get_all_start_methods()):
        return multiprocessing.get_context("fork")
    return WorkerContext()


def _keep_freed_memory() -> None:
    """glibc's malloc: serve every block's buffers from the heap and keep what is freed.

    By default a buffer over 128 KiB (a block's bytes, its lines) is mapped fresh and
    unmapped when freed, and the heap's top is given back: every block faulted in its memory
    again (-17% of a worker's CPU with this, measured on the bench's 30k records). A worker
    is short-lived, so holding its high-water mark costs nothing. No-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 256 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def init_block_worker(known: list[bytes], settings: Any,
                      targets: dict[str, FileTarget]) -> None:
    """Set up a worker: the digests of the known ids, the blob store it writes images to, and
    how to write each table's files (no catalog, no pyiceberg: the worker starts faster)."""
    from factory.blobs import BlobStore

    _keep_freed_memory()
    _WORKER["known"] = [np.frombuffer(b, dtype="S32") for b in known]
    _WORKER["blobs"] = BlobStore(settings)
    _WORKER["targets"] = targets
    # Everything alive now (modules, the known ids) stays for the worker's life: out of the
    # collector's sight, so a full collection walks only what blocks leave behind.
    gc.freeze()


def worker_block(task: BlockTask, ctx: FileContext) -> BlockResult:
    """``ingest_block`` in a worker process set up by ``init_block_worker``.

    The cyclic collector is off during a block and collects once after it: a block's parsed
    records are acyclic and freed by reference counting, and the collector only re-walked
    the thousands alive at a time (the rare cycle, an exception's traceback, waits until the
    block ends).
    """
    gc.disable()
    try:
        return ingest_block(task, ctx, targets=_WORKER["targets"], known=_WORKER["known"],
                            blobs=_WORKER["blobs"])
    finally:
        gc.enable()
        gc.collect()


# -- one block -----------------------------------------------------------------------------------
def ingest_block(task: BlockTask, ctx: FileContext, *, targets: dict[str, FileTarget],
                 known: list[np.ndarray], blobs: BlobStore) -> BlockResult:
    """Read, normalize and write one block (see the module docstring)."""
    block = task.read()
    skip = 0
    if task.start == 0 and block.startswith(codecs.BOM_UTF8):
        skip = len(codecs.BOM_UTF8)
        block = block[skip:]  # a byte order mark is not part of the record
    lines = block.split(b"\n")
    invalid: list[LineError] = []
    results = process_lines(lines, name=task.name, first_lineno=1, format_hint=ctx.format_hint,
                            known=known, blobs=blobs, line_errors=invalid)
    out = BlockResult(name=task.name, start=task.start, plain=task.data is None,
                      num_read=len(results) + len(invalid), num_bytes=task.end - task.start,
                      num_lines=len(lines) - 1, invalid=invalid)
    rows = _Rows(block, lines)
    seen: set[str] = set()
    # Ids the lake may hold: records process_lines skipped, and rejections (a line that is not
    # JSON is rejected before any check) whose id is known.
    in_lake = (known_mask([r[1] for r in results], known) if any(len(a) for a in known)
               else None)
    for i, (index, rid, text, fmt, reason, sample_rows) in enumerate(results):
        if rid in seen:
            out.num_duplicates += 1
            continue
        seen.add(rid)
        if in_lake is not None and in_lake[i]:  # the main process decides what it is
            if text is not None:
                out.held.append((rid, fmt, text, reason))
                continue
            line = lines[index]
            lead = len(line) - len(line.lstrip())
            out.held.append((rid, fmt, (skip + int(rows.offsets[index]) + lead,
                                        len(line.strip())), reason))
            continue
        rows.add(index, rid, text, fmt, reason, sample_rows)
    for name, table in rows.tables(ctx):
        if table.num_rows:
            out.files[name] = [targets[name].write(table, task.locations[name])]
    out.ids, out.rejected, out.num_samples = rows.per_id()
    return out


class _Rows:
    """The rows of one block's three tables, the payloads kept as ranges of the block.

    A record's stored payload is its line, stripped; those are cut out of the block as an
    Arrow view array (no Python string per line, see ``_payloads``). Records with a text of
    their own (a trace split from an OTLP export line, a line that is not valid JSON, stored
    decoded with replacement characters) are kept as strings.
    """

    def __init__(self, block: bytes, lines: list[bytes]) -> None:
        self.block = block
        self.lines = lines
        # raw rows and rejected rows: those backed by a line, then those with their own text
        self.raw_lines: list[tuple[int, str, str]] = []
        self.raw_texts: list[tuple[str, str, str]] = []
        self.rej_lines: list[tuple[int, str, str, str]] = []
        self.rej_texts: list[tuple[str, str, str, str]] = []
        self.samples: list[SampleRow] = []
        self.sample_ids: list[str] = []
        self.outcome: dict[str, int] = {}
        """Per raw id: -1 rejected, else its number of samples."""

    def add(self, index: int, rid: str, text: str | None, fmt: str, reason: str | None,
            sample_rows: list[SampleRow] | None) -> None:
        if text is None:
            self.raw_lines.append((index, rid, fmt))
        else:
            self.raw_texts.append((rid, fmt, text))
        if reason is not None:
            if text is None:
                self.rej_lines.append((index, rid, fmt, reason))
            else:
                self.rej_texts.append((rid, fmt, reason, text))
            self.outcome[rid] = -1
            return
        sample_rows = sample_rows or []
        self.samples.extend(sample_rows)
        self.sample_ids.extend([rid] * len(sample_rows))
        self.outcome[rid] = len(sample_rows)

    def per_id(self) -> tuple[list[str], list[bool], list[int]]:
        ids = [r[1] for r in self.raw_lines] + [r[0] for r in self.raw_texts]
        outcome = self.outcome
        return ids, [outcome[i] < 0 for i in ids], [max(outcome[i], 0) for i in ids]

    @functools.cached_property
    def _lengths(self) -> np.ndarray:
        """Each line's length (without its newline)."""
        return np.fromiter(map(len, self.lines), dtype=np.int64, count=len(self.lines))

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Where each line starts in the block, and the block's end: line ``i`` with its
        newline is ``block[offsets[i]:offsets[i + 1]]``."""
        offsets = np.zeros(len(self.lines) + 1, dtype=np.int64)
        np.cumsum(self._lengths + 1, out=offsets[1:])  # each line with its newline...
        np.minimum(offsets, len(self.block), out=offsets)  # ...but the last may have none
        return offsets

    @functools.cached_property
    def _bytes(self) -> np.ndarray:
        return np.frombuffer(self.block, dtype=np.uint8)

    def _spans(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(start in the block, length) of each line at ``indices``, stripped of ASCII
        whitespace as ``bytes.strip`` does (what the record was parsed from)."""
        index = np.array(indices, dtype=np.int64)
        starts = self.offsets[index]
        lengths = self._lengths[index]
        data = self._bytes
        # One byte at a time off the ends that have whitespace (a CRLF file's "\r"); a line
        # with more than a few is measured in Python.
        for _ in range(5):
            lead = (lengths > 0) & np.isin(data[np.minimum(starts, len(data) - 1)],
                                           _WHITESPACE)
            trail = (lengths > 0) & np.isin(data[np.maximum(starts + lengths - 1, 0)],
                                            _WHITESPACE)
            padded = lead | trail
            if not padded.any():
                break
            starts += lead
            lengths -= lead
            lengths -= trail & (lengths > 0)
        else:
            for k in np.flatnonzero(padded).tolist():
                line = self.lines[indices[k]]
                starts[k] = self.offsets[indices[k]] + len(line) - len(line.lstrip())
                lengths[k] = len(line.strip())
        return starts, lengths

    def _payloads(self, indices: list[int], texts: list[str]) -> pa.Array:
        """The stripped lines at ``indices``, then ``texts``, as one string array.

        The lines are cut out of the block as a view array (16 bytes per line pointing into
        the block), checked as UTF-8 and copied once into a string array: 7x cheaper than
        taking the lines out of a binary array over the block, then trimming them (measured:
        0.021 s against 0.003 s per 16 MiB block in isolation; -0.1 CPU-s per 200k bench records
        in the pipeline).
        """
        if not indices:
            return pa.array(texts, type=pa.string())
        starts, lengths = self._spans(indices)
        try:
            strings = _views(self.block, self._bytes, starts, lengths).cast(
                pa.string_view()).cast(pa.string())
        except pa.ArrowInvalid:  # not UTF-8 (a line json.loads took): stored as decoded
            strings = pa.array([self.lines[i].strip().decode("utf-8", "replace")
                                for i in indices], type=pa.string())
        return strings if not texts else pa.concat_arrays(
            [strings, pa.array(texts, type=pa.string())])

    def tables(self, ctx: FileContext) -> list[tuple[str, pa.Table]]:
        """(table, rows) for each of the three tables."""
        raw_n = len(self.raw_lines) + len(self.raw_texts)
        rej_n = len(self.rej_lines) + len(self.rej_texts)
        raw = pa.table({
            "raw_trace_id": pa.array([r[1] for r in self.raw_lines]
                                     + [r[0] for r in self.raw_texts], type=pa.string()),
            "source": repeat_value(ctx.source, pa.string(), raw_n),
            "format": pa.array([r[2] for r in self.raw_lines] + [r[1] for r in self.raw_texts],
                               type=pa.string()),
            "received_at": repeat_value(ctx.received_at, pa.timestamp("us", tz="UTC"), raw_n),
            "project": repeat_value(ctx.project, pa.string(), raw_n),
            "tags": repeat_value(ctx.tags, pa.map_(pa.string(), pa.string()), raw_n),
            "payload": self._payloads([r[0] for r in self.raw_lines],
                                      [r[2] for r in self.raw_texts]),
        })
        rejected = pa.table({
            "raw_trace_id": pa.array([r[1] for r in self.rej_lines]
                                     + [r[0] for r in self.rej_texts], type=pa.string()),
            "source": repeat_value(ctx.source, pa.string(), rej_n),
            "format": pa.array([r[2] for r in self.rej_lines] + [r[1] for r in self.rej_texts],
                               type=pa.string()),
            "received_at": repeat_value(ctx.received_at, pa.timestamp("us", tz="UTC"), rej_n),
            "reason": pa.array([r[3] for r in self.rej_lines] + [r[2] for r in self.rej_texts],
                               type=pa.string()),
            "payload": self._payloads([r[0] for r in self.rej_lines],
                                      [r[3] for r in self.rej_texts]),
        })
        return [("raw_traces", raw), ("samples", self._samples(ctx)),
                ("rejected_traces", rejected)]

    def _samples(self, ctx: FileContext) -> pa.Table:
        num = len(self.samples)
        if num:
            (sample_id, provider, model, messages, tools, num_turns, has_images,
             has_tool_calls, created_at) = map(list, zip(*self.samples, strict=True))
        else:
            sample_id = provider = model = messages = tools = num_turns = []
            has_images = has_tool_calls = created_at = []
        when = [t if t is not None else ctx.received_at for t in created_at]
        return pa.table({
            "sample_id": pa.array(sample_id, type=pa.string()),
            "provider": pa.array(provider, type=pa.string()),
            "model": pa.array(model, type=pa.string()),
            "messages": pa.array(messages, type=pa.string()),
            "tools": pa.array(tools, type=pa.string()),
            "num_turns": pa.array(num_turns, type=pa.int32()),
            "has_images": pa.array(has_images, type=pa.bool_()),
            "has_tool_calls": pa.array(has_tool_calls, type=pa.bool_()),
            "created_at": pa.array(when, type=pa.timestamp("us", tz="UTC")),
            "raw_trace_id": pa.array(self.sample_ids, type=pa.string()),
            "source": repeat_value(ctx.source, pa.string(), num),
            "project": repeat_value(ctx.project, pa.string(), num),
            "tags": repeat_value(ctx.tags, pa.map_(pa.string(), pa.string()), num),
        })


_WHITESPACE = np.frombuffer(b" \t\n\r\x0b\x0c", dtype=np.uint8)
"""What ``bytes.strip`` strips."""

_VIEW_BUFFER_BYTES = 2**31 - 1
"""A view addresses its buffer with a 32-bit offset: a block at least this large (one line of
gigabytes) gets a buffer per line."""

_INLINE = 12
"""A view of at most this many bytes holds them itself."""


def _views(block: bytes, data: np.ndarray, starts: np.ndarray,
           lengths: np.ndarray) -> pa.Array:
    """A ``binary_view`` array of ``block[start:start + length]`` for each span, without
    copying the block (Arrow's view layout: length, then the bytes themselves when at most 12,
    else their first 4, the buffer's index and the offset in it)."""
    num = len(starts)
    if num and int(lengths.max()) >= 2**31 - 1:  # a view's length is 32-bit, as is a value's
        raise ValueError(f"a record of {int(lengths.max())} bytes: over the 2 GiB a stored "
                         "payload can hold")
    views = np.zeros((num, 16), dtype=np.uint8)
    views[:, 0:4] = lengths.astype("<i4").view(np.uint8).reshape(num, 4)
    short = lengths <= _INLINE
    if short.any():  # the bytes in the view, zero-padded
        at = starts[short, None] + np.arange(_INLINE)
        inside = np.arange(_INLINE) < lengths[short, None]
        views[short, 4:16] = np.where(inside, data[np.minimum(at, len(data) - 1)], 0)
    long = ~short
    if long.any():
        views[long, 4:8] = data[starts[long, None] + np.arange(4)]
        if len(block) < _VIEW_BUFFER_BYTES:
            buffers = [pa.py_buffer(block)]
            views[long, 12:16] = starts[long].astype("<i4").view(np.uint8).reshape(-1, 4)
        else:
            whole = pa.py_buffer(block)
            buffers = [whole.slice(int(s), int(n)) for s, n in zip(starts[long].tolist(),
                                                                  lengths[long].tolist(),
                                                                  strict=True)]
            views[long, 8:12] = np.arange(len(buffers), dtype="<i4").view(
                np.uint8).reshape(-1, 4)
    else:
        buffers = []
    return pa.Array.from_buffers(pa.binary_view(), num, [None, pa.py_buffer(views), *buffers])


def repeat_value(value: Any, type_: pa.DataType, num: int) -> pa.Array:
    """``num`` copies of one value, converted once (a dict to an Arrow map per row was slow)."""
    one = pa.array([value], type=type_)
    return one.take(pa.array(np.zeros(num, dtype=np.int32)))


__all__ = ["TABLE_NAMES", "BlockResult", "BlockTask", "FileContext", "LineResult",
           "WorkerContext", "ingest_block", "init_block_worker", "repeat_value", "worker_block",
           "worker_context"]
